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
 * so a panel of w stays in cache while all rows pass over it; from PACK_M rows on, a panel is
 * widened to float32 once and all row tiles read that (exact: the same values). The tile shapes
 * and the packing depend on the ISA (register count) and M, never the bits.
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

static inline v16 v16_wf(const float *p) { return v16_x(p); }
static inline float widen_h(uint16_t v) { return bf16_to_f32(v); }
static inline float widen_f(float v) { return v; }

/* the tail (K % 16 values) into the first lanes, in order, then the fold */
#define FINISH(NAME, WT, WIDEN)                                                                \
    static inline float NAME(v16 acc, const float *x, const WT *w, int64_t k16, int64_t K) {   \
        float l[16];                                                                           \
        v16_store(l, acc);                                                                     \
        for (int64_t c = 0; k16 + c < K; c++) l[c] = fmaf(x[k16 + c], WIDEN(w[k16 + c]), l[c]); \
        float h[8];                                                                            \
        for (int i = 0; i < 8; i++) h[i] = l[i] + l[i + 8];                                    \
        const float b0 = h[0] + h[4], b1 = h[1] + h[5], b2 = h[2] + h[6], b3 = h[3] + h[7];    \
        return (b0 + b2) + (b1 + b3);                                                          \
    }
FINISH(finish_h, uint16_t, widen_h)
FINISH(finish_f, float, widen_f)

/* an MR x NR tile of outputs; WT the weight's storage (uint16_t: bfloat16 as stored; float: a
 * packed panel widened ahead, the same values) */
#define TILE(P, WT, WLOAD, FIN, MR, NR)                                                         \
    static void tile##P##_##MR##x##NR(const float *x, int64_t ldx, const WT *w, int64_t ldw,   \
                                      float *out, int64_t ldo, int64_t K) {                     \
        v16 acc[MR][NR];                                                                       \
        for (int i = 0; i < MR; i++)                                                           \
            for (int j = 0; j < NR; j++) acc[i][j] = v16_zero();                               \
        const int64_t k16 = K - K % 16;                                                        \
        for (int64_t u = 0; u < k16; u += 16) {                                                \
            v16 xv[MR];                                                                        \
            for (int i = 0; i < MR; i++) xv[i] = v16_x(x + i * ldx + u);                       \
            for (int j = 0; j < NR; j++) {                                                     \
                const v16 wv = WLOAD(w + j * ldw + u);                                         \
                for (int i = 0; i < MR; i++) acc[i][j] = v16_fma(xv[i], wv, acc[i][j]);        \
            }                                                                                  \
        }                                                                                      \
        for (int i = 0; i < MR; i++)                                                           \
            for (int j = 0; j < NR; j++)                                                       \
                out[i * ldo + j] = FIN(acc[i][j], x + i * ldx, w + j * ldw, k16, K);           \
    }
#define DEF_TILE(MR, NR) TILE(_h, uint16_t, v16_w, finish_h, MR, NR)   /* expands NR_ONE / NR_WIDE */
#define DEF_TILEF(MR, NR) TILE(_f, float, v16_wf, finish_f, MR, NR)
DEF_TILE(1, 1)
DEF_TILE(2, 1)
DEF_TILE(1, NR_ONE)
DEF_TILE(1, NR_WIDE)
DEF_TILE(2, NR_WIDE)
DEF_TILEF(1, 1)
DEF_TILEF(2, 1)
DEF_TILEF(1, NR_WIDE)
DEF_TILEF(2, NR_WIDE)
#if MR_MAX == 4
DEF_TILE(3, 1)
DEF_TILE(4, 1)
DEF_TILE(3, NR_WIDE)
DEF_TILE(4, NR_WIDE)
DEF_TILEF(3, 1)
DEF_TILEF(4, 1)
DEF_TILEF(3, NR_WIDE)
DEF_TILEF(4, NR_WIDE)
#endif

typedef void (*tile_fn)(const float *, int64_t, const uint16_t *, int64_t, float *, int64_t, int64_t);
typedef void (*tilef_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t, int64_t);
#define CAT4(a, b, c, d) a##b##c##d
#define TILE_FN(P, MR, NR) CAT4(tile##P##_, MR, x, NR)
#define TN(P, MR, NR) TILE_FN(P, MR, NR)
#if MR_MAX == 4
static const tile_fn TILES_WIDE[5] = {0, TN(_h, 1, NR_WIDE), TN(_h, 2, NR_WIDE), TN(_h, 3, NR_WIDE),
                                      TN(_h, 4, NR_WIDE)};
static const tile_fn TILES1[5] = {0, tile_h_1x1, tile_h_2x1, tile_h_3x1, tile_h_4x1};
static const tilef_fn TILESF_WIDE[5] = {0, TN(_f, 1, NR_WIDE), TN(_f, 2, NR_WIDE), TN(_f, 3, NR_WIDE),
                                        TN(_f, 4, NR_WIDE)};
