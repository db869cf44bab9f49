/* Fixed-order GEMM against bfloat16 weights, for CPU: the kernel behind
 * skyrl_numerics.kernels.cpu_gemm_bf16 (its torch specification gives the same bits, tested).
 *
 *   out[m, n] = dot16(x[m, 0:K], float32(w[n, 0:K]))       x float32, w bfloat16 (row-major,
 *                                                           nn.Linear's [out, in] layout)
 *
 * dot16: lane c (0..15) runs acc_c = fma(x[16u + c], w[16u + c], acc_c) over u = 0, 1, ... in
 * order from +0 (a tail shorter than 16 fills the first lanes, in order, by the same fma), then
 * the lanes are folded h_i = l_i + l_(i+8) (i = 0..7) and ((h0 + h4) + (h2 + h6)) + ((h1 + h5) +
 * (h3 + h7)). fma is IEEE 754's fused multiply-add (one rounding): the same operation on every
 * CPU, so an output's bits depend only on its own row of x and of w: not on M, N, the tile an
 * output falls in, the thread that computes it or the CPU. The 16 lanes are one AVX-512
 * register, two AVX2 registers (each lane is its own chain: the split changes no bit) or 16
 * scalar fmaf calls without either (C99's fmaf is exactly rounded); every other float operation
 * is one IEEE binary32 operation (-ffp-contract=off). bfloat16 -> float32 is exact (a 16-bit
 * shift), done in registers: the weights are read as stored, never copied to float32.
 *
 * Tiles of MR rows x NR columns share each loaded vector; the columns are walked in panels of NB
 * so a panel of w stays in cache while all rows pass over it. The tile shapes depend on the ISA
 * (register count), never the bits. On AVX-512 a tile's tail and fold run on whole registers
 * (fold16: the same additions in the same association, up to 16 outputs at once, where a scalar
 * fold per output cost more than the dot products at K = 64..256).
 */
#include "fixed_order.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
typedef struct { __m512 v; } v16;
static inline v16 v16_zero(void) { return (v16){_mm512_setzero_ps()}; }
static inline v16 v16_x(const float *p) { return (v16){_mm512_loadu_ps(p)}; }
static inline v16 v16_w(const uint16_t *p) {
    __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return (v16){_mm512_castsi512_ps(_mm512_slli_epi32(u, 16))};
}
static inline v16 v16_fma(v16 a, v16 b, v16 c) { return (v16){_mm512_fmadd_ps(a.v, b.v, c.v)}; }
static inline void v16_store(float *p, v16 a) { _mm512_storeu_ps(p, a.v); }
/* the tail: lanes c < n run acc_c = fma(x[c], w[c], acc_c); the others keep their bits */
static inline v16 v16_tail(v16 acc, const float *x, const uint16_t *w, int n) {
    const __mmask16 m = (__mmask16)((1u << n) - 1u);
    const __m512 xv = _mm512_maskz_loadu_ps(m, x);
    const __m512i u = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, w));
    return (v16){_mm512_mask3_fmadd_ps(xv, _mm512_castsi512_ps(_mm512_slli_epi32(u, 16)), acc.v, m)};
}
/* a + b over 128-bit blocks picked by shuffle_f32x4 (P) and its complement (Q) */
#define FOLD_X4(a, b, ip, iq) _mm512_add_ps(_mm512_shuffle_f32x4(a, b, ip), _mm512_shuffle_f32x4(a, b, iq))
#define FOLD_PS(a, b, ip, iq) _mm512_add_ps(_mm512_shuffle_ps(a, b, ip), _mm512_shuffle_ps(a, b, iq))
/* fold16: out[4j + q] = finish's fold of v[4q + j] (j, q = 0..3), every output's additions the
 * scalar fold's, in its association:
 *   C: lanes 0-7 h_i = l_i + l_(i+8) of v[2k], lanes 8-15 of v[2k+1]
 *   E: block r of E_m = b_0..3 (b_j = h_j + h_(j+4)) of v[4m + r]
 *   G: block j of G_p = (b0 + b2, b1 + b3) of v[8p + j], then of v[8p + 4 + j]
 *   R: lane 4j + q = (b0 + b2) + (b1 + b3) of v[4q + j] */
