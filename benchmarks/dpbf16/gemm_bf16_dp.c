/* A PROTOTYPE, not built into the package (benchmarks/dpbf16_ab.py builds and measures it):
 * pairwise bf16 x bf16 GEMM for CPU with the contract of AVX512-BF16's vdpbf16ps, run with that
 * instruction where the CPU has it and agrees with the emulation below, and emulated bit for bit
 * elsewhere (AVX-512, AVX2, scalar: the same bits, checked by the benchmark, which also holds its
 * torch specification). Measured slower than kernels/csrc/gemm_bf16.c on this project's
 * AVX512-BF16 host except at one-row decode (BENCHMARKS.md): vdpbf16ps retires half the MACs per
 * cycle of two FMA ports there.
 *
 *   out[m, n] = canon(fold16(lanes)),  x, w bfloat16 rows padded with +0 to K32 = 32 ceil(K / 32)
 *
 * lane j (0..15) runs, over u = 0, 1, ... in order from +0,
 *     acc_j = dp(acc_j, x[32u + 2j + 1], w[32u + 2j + 1]);  acc_j = dp(acc_j, x[32u + 2j], w[32u + 2j])
 * dp(c, a, b): a, b, c with a zero exponent field (zero, denormal) read as zero of their sign;
 *     r = a b + c exactly, rounded to nearest-even to 24 bits with an unbounded exponent; a
 *     nonzero r below 2^-126 in magnitude becomes zero of r's sign; else r rounded to binary32
 *     (the same as fmaf(a, b, c) when |r| >= 2^-126). inf / NaN as fmaf.
 * fold16 is gemm_bf16.c's (h_i = l_i + l_(i+8), ((h0 + h4) + (h2 + h6)) + ((h1 + h5) + (h3 + h7)),
 * IEEE binary32 adds) and canon turns every NaN into the quiet NaN 0x7fc00000 (the instruction and
 * fmaf pick NaN payloads differently).
 *
 * dp is vdpbf16ps's arithmetic as measured on an Intel Xeon (Sapphire Rapids-class): the odd
 * element first, one rounding per product (fused), DAZ on the inputs, FTZ with tininess after
 * rounding; 96 M random lanes bit for bit, inf/NaN/denormal/2^-126 boundary cases included
 * (benchmarks/dpbf16/probe.c). skyrl_gemm_bf16_dp_path() checks the instruction against dp on
 * such cases once per process and falls back to the emulation if they differ.
 *
 * The emulation: with x already flushed (skyrl_bf16_pack_rows) an fma chain on the widened
 * values IS dp unless some partial result is tiny. If every nonzero product has a biased exponent
 * sum e(x) + e(w) >= 143 it is a multiple of 2^-125, so every partial sum is zero or >= 2^-125:
 * never tiny. Each output checks that with the minimum exponent of its x row (from the packing)
 * and of its w row (a pass per column panel; a denormal w, exponent field 0, always fails the
 * check: the chain would read it unflushed) and recomputes with the scalar dp otherwise (the
 * decision depends only on the two rows: batch invariance holds).
 */
#include "fixed_order.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define TINY_SUM 143   /* e(x) + e(w) >= this: every partial sum is 0 or >= 2^-125 */

