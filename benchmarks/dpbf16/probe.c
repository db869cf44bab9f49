/* What AVX512-BF16's vdpbf16ps computes on this CPU, measured against candidate emulations, and
 * how fast it is against vfmadd231ps. Needs a CPU with avx512_bf16.
 *
 *   cc -O2 -march=native -ffp-contract=off -o /tmp/dpbf16_probe benchmarks/dpbf16/probe.c -lm
 *   /tmp/dpbf16_probe [lanes/16, default 2000000]
 *
 * Random 32-bf16 x 32-bf16 x 16-float32 inputs (moderate, full-range, tiny and denormal
 * exponents, accumulators at and next to +-2^-126, exact cancellations, inf/NaN), one
 * instruction, then each candidate per lane; prints the lanes where a candidate's bits differ
 * (NaN = NaN, payload aside), the first few differences of the sequential SDM reading, and a
 * throughput/latency loop. Candidates:
 *   sdm_odd_first   ftz(ftz(c + ftz(a1 b1)) + ftz(a0 b0)), every op rounded: the SDM's text
 *   sdm_even_first  the same, element 2j first
 *   fused_ftz_before  ftz(fmaf(a0, b0, ftz(fmaf(a1, b1, c)))), flushing below 2^-126 after the
 *                     binary32 rounding (tininess "before" with a bounded exponent)
 *   dp (the kernel's) fused, odd element first, DAZ, FTZ with tininess after rounding to 24 bits
 *                     with an unbounded exponent (|a b + c| < 2^-126 - 2^-151 -> signed zero)
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static float f_(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }
static uint32_t b_(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static float bf(uint16_t h) { return f_((uint32_t)h << 16); }
static float z(float x) { return (b_(x) & 0x7f800000u) ? x : f_(b_(x) & 0x80000000u); }  /* DAZ / FTZ */

static float dp(float c, float a, float b) {
    a = z(a); b = z(b); c = z(c);
    const float r = fmaf(a, b, c);
    const uint32_t ar = b_(r) & 0x7fffffffu;
    if (ar < 0x00800000u) return f_(b_(r) & 0x80000000u);
    if (ar == 0x00800000u) {
        const double p = (double)a * (double)b, s = (double)c + p, bb = s - (double)c;
        const double t = ((double)c - (s - bb)) + (p - bb), T = 0x1p-126 - 0x1p-151, as = fabs(s);
        if (as < T || (as == T && t != 0 && ((t < 0) != (s < 0)))) return f_(b_(r) & 0x80000000u);
    }
    return r;
}

enum { SDM_ODD, SDM_EVEN, FUSED_BEFORE, DP, NCAND };
static const char *NAMES[NCAND] = {"sdm_odd_first", "sdm_even_first", "fused_ftz_before", "dp"};

static float cand(int v, float c, uint16_t a0, uint16_t a1, uint16_t b0, uint16_t b1) {
    const float x0 = z(bf(a0)), x1 = z(bf(a1)), y0 = z(bf(b0)), y1 = z(bf(b1));
    c = z(c);
    switch (v) {
    case SDM_ODD: return z(z(c + z(x1 * y1)) + z(x0 * y0));
    case SDM_EVEN: return z(z(c + z(x0 * y0)) + z(x1 * y1));
    case FUSED_BEFORE: return z(fmaf(x0, y0, z(fmaf(x1, y1, c))));
    default: return dp(dp(c, x1, y1), x0, y0);
    }
}

