/* Fixed-order GEMM against bfloat16 weights, for CPU: the kernel behind
 * skyrl_numerics.kernels.cpu_gemm_bf16 (its torch specification gives the same bits, tested).
 *
 *   out[m, n] = dot8(x[m, 0:K], float32(w[n, 0:K]))        x float32, w bfloat16 (row-major,
 *                                                           nn.Linear's [out, in] layout)
 *
 * dot8 is fixed_order.h's: lane c (0..7) adds x[8u + c] * w[8u + c] over u = 0, 1, ... in
 * order from +0 (a tail shorter than 8 fills the first lanes), then the lanes are folded
 * ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)). Every product and sum is one IEEE binary32
 * operation (-ffp-contract=off: no FMA), so an output's bits depend only on its own row of x and
 * of w: not on M, N, the tile an output falls in, the thread that computes it, the vector width
 * or the CPU. bfloat16 -> float32 is exact (a 16-bit shift), done in registers: the weights are
 * read as stored, never copied to float32.
 *
 * Tiles of MR rows x NR columns share each loaded vector (MR x NR accumulators of 8 lanes); the
 * columns are walked in panels of NB so a panel of w stays in cache while all rows pass over it.
 */
#include "fixed_order.h"

typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));

static inline v8f widen8(const uint16_t *p) {
    v8u16 h;
    memcpy(&h, p, sizeof h);
    v8u32 u = __builtin_convertvector(h, v8u32) << 16;
    v8f f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float fold8(v8f acc) {
    const float b0 = acc[0] + acc[4], b1 = acc[1] + acc[5], b2 = acc[2] + acc[6], b3 = acc[3] + acc[7];
    return (b0 + b2) + (b1 + b3);
}

/* the tail (K % 8 values) into the first lanes, in order, then the fold */
static inline float finish(v8f acc, const float *x, const uint16_t *w, int64_t k8, int64_t K) {
    for (int64_t c = 0; k8 + c < K; c++) acc[c] = acc[c] + x[k8 + c] * bf16_to_f32(w[k8 + c]);
    return fold8(acc);
}

#define TILE(MR, NR)                                                                           \
    static void tile_##MR##x##NR(const float *x, int64_t ldx, const uint16_t *w, int64_t ldw,    \
                                 float *out, int64_t ldo, int64_t K) {                          \
        v8f acc[MR][NR];                                                                       \
        for (int i = 0; i < MR; i++)                                                           \
            for (int j = 0; j < NR; j++) acc[i][j] = (v8f){0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}; \
        const int64_t k8 = K - K % 8;                                                          \
        for (int64_t u = 0; u < k8; u += 8) {                                                  \
            v8f xv[MR];                                                                        \
            for (int i = 0; i < MR; i++) xv[i] = load8(x + i * ldx + u);                       \
            for (int j = 0; j < NR; j++) {                                                     \
                const v8f wv = widen8(w + j * ldw + u);                                        \
                for (int i = 0; i < MR; i++) acc[i][j] = acc[i][j] + xv[i] * wv;               \
            }                                                                                  \
        }                                                                                      \
        for (int i = 0; i < MR; i++)                                                           \
            for (int j = 0; j < NR; j++)                                                       \
                out[i * ldo + j] = finish(acc[i][j], x + i * ldx, w + j * ldw, k8, K);         \
    }

TILE(4, 3)
TILE(3, 3)
TILE(2, 3)
TILE(1, 3)
TILE(4, 1)
TILE(3, 1)
TILE(2, 1)
TILE(1, 1)
TILE(1, 6)

typedef void (*tile_fn)(const float *, int64_t, const uint16_t *, int64_t, float *, int64_t, int64_t);
static const tile_fn TILES3[5] = {0, tile_1x3, tile_2x3, tile_3x3, tile_4x3};
static const tile_fn TILES1[5] = {0, tile_1x1, tile_2x1, tile_3x1, tile_4x1};

#define NB 48   /* columns per panel (a multiple of 3 and 6): 48 rows of w of K <= 4096 fit in L2 */

/* Rows 0..M-1 of x (float32, leading dim ldx) times columns n_lo..n_hi-1 of w^T (w bfloat16
 * [N, K], leading dim ldw) into out (float32, leading dim ldo; column n at out[m * ldo + n]).
 * Returns 0, or -1 for a bad shape. */
int skyrl_gemm_bf16(const float *x, int64_t ldx, const uint16_t *w, int64_t ldw, float *out,
                    int64_t ldo, int64_t M, int64_t K, int64_t n_lo, int64_t n_hi) {
    if (M < 0 || K < 0 || n_lo < 0 || n_hi < n_lo || ldx < K || ldw < K) return -1;
    for (int64_t p0 = n_lo; p0 < n_hi; p0 += NB) {
        const int64_t p1 = p0 + NB < n_hi ? p0 + NB : n_hi;
        if (M == 1) {                      /* one row (a decode step): six columns at a time */
            int64_t n = p0;
            for (; n + 6 <= p1; n += 6) tile_1x6(x, ldx, w + n * ldw, ldw, out + n, ldo, K);
            for (; n < p1; n++) tile_1x1(x, ldx, w + n * ldw, ldw, out + n, ldo, K);
            continue;
        }
        for (int64_t m = 0; m < M; m += 4) {
            const int mr = M - m < 4 ? (int)(M - m) : 4;
            const float *xm = x + m * ldx;
            float *om = out + m * ldo;
            int64_t n = p0;
            for (; n + 3 <= p1; n += 3) TILES3[mr](xm, ldx, w + n * ldw, ldw, om + n, ldo, K);
            for (; n < p1; n++) TILES1[mr](xm, ldx, w + n * ldw, ldw, om + n, ldo, K);
        }
    }
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