static inline uint32_t f_bits(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static inline float bits_f(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }
static inline float daz(float x) {
    const uint32_t u = f_bits(x);
    return (u & 0x7f800000u) ? x : bits_f(u & 0x80000000u);
}

/* dp(c, a, b) of the header, scalar, exactly */
static inline float dp1(float c, float a, float b) {
    a = daz(a);
    b = daz(b);
    c = daz(c);
    const float r = fmaf(a, b, c);
    const uint32_t ar = f_bits(r) & 0x7fffffffu;
    if (ar < 0x00800000u) return bits_f(f_bits(r) & 0x80000000u);
    if (ar == 0x00800000u) {   /* |fmaf| = 2^-126: tiny iff |a b + c| < 2^-126 - 2^-151 (TwoSum) */
        const double p = (double)a * (double)b, s = (double)c + p, bb = s - (double)c;
        const double t = ((double)c - (s - bb)) + (p - bb), T = 0x1p-126 - 0x1p-151, as = fabs(s);
        if (as < T || (as == T && t != 0 && ((t < 0) != (s < 0)))) return bits_f(f_bits(r) & 0x80000000u);
    }
    return r;
}

static inline float fold16(const float *l) {
    float h[8];
    for (int i = 0; i < 8; i++) h[i] = l[i] + l[i + 8];
    const float b0 = h[0] + h[4], b1 = h[1] + h[5], b2 = h[2] + h[6], b3 = h[3] + h[7];
    const float o = (b0 + b2) + (b1 + b3);
    return o != o ? bits_f(0x7fc00000u) : o;
}

/* one output with the scalar dp: x packed (K32 values), w K values (+0 beyond) */
static float dot_dp_scalar(const uint16_t *x, const uint16_t *w, int64_t K) {
    float l[16] = {0};
    const int64_t K32 = (K + 31) / 32 * 32;
    for (int64_t u = 0; u < K32; u += 32)
        for (int j = 0; j < 16; j++) {
            const int64_t k1 = u + 2 * j + 1, k0 = u + 2 * j;
            l[j] = dp1(l[j], bf16_to_f32(x[k1]), k1 < K ? bf16_to_f32(w[k1]) : 0.0f);
            l[j] = dp1(l[j], bf16_to_f32(x[k0]), k0 < K ? bf16_to_f32(w[k0]) : 0.0f);
        }
    return fold16(l);
}

/* ---------------------------------------------------------------------------------------- */
/* packing: float32 or bfloat16 rows -> bfloat16 rows of K32 values (denormals flushed, +0 pad)  */

/* x [M, K] (float32 if x_is_bf16 == 0, else bfloat16) at leading dim ldx -> xb [M, K32]; for
 * each row exact[m] = 1 when every value is a bfloat16 (its low 16 bits zero), and minexp[m] the
 * smallest exponent field of a nonzero value after the flush (255 when none). Returns the number
 * of exact rows. */
int64_t skyrl_bf16_pack_rows(const void *x, int x_is_bf16, int64_t ldx, int64_t M, int64_t K,
                             uint16_t *xb, uint8_t *exact, int32_t *minexp) {
    const int64_t K32 = (K + 31) / 32 * 32;
    int64_t n_exact = 0;
    for (int64_t m = 0; m < M; m++) {
        uint16_t *dst = xb + m * K32;
        int ok = 1, me = 255;
        for (int64_t k = 0; k < K; k++) {
            uint16_t h;
            if (x_is_bf16) {
                h = ((const uint16_t *)x)[m * ldx + k];
            } else {
                const uint32_t u = f_bits(((const float *)x)[m * ldx + k]);
                h = (uint16_t)(u >> 16);
                ok &= (u & 0xffffu) == 0;
            }
            const int e = (h >> 7) & 0xff;
            if (e == 0) h &= 0x8000u;                       /* DAZ */
            else if (e < me) me = e;
            dst[k] = h;
        }
        for (int64_t k = K; k < K32; k++) dst[k] = 0;
        exact[m] = (uint8_t)ok;
        minexp[m] = me;
        n_exact += ok;
    }
    return n_exact;
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
/* smallest exponent field of a nonzero value of w[0:K] (255 when none; a denormal gives 0) */
static int row_minexp(const uint16_t *w, int64_t K) {
    int64_t k = 0;
    unsigned me = 0xffffu;   /* min over (|h| - 1) as uint16: zeros wrap to 0xffff */
#if defined(__AVX512BW__)
    __m512i acc = _mm512_set1_epi16(-1);
    const __m512i mag = _mm512_set1_epi16(0x7fff), one = _mm512_set1_epi16(1);
    for (; k + 32 <= K; k += 32) {
        const __m512i v = _mm512_and_si512(_mm512_loadu_si512((const void *)(w + k)), mag);
        acc = _mm512_min_epu16(acc, _mm512_sub_epi16(v, one));
    }
    uint16_t t[32];
    _mm512_storeu_si512((void *)t, acc);
    for (int i = 0; i < 32; i++) me = t[i] < me ? t[i] : me;
#elif defined(__AVX2__)
    __m256i acc = _mm256_set1_epi16(-1);
    const __m256i mag = _mm256_set1_epi16(0x7fff), one = _mm256_set1_epi16(1);
    for (; k + 16 <= K; k += 16) {
        const __m256i v = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(w + k)), mag);
        acc = _mm256_min_epu16(acc, _mm256_sub_epi16(v, one));
    }
    uint16_t t[16];
    _mm256_storeu_si256((__m256i *)t, acc);
    for (int i = 0; i < 16; i++) me = t[i] < me ? t[i] : me;
#endif
    for (; k < K; k++) {
        const unsigned v = (unsigned)((w[k] & 0x7fffu) - 1u) & 0xffffu;
        me = v < me ? v : me;
    }
    return me == 0xffffu ? 255 : (int)(((me + 1u) >> 7) & 0xffu);
}
#endif