static const tilef_fn TILESF1[5] = {0, tile_f_1x1, tile_f_2x1, tile_f_3x1, tile_f_4x1};
#else
static const tile_fn TILES_WIDE[3] = {0, TN(_h, 1, NR_WIDE), TN(_h, 2, NR_WIDE)};
static const tile_fn TILES1[3] = {0, tile_h_1x1, tile_h_2x1};
static const tilef_fn TILESF_WIDE[3] = {0, TN(_f, 1, NR_WIDE), TN(_f, 2, NR_WIDE)};
static const tilef_fn TILESF1[3] = {0, tile_f_1x1, tile_f_2x1};
#endif

#define NB 48   /* columns per panel (a multiple of 3, 4, 6 and 8): 48 rows of w of K <= 4096 fit in L2 */
/* From PACK_M rows on, each panel of w is widened to float32 once (exact) and every row tile
 * reads the float32 panel: no widening in the inner loop. Measured: ~10 % faster from 32 rows on
 * with AVX-512's 4-row tiles, slower at every M with AVX2's 2-row tiles (there: never). */
#ifndef PACK_M
#if MR_MAX == 4
#define PACK_M 32
#else
#define PACK_M INT64_MAX
#endif
#endif

/* Rows 0..M-1 of x (float32, leading dim ldx) times columns n_lo..n_hi-1 of w^T (w bfloat16
 * [N, K], leading dim ldw) into out (float32, leading dim ldo; column n at out[m * ldo + n]).
 * Returns 0, or -1 for a bad shape. */
/* rows 0..M-1 of x against panel columns of w already widened to float32 (wp, leading dim K) */
static void rows_packed(const float *x, int64_t ldx, const float *wp, int64_t np, float *out,
                        int64_t ldo, int64_t M, int64_t K) {
    for (int64_t m = 0; m < M; m += MR_MAX) {
        const int mr = M - m < MR_MAX ? (int)(M - m) : MR_MAX;
        const float *xm = x + m * ldx;
        float *om = out + m * ldo;
        int64_t j = 0;
        for (; j + NR_WIDE <= np; j += NR_WIDE) TILESF_WIDE[mr](xm, ldx, wp + j * K, K, om + j, ldo, K);
        for (; j < np; j++) TILESF1[mr](xm, ldx, wp + j * K, K, om + j, ldo, K);
    }
}

/* Rows 0..M-1 of x (float32, leading dim ldx) times columns n_lo..n_hi-1 of w^T (w bfloat16
 * [N, K], leading dim ldw) into out (float32, leading dim ldo; column n at out[m * ldo + n]).
 * Returns 0, or -1 for a bad shape (-2: no memory for a packed panel). */
int skyrl_gemm_bf16(const float *x, int64_t ldx, const uint16_t *w, int64_t ldw, float *out,
                    int64_t ldo, int64_t M, int64_t K, int64_t n_lo, int64_t n_hi) {
    if (M < 0 || K < 0 || n_lo < 0 || n_hi < n_lo || ldx < K || ldw < K) return -1;
    float *wp = NULL;
    if (M >= PACK_M && K > 0) {
        wp = (float *)malloc((size_t)NB * (size_t)K * sizeof(float));
        if (!wp) return -2;
    }
    for (int64_t p0 = n_lo; p0 < n_hi; p0 += NB) {
        const int64_t p1 = p0 + NB < n_hi ? p0 + NB : n_hi;
        if (wp) {
            for (int64_t j = p0; j < p1; j++) {
                const uint16_t *src = w + j * ldw;
                float *dst = wp + (j - p0) * K;
                for (int64_t k = 0; k < K; k++) dst[k] = bf16_to_f32(src[k]);
            }
            rows_packed(x, ldx, wp, p1 - p0, out + p0, ldo, M, K);
            continue;
        }
        if (M == 1) {                      /* one row (a decode step): NR_ONE columns at a time */
            int64_t n = p0;
            for (; n + NR_ONE <= p1; n += NR_ONE)
                TN(_h, 1, NR_ONE)(x, ldx, w + n * ldw, ldw, out + n, ldo, K);
            for (; n < p1; n++) tile_h_1x1(x, ldx, w + n * ldw, ldw, out + n, ldo, K);
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
    free(wp);
    return 0;
}

/* Grouped rows (an MoE layer's experts): rows row_off[g] .. row_off[g + 1] - 1 of x times
 * w_ptrs[g] (bfloat16 [N, K] at leading dim ldw), columns n_lo .. n_hi - 1, into the same rows
 * of out. Each output is skyrl_gemm_bf16's, so the same bits as one call per group. */
int skyrl_gemm_bf16_grouped(const float *x, int64_t ldx, const uint64_t *w_ptrs, int64_t ldw,
                            const int64_t *row_off, int64_t G, float *out, int64_t ldo, int64_t K,
                            int64_t n_lo, int64_t n_hi) {
    for (int64_t g = 0; g < G; g++) {
        const int64_t r0 = row_off[g], r1 = row_off[g + 1];
        if (r1 < r0) return -1;
        if (r1 == r0) continue;
        const int rc = skyrl_gemm_bf16(x + r0 * ldx, ldx, (const uint16_t *)(uintptr_t)w_ptrs[g],
                                       ldw, out + r0 * ldo, ldo, r1 - r0, K, n_lo, n_hi);
        if (rc) return rc;
    }
    return 0;
}