static uint64_t S = 88172645463325252ull;
static uint64_t rnd(void) { S ^= S << 13; S ^= S >> 7; S ^= S << 17; return S; }
static uint16_t r_bf(int mode) {
    uint16_t sign = (uint16_t)((rnd() & 1) << 15), man = (uint16_t)(rnd() & 0x7f);
    int e;
    switch (mode) {
    case 0: e = 127 + (int)(rnd() % 21) - 10; break;   /* moderate */
    case 1: e = (int)(rnd() % 256); break;             /* anything */
    case 2: e = (int)(rnd() % 12); break;              /* tiny, denormal */
    default: e = 50 + (int)(rnd() % 30); break;        /* products near 2^-126 */
    }
    if (rnd() % 50 == 0) e = 0;
    if (rnd() % 80 == 0) { e = 0; man = 0; }
    if (rnd() % 200 == 0) e = 255;
    return (uint16_t)(sign | (e << 7) | man);
}
static float r_acc(int mode) {
    const uint32_t sign = (uint32_t)((rnd() & 1) << 31);
    int e;
    switch (mode) {
    case 0: e = 127 + (int)(rnd() % 21) - 10; break;
    case 1: e = (int)(rnd() % 256); break;
    case 2: e = (int)(rnd() % 10); break;
    default: e = (int)(rnd() % 20); break;
    }
    if (rnd() % 30 == 0) e = 0;
    uint32_t m = (uint32_t)(rnd() & 0x7fffff);
    if (rnd() % 40 == 0) m = 0;
    return f_(sign | ((uint32_t)e << 23) | m);
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* NC independent accumulator chains in registers (a compile-time count: a runtime one would
 * keep them in memory) */
#define SPEED(NC)                                                                              \
    static void speed_##NC(long N) {                                                           \
        __m512 a[NC];                                                                          \
        for (int i = 0; i < NC; i++) a[i] = _mm512_set1_ps(i * 1e-3f);                          \
        __m512i x = _mm512_set1_epi32(0x3f803f80), y = _mm512_set1_epi32(0x3f803f80);          \
        __m512 fx = _mm512_set1_ps(1.0f), fy = _mm512_set1_ps(1e-7f);                          \
        double t0 = now();                                                                     \
        for (long i = 0; i < N; i++) {                                                         \
            _Pragma("GCC unroll 16") for (int j = 0; j < NC; j++)                              \
                a[j] = _mm512_dpbf16_ps(a[j], (__m512bh)x, (__m512bh)y);                        \
            __asm__ volatile("" : "+v"(x));                                                    \
        }                                                                                      \
        double t1 = now();                                                                     \
        for (long i = 0; i < N; i++) {                                                         \
            _Pragma("GCC unroll 16") for (int j = 0; j < NC; j++)                              \
                a[j] = _mm512_fmadd_ps(fx, fy, a[j]);                                          \
            __asm__ volatile("" : "+v"(fx));                                                   \
        }                                                                                      \
        double t2 = now();                                                                     \
        const double dn = (t1 - t0) / N / NC * 1e9, fn = (t2 - t1) / N / NC * 1e9;             \
        printf("%2d independent chains: vdpbf16ps %.3f ns (32 MACs), vfmadd231ps %.3f ns "      \
               "(16 MACs) per instruction -> MACs/ns %.1f vs %.1f\n", NC, dn, fn, 32 / dn,     \
               16 / fn);                                                                       \
        float o[16], s = 0;                                                                    \
        for (int j = 0; j < NC; j++) { _mm512_storeu_ps(o, a[j]); s += o[0]; }                  \
        if (s == 12345) printf("%g\n", s);                                                     \
    }
SPEED(1)
SPEED(4)
SPEED(12)

static void speed(void) {
    speed_1(20000000);
    speed_4(20000000);
    speed_12(20000000);
}

int main(int argc, char **argv) {
    const long N = argc > 1 ? atol(argv[1]) : 2000000;
    long bad[NCAND] = {0}, nan_payload = 0, shown = 0;
    for (long it = 0; it < N; it++) {
        const int mode = it % 5 == 4 ? 0 : (int)(it % 5);
        uint16_t A[32], B[32];
        float C[16], R[16];
        for (int i = 0; i < 32; i++) { A[i] = r_bf(mode); B[i] = r_bf(mode); }
        for (int i = 0; i < 16; i++) C[i] = r_acc(mode);
        if (it % 11 == 0)   /* accumulators at and next to +-2^-126 */
            for (int j = 0; j < 16; j++) C[j] = f_((uint32_t)((rnd() & 1) << 31) | (0x00800000u + (uint32_t)(rnd() % 3)));
        if (it % 7 == 0)    /* (near) cancellation of the first product */
            for (int j = 0; j < 16; j++)
                C[j] = -(bf(A[2 * j + 1]) * bf(B[2 * j + 1])) * (1 + (float)((int)(rnd() % 5) - 2) * 0x1p-8f);
        __m512bh a, b;
        memcpy(&a, A, 64);
        memcpy(&b, B, 64);
        _mm512_storeu_ps(R, _mm512_dpbf16_ps(_mm512_loadu_ps(C), a, b));
        for (int j = 0; j < 16; j++)
            for (int v = 0; v < NCAND; v++) {
                const float e = cand(v, C[j], A[2 * j], A[2 * j + 1], B[2 * j], B[2 * j + 1]);
                if (isnan(e) && isnan(R[j])) { nan_payload += v == DP && b_(e) != b_(R[j]); continue; }
                if (b_(e) == b_(R[j])) continue;
                bad[v]++;
                if (v == SDM_ODD && shown < 6) {
                    shown++;
                    printf("sdm_odd_first differs: c=%a a0=%04x a1=%04x b0=%04x b1=%04x instruction=%08x emulation=%08x\n",
                           C[j], A[2 * j], A[2 * j + 1], B[2 * j], B[2 * j + 1], b_(R[j]), b_(e));
                }
            }
    }
    printf("lanes %ld; lanes whose bits differ from the instruction:\n", N * 16);
    for (int v = 0; v < NCAND; v++) printf("  %-18s %ld\n", NAMES[v], bad[v]);
    printf("  (dp: NaN lanes with another payload: %ld; the kernel writes one canonical NaN)\n", nan_payload);
    speed();
    return bad[DP] != 0;
}