/* ---------------------------------------------------------------------------------------- */
/* the vector forms: xp / wp hold 32 values of a row (pairs), v16 the 16 lane accumulators     */

#if defined(__AVX512F__) && defined(__AVX512BW__)
typedef struct { __m512 v; } v16;
static inline v16 v16_zero(void) { return (v16){_mm512_setzero_ps()}; }
static inline void v16_store(float *p, v16 a) { _mm512_storeu_ps(p, a.v); }
typedef struct { __m512 odd, even; } xp;
static inline xp xp_load(const uint16_t *p) {
    const __m512i u = _mm512_loadu_si512((const void *)p);
    return (xp){_mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u))),
                _mm512_castsi512_ps(_mm512_slli_epi32(u, 16))};
}
static inline xp xp_tail(const uint16_t *p, int n) {       /* n < 32 values, +0 beyond */
    const __m512i u = _mm512_maskz_loadu_epi16((__mmask32)((1u << n) - 1u), (const void *)p);
    return (xp){_mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u))),
                _mm512_castsi512_ps(_mm512_slli_epi32(u, 16))};
}
static inline v16 v16_dp(v16 c, xp a, xp b) {
    c.v = _mm512_fmadd_ps(a.odd, b.odd, c.v);
    return (v16){_mm512_fmadd_ps(a.even, b.even, c.v)};
}
#if defined(__AVX512BF16__)
#define HAVE_HW 1
typedef struct { __m512i v; } hp;
static inline hp hp_load(const uint16_t *p) { return (hp){_mm512_loadu_si512((const void *)p)}; }
static inline hp hp_tail(const uint16_t *p, int n) {
    return (hp){_mm512_maskz_loadu_epi16((__mmask32)((1u << n) - 1u), (const void *)p)};
}
static inline v16 v16_hw(v16 c, hp a, hp b) {
    return (v16){_mm512_dpbf16_ps(c.v, (__m512bh)a.v, (__m512bh)b.v)};
}
#endif
#define MR_MAX 4
#define NR_WIDE 4
#define NR_ONE 8
#elif defined(__AVX2__) && defined(__FMA__)
typedef struct { __m256 lo, hi; } v16;
static inline v16 v16_zero(void) { return (v16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline void v16_store(float *p, v16 a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
typedef struct { __m256 odd_lo, even_lo, odd_hi, even_hi; } xp;
static inline xp xp_from(__m256i lo, __m256i hi) {
    const __m256i m = _mm256_set1_epi32((int)0xffff0000u);
    return (xp){_mm256_castsi256_ps(_mm256_and_si256(lo, m)), _mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)),
                _mm256_castsi256_ps(_mm256_and_si256(hi, m)), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
}
static inline xp xp_load(const uint16_t *p) {
    return xp_from(_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)(p + 16)));
}
static inline xp xp_tail(const uint16_t *p, int n) {
    uint16_t t[32] = {0};
    memcpy(t, p, (size_t)n * 2);
    return xp_load(t);
}
static inline v16 v16_dp(v16 c, xp a, xp b) {
    c.lo = _mm256_fmadd_ps(a.odd_lo, b.odd_lo, c.lo);
    c.hi = _mm256_fmadd_ps(a.odd_hi, b.odd_hi, c.hi);
    c.lo = _mm256_fmadd_ps(a.even_lo, b.even_lo, c.lo);
    c.hi = _mm256_fmadd_ps(a.even_hi, b.even_hi, c.hi);
    return c;
}
#define MR_MAX 2
#define NR_WIDE 2
#define NR_ONE 4
#endif