static inline void fold16(const v16 *v, float *out) {
    __m512 C[8], E[4], G[2];
    for (int k = 0; k < 8; k++) C[k] = FOLD_X4(v[2 * k].v, v[2 * k + 1].v, 0x44, 0xEE);
    for (int m = 0; m < 4; m++) E[m] = FOLD_X4(C[2 * m], C[2 * m + 1], 0x88, 0xDD);
    for (int p = 0; p < 2; p++) G[p] = FOLD_PS(E[2 * p], E[2 * p + 1], 0x44, 0xEE);
    _mm512_storeu_ps(out, FOLD_PS(G[0], G[1], 0x88, 0xDD));
}
#define VECTOR_FOLD 1
#define MR_MAX 4
#define NR_WIDE 4
#define NR_ONE 8
#elif defined(__AVX2__) && defined(__FMA__)
typedef struct { __m256 lo, hi; } v16;
static inline v16 v16_zero(void) { return (v16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline v16 v16_x(const float *p) { return (v16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline __m256 w8(const uint16_t *p) {
    __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}
static inline v16 v16_w(const uint16_t *p) { return (v16){w8(p), w8(p + 8)}; }
static inline v16 v16_fma(v16 a, v16 b, v16 c) {
    return (v16){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline void v16_store(float *p, v16 a) {
    _mm256_storeu_ps(p, a.lo);
    _mm256_storeu_ps(p + 8, a.hi);
}
/* h_i = l_i + l_(i+8), i = 0..7: the fold's first step is one vector addition here */
static inline v8f v16_halves(v16 a) { return (v8f)_mm256_add_ps(a.lo, a.hi); }
#define HALVES_FOLD 1
#define MR_MAX 2
#define NR_WIDE 3
#define NR_ONE 6
#else
typedef struct { float l[16]; } v16;
static inline v16 v16_zero(void) { v16 a; memset(&a, 0, sizeof a); return a; }
static inline v16 v16_x(const float *p) { v16 a; memcpy(a.l, p, sizeof a.l); return a; }
static inline v16 v16_w(const uint16_t *p) {
    v16 a;
    for (int c = 0; c < 16; c++) a.l[c] = bf16_to_f32(p[c]);
    return a;
}
static inline v16 v16_fma(v16 a, v16 b, v16 c) {
    for (int i = 0; i < 16; i++) c.l[i] = fmaf(a.l[i], b.l[i], c.l[i]);
    return c;
}
static inline void v16_store(float *p, v16 a) { memcpy(p, a.l, sizeof a.l); }
#define MR_MAX 2
#define NR_WIDE 3
#define NR_ONE 6
#endif

/* the tail (K % 16 values) into the first lanes, in order, then the fold */
static inline float finish(v16 acc, const float *x, const uint16_t *w, int64_t k16, int64_t K) {
    float l[16];
    v16_store(l, acc);
    for (int64_t c = 0; k16 + c < K; c++) l[c] = fmaf(x[k16 + c], bf16_to_f32(w[k16 + c]), l[c]);
    float h[8];
    for (int i = 0; i < 8; i++) h[i] = l[i] + l[i + 8];
    const float b0 = h[0] + h[4], b1 = h[1] + h[5], b2 = h[2] + h[6], b3 = h[3] + h[7];
    return (b0 + b2) + (b1 + b3);
}

/* The outputs of a tile's accumulators acc[i * nr + j] (row i, column j; mr * nr <= 16 on
 * AVX-512, <= 8 on AVX2): each one's tail and fold, into out[i * ldo + j]. */
static inline void store_tile(v16 *acc, int mr, int nr, const float *x, int64_t ldx,
                              const uint16_t *w, int64_t ldw, float *out, int64_t ldo,
                              int64_t k16, int64_t K) {
#ifdef VECTOR_FOLD
    v16 v[16];
    float res[16];
    for (int c = 0; c < 16; c++) v[c] = v16_zero();
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            const int c = i * nr + j;                 /* lands in res[c] (fold16's lane map) */
            v16 a = acc[c];
            if (K > k16) a = v16_tail(a, x + i * ldx + k16, w + j * ldw + k16, (int)(K - k16));
            v[4 * (c % 4) + c / 4] = a;
        }
    fold16(v, res);
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) out[i * ldo + j] = res[i * nr + j];
#else
#ifdef HALVES_FOLD
    if (K == k16) {                   /* no tail: the halves' sums, folded 8 outputs at once */
        v8f h[8];
        float res[8];
        for (int c = 0; c < 8; c++) h[c] = (v8f){0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int c = 0; c < mr * nr; c++) h[c] = v16_halves(acc[c]);
        const v8f r = fold8(h);
        memcpy(res, &r, sizeof res);
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < nr; j++) out[i * ldo + j] = res[i * nr + j];
        return;
    }
#endif
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++)
            out[i * ldo + j] = finish(acc[i * nr + j], x + i * ldx, w + j * ldw, k16, K);
#endif
}

#define TILE(MR, NR)                                                                           \
    static void tile_##MR##x##NR(const float *x, int64_t ldx, const uint16_t *w, int64_t ldw,    \
                                 float *out, int64_t ldo, int64_t K) {                          \
        v16 acc[MR][NR];                                                                       \
        for (int i = 0; i < MR; i++)                                                           \
            for (int j = 0; j < NR; j++) acc[i][j] = v16_zero();                               \
        const int64_t k16 = K - K % 16;                                                        \
        for (int64_t u = 0; u < k16; u += 16) {                                                \
            v16 xv[MR];                                                                        \
            for (int i = 0; i < MR; i++) xv[i] = v16_x(x + i * ldx + u);                       \
            for (int j = 0; j < NR; j++) {                                                     \
                const v16 wv = v16_w(w + j * ldw + u);                                         \
                for (int i = 0; i < MR; i++) acc[i][j] = v16_fma(xv[i], wv, acc[i][j]);        \
            }                                                                                  \
        }                                                                                      \
        store_tile(&acc[0][0], MR, NR, x, ldx, w, ldw, out, ldo, k16, K);                      \
    }

#define DEF_TILE(MR, NR) TILE(MR, NR)   /* expands NR_ONE / NR_WIDE first */
DEF_TILE(1, 1)
DEF_TILE(2, 1)
DEF_TILE(1, NR_ONE)
DEF_TILE(1, NR_WIDE)
DEF_TILE(2, NR_WIDE)
#if MR_MAX == 4
DEF_TILE(3, 1)
DEF_TILE(4, 1)
DEF_TILE(3, NR_WIDE)
DEF_TILE(4, NR_WIDE)
#endif

typedef void (*tile_fn)(const float *, int64_t, const uint16_t *, int64_t, float *, int64_t, int64_t);
#define CAT3(a, b, c) a##b##c
#define TILE_FN(MR, NR) CAT3(tile_, MR, x##NR)
#define TILE_NAME(MR, NR) TILE_FN(MR, NR)
#if MR_MAX == 4
static const tile_fn TILES_WIDE[5] = {0, TILE_NAME(1, NR_WIDE), TILE_NAME(2, NR_WIDE),
                                      TILE_NAME(3, NR_WIDE), TILE_NAME(4, NR_WIDE)};
static const tile_fn TILES1[5] = {0, tile_1x1, tile_2x1, tile_3x1, tile_4x1};
#else
static const tile_fn TILES_WIDE[3] = {0, TILE_NAME(1, NR_WIDE), TILE_NAME(2, NR_WIDE)};
static const tile_fn TILES1[3] = {0, tile_1x1, tile_2x1};
#endif

#define NB 48   /* columns per panel (a multiple of 3, 4, 6 and 8): 48 rows of w of K <= 4096 fit in L2 */

/* Rows 0..M-1 of x (float32, leading dim ldx) times columns n_lo..n_hi-1 of w^T (w bfloat16
 * [N, K], leading dim ldw) into out (float32, leading dim ldo; column n at out[m * ldo + n]).
 * Returns 0, or -1 for a bad shape. */
int skyrl_gemm_bf16(const float *x, int64_t ldx, const uint16_t *w, int64_t ldw, float *out,
                    int64_t ldo, int64_t M, int64_t K, int64_t n_lo, int64_t n_hi) {
    if (M < 0 || K < 0 || n_lo < 0 || n_hi < n_lo || ldx < K || ldw < K) return -1;
    for (int64_t p0 = n_lo; p0 < n_hi; p0 += NB) {
        const int64_t p1 = p0 + NB < n_hi ? p0 + NB : n_hi;
        if (M == 1) {                      /* one row (a decode step): NR_ONE columns at a time */
            int64_t n = p0;
            for (; n + NR_ONE <= p1; n += NR_ONE)
                TILE_NAME(1, NR_ONE)(x, ldx, w + n * ldw, ldw, out + n, ldo, K);
            for (; n < p1; n++) tile_1x1(x, ldx, w + n * ldw, ldw, out + n, ldo, K);
            continue;
        }
        for (int64_t m = 0; m < M; m += MR_MAX) {
            const int mr = M - m < MR_MAX ? (int)(M - m) : MR_MAX;
            const float *xm = x + m * ldx;
            float *om = out + m * ldo;
            int64_t n = p0;
            for (; n + NR_WIDE <= p1; n += NR_WIDE) TILES_WIDE[mr](xm, ldx, w + n * ldw, ldw, om + n, ldo, K);
            for (; n < p1; n++) TILES1[mr](xm, ldx, w + n * ldw, ldw, om + n, ldo, K);
        }
    }
    return 0;
}

#define IO_ROWS 64   /* rows of x widened (bfloat16 x) or of out rounded (bfloat16 out) at a time */

/* skyrl_gemm_bf16 with x and out in float32 or bfloat16 (dtype codes 0 / 1): bfloat16 rows of x
 * are widened (exact) and bfloat16 outputs rounded once from the float32 result (to nearest
 * even, fixed_order.h), IO_ROWS rows at a time, so the outputs are skyrl_gemm_bf16's (rounded:
 * torch's .to(bfloat16) of them) and a call costs no float32 copy of x or out in the caller.
 * Returns 0, -1 for a bad shape or dtype code, -2 without memory. */
int skyrl_gemm_bf16_io(const void *x, int x_dtype, int64_t ldx, const uint16_t *w, int64_t ldw,
                       void *out, int out_dtype, int64_t ldo, int64_t M, int64_t K, int64_t n_lo,
                       int64_t n_hi) {
    if ((x_dtype | out_dtype) & ~1) return -1;
    if (!x_dtype && !out_dtype)
        return skyrl_gemm_bf16((const float *)x, ldx, w, ldw, (float *)out, ldo, M, K, n_lo, n_hi);
    if (M < 0 || K < 0 || n_lo < 0 || n_hi < n_lo || ldx < K || ldw < K) return -1;
    const int64_t width = n_hi - n_lo, rb = M < IO_ROWS ? M : IO_ROWS;
    float *xb = x_dtype ? (float *)malloc((size_t)(rb * K + 1) * 4) : NULL;
    float *ob = out_dtype ? (float *)malloc((size_t)(rb * width + 1) * 4) : NULL;
    int rc = ((x_dtype && !xb) || (out_dtype && !ob)) ? -2 : 0;
    for (int64_t m0 = 0; m0 < M && !rc; m0 += rb) {
        const int64_t mr = M - m0 < rb ? M - m0 : rb;
        const float *xf = xb;
        int64_t lx = K;
        if (x_dtype) {
            for (int64_t r = 0; r < mr; r++) load_row(xb + r * K, x, (m0 + r) * ldx, 1, (int)K);
        } else {
            xf = (const float *)x + m0 * ldx;
            lx = ldx;
        }
        if (!out_dtype) {
            rc = skyrl_gemm_bf16(xf, lx, w, ldw, (float *)out + m0 * ldo, ldo, mr, K, n_lo, n_hi);
            continue;
        }
        rc = skyrl_gemm_bf16(xf, lx, w + n_lo * ldw, ldw, ob, width, mr, K, 0, width);
        for (int64_t r = 0; r < mr && !rc; r++) {
            uint16_t *o = (uint16_t *)out + (m0 + r) * ldo + n_lo;
            for (int64_t j = 0; j < width; j++) o[j] = f32_to_bf16(ob[r * width + j]);
        }
    }
    free(xb);
    free(ob);
    return rc;
}

/* Grouped rows (an MoE layer's experts): rows row_off[g] .. row_off[g + 1] - 1 of x times
 * w_ptrs[g] (bfloat16 [N, K] at leading dim ldw), columns n_lo .. n_hi - 1, into the same rows
 * of out; x and out float32 or bfloat16 as in skyrl_gemm_bf16_io. Each output is
 * skyrl_gemm_bf16's, so the same bits as one call per group. */
int skyrl_gemm_bf16_grouped(const void *x, int x_dtype, int64_t ldx, const uint64_t *w_ptrs,
                            int64_t ldw, const int64_t *row_off, int64_t G, void *out,
                            int out_dtype, int64_t ldo, int64_t K, int64_t n_lo, int64_t n_hi) {
    for (int64_t g = 0; g < G; g++) {
        const int64_t r0 = row_off[g], r1 = row_off[g + 1];
        if (r1 < r0) return -1;
        if (r1 == r0) continue;
        const int rc = skyrl_gemm_bf16_io((const char *)x + r0 * ldx * (x_dtype ? 2 : 4), x_dtype,
                                          ldx, (const uint16_t *)(uintptr_t)w_ptrs[g], ldw,
                                          (char *)out + r0 * ldo * (out_dtype ? 2 : 4), out_dtype,
                                          ldo, r1 - r0, K, n_lo, n_hi);
        if (rc) return rc;
    }
    return 0;
}
