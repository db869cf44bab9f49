/* What AMX's TDPBF16PS computes per k-pair on this CPU (the instruction stock oneDNN uses for
 * bf16 prefill), measured against candidate emulations. Needs amx_bf16 and Linux >= 5.16.
 *
 *   cc -O2 -march=native -mamx-tile -mamx-bf16 -ffp-contract=off -frounding-math \
 *      -o /tmp/amx_probe benchmarks/dpbf16/amx_probe.c -lm && /tmp/amx_probe [tiles, default 8000]
 *
 * One instruction per random tile set: C 16 x 16 float32, A 16 rows x ONE bf16 pair, B one pair
 * per column, so each C[m][n] takes exactly one k-step: c' = f(c, a0 b0, a1 b1). Inputs cycle
 * through four regimes (moderate exponents; any exponent with inf/NaN; tiny and denormal; products
 * near 2^-126). Candidates (z = a denormal read as zero of its sign, ftz = a denormal result
 * flushed to zero of its sign):
 *   pair_then_acc     ftz(RN(c + ftz(RN(a0 b0 + a1 b1))))   products exact (ftz), the pair summed
 *                     and rounded first, then added to the accumulator
 *   pair_rz           the same with the pair sum rounded toward zero
 *   seq_even_first    ftz(RN(ftz(RN(c + a0 b0)) + a1 b1))    the SDM text's reading
 *   fused_3term       ftz(RN(c + a0 b0 + a1 b1)), one rounding
 * Prints per candidate the lanes whose bits differ (NaN = NaN) and, for pair_then_acc, how many of
 * those differ in more than the sign of a zero.
 *
 * Then the order inside one instruction: 2, 4 and 16 pairs per A row (moderate values, exponents
 * within +-10), q_k = RN(a_2k b_2k + a_2k+1 b_2k+1) (the one-pair rule) and the chain's
 * candidates: c + q_0 + ... in k order, in reverse order, the q's summed first, a pairwise tree,
 * and the exact sum rounded once; with the distribution of the instruction's result minus the
 * exactly rounded sum in ulps.
 */
#include <fenv.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>