#if defined(MR_MAX)
#define VECTOR 1
/* the emulation: one tile of MR rows x NR columns, fma chains (valid where TINY_SUM holds) */
#define ETILE(MR, NR)                                                                          \
    static void etile_##MR##x##NR(const uint16_t *x, int64_t ldx, const uint16_t *w,           \
                                  int64_t ldw, float *out, int64_t ldo, int64_t K) {           \
        v16 acc[MR][NR];                                                                       \
        for (int i = 0; i < MR; i++)                                                           \
            for (int j = 0; j < NR; j++) acc[i][j] = v16_zero();                               \
        const int64_t k32 = K - K % 32;                                                        \
        for (int64_t u = 0; u < k32; u += 32) {                                                \
            xp xv[MR];                                                                         \
            for (int i = 0; i < MR; i++) xv[i] = xp_load(x + i * ldx + u);                     \
            for (int j = 0; j < NR; j++) {                                                     \
                const xp wv = xp_load(w + j * ldw + u);                                        \
                for (int i = 0; i < MR; i++) acc[i][j] = v16_dp(acc[i][j], xv[i], wv);         \
            }                                                                                  \
        }                                                                                      \
        if (k32 < K) {                                                                         \
            xp xv[MR];                                                                         \
            for (int i = 0; i < MR; i++) xv[i] = xp_load(x + i * ldx + k32);                   \
            for (int j = 0; j < NR; j++) {                                                     \
                const xp wv = xp_tail(w + j * ldw + k32, (int)(K - k32));                      \
                for (int i = 0; i < MR; i++) acc[i][j] = v16_dp(acc[i][j], xv[i], wv);         \
            }                                                                                  \
        }                                                                                      \
        float l[16];                                                                           \
        for (int i = 0; i < MR; i++)                                                           \
            for (int j = 0; j < NR; j++) {                                                     \
                v16_store(l, acc[i][j]);                                                       \
                out[i * ldo + j] = fold16(l);                                                  \
            }                                                                                  \
    }
#define DEF_ETILE(MR, NR) ETILE(MR, NR)
DEF_ETILE(1, 1)
DEF_ETILE(2, 1)
DEF_ETILE(1, NR_ONE)
DEF_ETILE(1, NR_WIDE)
DEF_ETILE(2, NR_WIDE)
#if MR_MAX == 4
DEF_ETILE(3, 1)
DEF_ETILE(4, 1)
DEF_ETILE(3, NR_WIDE)
DEF_ETILE(4, NR_WIDE)
#endif
#endif

#if defined(HAVE_HW)
/* the instruction: one tile of MR rows x NR columns */
#define HTILE(MR, NR)                                                                          \
    static void htile_##MR##x##NR(const uint16_t *x, int64_t ldx, const uint16_t *w,           \
                                  int64_t ldw, float *out, int64_t ldo, int64_t K) {           \
        v16 acc[MR][NR];                                                                       \
        for (int i = 0; i < MR; i++)                                                           \
            for (int j = 0; j < NR; j++) acc[i][j] = v16_zero();                               \
        const int64_t k32 = K - K % 32;                                                        \
        for (int64_t u = 0; u < k32; u += 32) {                                                \
            hp xv[MR];                                                                         \
            for (int i = 0; i < MR; i++) xv[i] = hp_load(x + i * ldx + u);                     \
            for (int j = 0; j < NR; j++) {                                                     \
                const hp wv = hp_load(w + j * ldw + u);                                        \
                for (int i = 0; i < MR; i++) acc[i][j] = v16_hw(acc[i][j], xv[i], wv);         \
            }                                                                                  \
        }                                                                                      \
        if (k32 < K) {                                                                         \
            hp xv[MR];                                                                         \
            for (int i = 0; i < MR; i++) xv[i] = hp_load(x + i * ldx + k32);                   \
            for (int j = 0; j < NR; j++) {                                                     \
                const hp wv = hp_tail(w + j * ldw + k32, (int)(K - k32));                      \
                for (int i = 0; i < MR; i++) acc[i][j] = v16_hw(acc[i][j], xv[i], wv);         \
            }                                                                                  \
        }                                                                                      \
        float l[16];                                                                           \
        for (int i = 0; i < MR; i++)                                                           \
            for (int j = 0; j < NR; j++) {                                                     \
                v16_store(l, acc[i][j]);                                                       \
                out[i * ldo + j] = fold16(l);                                                  \
            }                                                                                  \
    }
#define DEF_HTILE(MR, NR) HTILE(MR, NR)
DEF_HTILE(1, 1)
DEF_HTILE(2, 1)
DEF_HTILE(3, 1)
DEF_HTILE(4, 1)
DEF_HTILE(1, NR_ONE)
DEF_HTILE(1, NR_WIDE)
DEF_HTILE(2, NR_WIDE)
DEF_HTILE(3, NR_WIDE)
DEF_HTILE(4, NR_WIDE)

/* does the instruction give dp's bits here? fixed cases: the 2^-126 boundary both ways, tiny
 * products, denormal inputs, overflowing products, signed zeros, NaN (as NaN) */
static int hw_agrees(void) {
    static const uint16_t A[32] = {0x0080, 0x8000, 0x3f80, 0x0100, 0x7f00, 0xff00, 0x0001, 0x3f81,
                                   0x2664, 0x9a83, 0x0189, 0x023b, 0x11c2, 0xba27, 0x8000, 0x0000,
                                   0x7f80, 0x3f80, 0x4000, 0xc000, 0x1f80, 0x2000, 0x0040, 0x3c00,
                                   0xa5d3, 0x19a6, 0x3f80, 0x8001, 0x4b00, 0xcb00, 0x3400, 0x3300};
    static const uint16_t B[32] = {0x3f00, 0x3f80, 0x3380, 0x3e80, 0x7e00, 0x7f00, 0x4000, 0x3f81,
                                   0x1940, 0x1934, 0x0076, 0x82fa, 0x8efe, 0x0042, 0x0000, 0x8000,
                                   0x0000, 0x7fc0, 0x0080, 0x0080, 0x2000, 0x1f80, 0x3f80, 0x0100,
                                   0x20e7, 0x1a11, 0x0001, 0x3f80, 0x3f80, 0x3f80, 0x3380, 0x3380};
    static const uint32_t C[16] = {0x00800000u, 0x80000000u, 0x3f800000u, 0x00000001u,
                                   0x00800000u, 0x00800000u, 0x80000000u, 0x80800000u,
                                   0x7f7fffffu, 0x00c00000u, 0x00800001u, 0x00000000u,
                                   0x80800000u, 0x3f800000u, 0x4b800000u, 0x33800000u};
    float c[16], got[16];
    for (int j = 0; j < 16; j++) c[j] = bits_f(C[j]);
    v16 r = v16_hw((v16){_mm512_loadu_ps(c)}, hp_load(A), hp_load(B));
    v16_store(got, r);
    for (int j = 0; j < 16; j++) {
        float e = dp1(c[j], bf16_to_f32(A[2 * j + 1]), bf16_to_f32(B[2 * j + 1]));
        e = dp1(e, bf16_to_f32(A[2 * j]), bf16_to_f32(B[2 * j]));
        if (e != e ? got[j] == got[j] : f_bits(e) != f_bits(got[j])) return 0;
    }
    return 1;
}
#endif

/* 2: the instruction runs (it has AVX512-BF16 and agrees with dp); 1: the vector emulation;
 * 0: the scalar dp. Checked once per process (racing threads compute the same value). */
int skyrl_gemm_bf16_dp_path(void) {
#if defined(HAVE_HW)
    static volatile int state = -1;
    if (state < 0) state = hw_agrees() ? 2 : 1;
    return state;
#elif defined(VECTOR)
    return 1;
#else
    return 0;
#endif
}

#define NB 48   /* columns per panel, as gemm_bf16.c */

typedef void (*dtile_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, float *, int64_t, int64_t);
#define CAT4(a, b, c, d) a##b##c##d
#define TN(P, MR, NR) CAT4(P, MR, x, NR)

#if defined(VECTOR)
typedef struct { dtile_fn wide[MR_MAX + 1], one[MR_MAX + 1], row; } tiles;
#if MR_MAX == 4
static const tiles ETILES = {{0, TN(etile_, 1, NR_WIDE), TN(etile_, 2, NR_WIDE), TN(etile_, 3, NR_WIDE),
                              TN(etile_, 4, NR_WIDE)},
                             {0, etile_1x1, etile_2x1, etile_3x1, etile_4x1}, TN(etile_, 1, NR_ONE)};
#else
static const tiles ETILES = {{0, TN(etile_, 1, NR_WIDE), TN(etile_, 2, NR_WIDE)},
                             {0, etile_1x1, etile_2x1}, TN(etile_, 1, NR_ONE)};
#endif
#if defined(HAVE_HW)
static const tiles HTILES = {{0, TN(htile_, 1, NR_WIDE), TN(htile_, 2, NR_WIDE), TN(htile_, 3, NR_WIDE),
                              TN(htile_, 4, NR_WIDE)},
                             {0, htile_1x1, htile_2x1, htile_3x1, htile_4x1}, TN(htile_, 1, NR_ONE)};
#endif