#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static float f_(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }
static uint32_t b_(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static float bf(uint16_t h) { return f_((uint32_t)h << 16); }
static float z(float x) { return (b_(x) & 0x7f800000u) ? x : f_(b_(x) & 0x80000000u); }
static float add(float a, float b, int mode) {
    fesetround(mode);
    volatile float r = a + b;
    fesetround(FE_TONEAREST);
    return r;
}

typedef struct {
    uint8_t palette, start, res[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tilecfg;

static uint64_t S = 88172645463325252ull;
static uint64_t rnd(void) { S ^= S << 13; S ^= S >> 7; S ^= S << 17; return S; }
static int MODE;
static uint16_t r_bf(void) {
    int e;
    switch (MODE) {
    case 0: e = 127 + (int)(rnd() % 61) - 30; break;
    case 1: e = (int)(rnd() % 256); break;
    case 2: e = (int)(rnd() % 12); break;
    default: e = 50 + (int)(rnd() % 30); break;
    }
    uint16_t man = (uint16_t)(rnd() & 0x7f);
    if (MODE && rnd() % 50 == 0) e = 0;
    if (MODE && rnd() % 80 == 0) { e = 0; man = 0; }
    if (MODE == 1 && rnd() % 200 == 0) e = 255;
    return (uint16_t)(((rnd() & 1) << 15) | (e << 7) | man);
}
static float r_acc(void) {
    const uint32_t e = MODE == 0 ? 97 + rnd() % 60 : MODE == 1 ? rnd() % 256 : MODE == 2 ? rnd() % 10 : rnd() % 20;
    float c = f_((uint32_t)((rnd() & 1) << 31) | (e << 23) | (uint32_t)(rnd() & 0x7fffff));
    if (MODE && rnd() % 30 == 0) c = f_(b_(c) & 0x807fffffu);   /* denormal */
    return c;
}

enum { PAIR, PAIR_RZ, SEQ, FUSED3, NCAND };
static const char *NAMES[NCAND] = {"pair_then_acc", "pair_rz", "seq_even_first", "fused_3term"};

/* the order of several pairs in one instruction (tile config for kp pairs per A row) */
static void order(int kp, long N) {
    tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[0] = 16; cfg.colsb[0] = 64;
    cfg.rows[1] = 16; cfg.colsb[1] = (uint16_t)(4 * kp);
    cfg.rows[2] = (uint8_t)kp; cfg.colsb[2] = 64;
    _tile_loadconfig(&cfg);
    enum { ASC, DESC, QFIRST, TREE, EXACT1, NO };
    static const char *names[NO] = {"c + q0 + q1 + ...", "c + q_last + ...", "c + (q0 + q1 + ...)",
                                    "c + tree(q)", "exact, one rounding"};
    long bad[NO] = {0}, hist[9] = {0};
    static float C[16][16], R[16][16];
    static uint16_t A[16][32], B[16][16][2];
    for (long it = 0; it < N; it++) {
        for (int m = 0; m < 16; m++) {
            for (int k = 0; k < 2 * kp; k++)
                A[m][k] = (uint16_t)(((rnd() & 1) << 15) | ((117 + rnd() % 21) << 7) | (rnd() & 0x7f));
            for (int n = 0; n < 16; n++)
                C[m][n] = f_((uint32_t)((rnd() & 1) << 31) | (uint32_t)((117 + rnd() % 20) << 23) | (uint32_t)(rnd() & 0x7fffff));
        }
        for (int k = 0; k < kp; k++)
            for (int n = 0; n < 16; n++)
                for (int h = 0; h < 2; h++)
                    B[k][n][h] = (uint16_t)(((rnd() & 1) << 15) | ((117 + rnd() % 21) << 7) | (rnd() & 0x7f));
        _tile_loadd(0, C, 64);
        _tile_loadd(1, A, sizeof A[0]);
        _tile_loadd(2, B, 64);
        _tile_dpbf16ps(0, 1, 2);
        _tile_stored(0, R, 64);
        for (int m = 0; m < 16; m++)
            for (int n = 0; n < 16; n++) {
                float q[16], t[16], e[NO];
                long double ex = C[m][n];
                for (int k = 0; k < kp; k++) {
                    const float p0 = bf(A[m][2 * k]) * bf(B[k][n][0]), p1 = bf(A[m][2 * k + 1]) * bf(B[k][n][1]);
                    q[k] = p0 + p1;
                    ex += (long double)p0 + (long double)p1;
                }
                float a = C[m][n];
                for (int k = 0; k < kp; k++) a = a + q[k];
                e[ASC] = a;
                a = C[m][n];
                for (int k = kp - 1; k >= 0; k--) a = a + q[k];
                e[DESC] = a;
                a = q[0];
                for (int k = 1; k < kp; k++) a = a + q[k];
                e[QFIRST] = C[m][n] + a;
                memcpy(t, q, sizeof t);
                for (int w = kp / 2; w >= 1; w /= 2)
                    for (int i = 0; i < w; i++) t[i] = t[i] + t[i + w];
                e[TREE] = C[m][n] + t[0];
                e[EXACT1] = (float)ex;
                for (int v = 0; v < NO; v++) bad[v] += b_(e[v]) != b_(R[m][n]);
                long d = (long)(int32_t)b_(R[m][n]) - (long)(int32_t)b_(e[EXACT1]);
                if (e[EXACT1] < 0) d = -d;
                hist[d < -3 ? 0 : d > 3 ? 8 : d + 4]++;
            }
    }
    _tile_release();
    printf("%d pairs per instruction, %ld lanes; lanes whose bits differ:", kp, N * 256);
    for (int v = 0; v < NO; v++) printf(" %s %ld;", names[v], bad[v]);
    printf("\n  instruction - exactly rounded, ulps (<= -4 .. >= 4):");
    for (int i = 0; i < 9; i++) printf(" %ld", hist[i]);
    printf("\n");
}

int main(int argc, char **argv) {
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) {
        perror("arch_prctl(ARCH_REQ_XCOMP_PERM)");
        return 2;
    }
    tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[0] = 16; cfg.colsb[0] = 64;   /* C */
    cfg.rows[1] = 16; cfg.colsb[1] = 4;    /* A: one pair a row */
    cfg.rows[2] = 1;  cfg.colsb[2] = 64;   /* B: one pair a column */
    _tile_loadconfig(&cfg);
    const long N = argc > 1 ? atol(argv[1]) : 8000;
    long bad[4][NCAND] = {{0}}, beyond_zero_sign = 0;
    for (long it = 0; it < N; it++) {
        MODE = (int)(it % 4);
        float C[16][16], R[16][16];
        uint16_t A[16][2], B[16][2];
        for (int m = 0; m < 16; m++) {
            A[m][0] = r_bf(); A[m][1] = r_bf();
            for (int n = 0; n < 16; n++) C[m][n] = r_acc();
        }
        for (int n = 0; n < 16; n++) { B[n][0] = r_bf(); B[n][1] = r_bf(); }
        _tile_loadd(0, C, 64);
        _tile_loadd(1, A, 4);
        _tile_loadd(2, B, 64);
        _tile_dpbf16ps(0, 1, 2);
        _tile_stored(0, R, 64);
        for (int m = 0; m < 16; m++)
            for (int n = 0; n < 16; n++) {
                const float x0 = z(bf(A[m][0])), x1 = z(bf(A[m][1])), y0 = z(bf(B[n][0])), y1 = z(bf(B[n][1]));
                const float c = z(C[m][n]), p0 = z(x0 * y0), p1 = z(x1 * y1);
                float e[NCAND];
                e[PAIR] = z(add(c, z(add(p0, p1, FE_TONEAREST)), FE_TONEAREST));
                e[PAIR_RZ] = z(add(c, z(add(p0, p1, FE_TOWARDZERO)), FE_TONEAREST));
                e[SEQ] = z(add(z(add(c, p0, FE_TONEAREST)), p1, FE_TONEAREST));
                e[FUSED3] = z((float)((double)c + (double)x0 * y0 + (double)x1 * y1));  /* ~exact in double here */
                for (int v = 0; v < NCAND; v++) {
                    if ((isnan(e[v]) && isnan(R[m][n])) || b_(e[v]) == b_(R[m][n])) continue;
                    bad[MODE][v]++;
                    if (v == PAIR && ((b_(e[v]) | b_(R[m][n])) & 0x7fffffffu)) beyond_zero_sign++;
                }
            }
    }
    _tile_release();
    printf("lanes %ld per regime; lanes whose bits differ from TDPBF16PS\n", N * 64);
    printf("  %-16s %10s %10s %10s %10s\n", "candidate", "moderate", "any+inf", "tiny", "near2^-126");
    for (int v = 0; v < NCAND; v++)
        printf("  %-16s %10ld %10ld %10ld %10ld\n", NAMES[v], bad[0][v], bad[1][v], bad[2][v], bad[3][v]);
    printf("  pair_then_acc lanes differing in more than the sign of a zero: %ld\n", beyond_zero_sign);
    order(2, N / 4);
    order(4, N / 4);
    order(16, N / 4);
    return 0;
}