/* the tiles over one panel of columns p0..p1 - 1, rows 0..M-1 */
static void run_tiles(const tiles *T, const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw,
                      float *out, int64_t ldo, int64_t M, int64_t K, int64_t p0, int64_t p1) {
    if (M == 1) {   /* one row (a decode step): NR_ONE columns at a time */
        int64_t n = p0;
        for (; n + NR_ONE <= p1; n += NR_ONE) T->row(x, ldx, w + n * ldw, ldw, out + n, ldo, K);
        for (; n < p1; n++) T->one[1](x, ldx, w + n * ldw, ldw, out + n, ldo, K);
        return;
    }
    for (int64_t m = 0; m < M; m += MR_MAX) {
        const int mr = M - m < MR_MAX ? (int)(M - m) : MR_MAX;
        const uint16_t *xm = x + m * ldx;
        float *om = out + m * ldo;
        int64_t n = p0;
        for (; n + NR_WIDE <= p1; n += NR_WIDE) T->wide[mr](xm, ldx, w + n * ldw, ldw, om + n, ldo, K);
        for (; n < p1; n++) T->one[mr](xm, ldx, w + n * ldw, ldw, om + n, ldo, K);
    }
}
#endif

#define NB 48   /* columns per panel, as gemm_bf16.c */

/* Rows 0..M-1 of xb (packed by skyrl_bf16_pack_rows: K32 values a row at leading dim ldx, their
 * minimum exponents xme) times columns n_lo..n_hi-1 of w^T (w bfloat16 [N, K] at leading dim
 * ldw) into out (float32, leading dim ldo). Returns 0, or -1 for a bad shape. */
int skyrl_gemm_bf16_dp(const uint16_t *x, int64_t ldx, const int32_t *xme, const uint16_t *w,
                       int64_t ldw, float *out, int64_t ldo, int64_t M, int64_t K, int64_t n_lo,
                       int64_t n_hi) {
    const int64_t K32 = (K + 31) / 32 * 32;
    if (M < 0 || K < 0 || n_lo < 0 || n_hi < n_lo || ldx < K32 || ldw < K) return -1;
    const int path = skyrl_gemm_bf16_dp_path();
    for (int64_t p0 = n_lo; p0 < n_hi; p0 += NB) {
        const int64_t p1 = p0 + NB < n_hi ? p0 + NB : n_hi;
#if defined(HAVE_HW)
        if (path == 2) {
            run_tiles(&HTILES, x, ldx, w, ldw, out, ldo, M, K, p0, p1);
            continue;
        }
#endif
#if defined(VECTOR)
        if (path == 1) {
            int wme[NB];
            for (int64_t n = p0; n < p1; n++) wme[n - p0] = row_minexp(w + n * ldw, K);
            run_tiles(&ETILES, x, ldx, w, ldw, out, ldo, M, K, p0, p1);
            for (int64_t m = 0; m < M; m++)
                for (int64_t n = p0; n < p1; n++)
                    if (xme[m] + wme[n - p0] < TINY_SUM || wme[n - p0] == 0)   /* 0: a denormal w */
                        out[m * ldo + n] = dot_dp_scalar(x + m * ldx, w + n * ldw, K);
            continue;
        }
#endif
        (void)xme;
        (void)path;
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = p0; n < p1; n++) out[m * ldo + n] = dot_dp_scalar(x + m * ldx, w + n * ldw, K);
    }
    return 0;
}

/* Grouped rows (an MoE layer's experts), as skyrl_gemm_bf16_grouped: rows row_off[g] ..
 * row_off[g + 1] - 1 of xb times w_ptrs[g]; each output is skyrl_gemm_bf16_dp's. */
int skyrl_gemm_bf16_dp_grouped(const uint16_t *x, int64_t ldx, const int32_t *xme,
                               const uint64_t *w_ptrs, int64_t ldw, const int64_t *row_off,
                               int64_t G, float *out, int64_t ldo, int64_t K, int64_t n_lo,
                               int64_t n_hi) {
    for (int64_t g = 0; g < G; g++) {
        const int64_t r0 = row_off[g], r1 = row_off[g + 1];
        if (r1 < r0) return -1;
        if (r1 == r0) continue;
        const int rc = skyrl_gemm_bf16_dp(x + r0 * ldx, ldx, xme + r0, (const uint16_t *)(uintptr_t)w_ptrs[g],
                                          ldw, out + r0 * ldo, ldo, r1 - r0, K, n_lo, n_hi);
        if (rc) return rc;
    }
    return 0;
}
