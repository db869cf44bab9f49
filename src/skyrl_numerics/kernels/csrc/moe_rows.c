/* The data movement around a grouped MoE layer's GEMMs on CPU, fused (no arithmetic of its own
 * beyond what the unfused torch ops do; wrapped by skyrl_numerics.kernels.cpu_moe, whose torch
 * specifications give the same bits, tested):
 *
 *   skyrl_moe_sort:    the pairs p = t k + s in the order of a stable sort by expert ids[p] (a
 *                      counting sort: numpy's stable argsort order): off[e] .. off[e + 1] - 1
 *                      are expert e's sorted rows, src[r] = the token (p / k) of sorted row r,
 *                      rowmap[p] = the sorted row of pair p (integer bookkeeping only)
 *   skyrl_moe_combine: per token t, with r_s = bf16(y[rowmap[t k + s], :H]) and
 *                      w_s = bf16(weights[t, s]) (float32 -> bfloat16, nearest even):
 *                      acc = bf16(r_0 * w_0);  acc = bf16(acc + bf16(r_s * w_s)) for s = 1 .. k-1
 *                      (torch's bf16 mul and add: float32 op, one rounding each)
 */
#include "fixed_order.h"

/* Returns 0; -1 (with *bad the first pair's index) when an id is outside 0 .. E - 1; -2 without memory. */
int skyrl_moe_sort(const int64_t *ids, int64_t P, int k, int64_t E, int64_t *off, int64_t *src,
                   int64_t *rowmap, int64_t *bad) {
    for (int64_t e = 0; e <= E; e++) off[e] = 0;
    for (int64_t p = 0; p < P; p++) {
        if (ids[p] < 0 || ids[p] >= E) {
            *bad = p;
            return -1;
        }
        off[ids[p] + 1]++;
    }
    for (int64_t e = 0; e < E; e++) off[e + 1] += off[e];
    int64_t *next = (int64_t *)malloc((size_t)(E > 0 ? E : 1) * sizeof(int64_t));
    if (!next) return -2;
    memcpy(next, off, (size_t)E * sizeof(int64_t));
    for (int64_t p = 0; p < P; p++) {
        const int64_t r = next[ids[p]]++;
        src[r] = p / k;
        rowmap[p] = r;
    }
    free(next);
    return 0;
}

static inline float rb(float v) { return bf16_to_f32(f32_to_bf16(v)); }

/* Returns 0; -1 when a rowmap entry is outside 0 .. y_rows - 1 (checked first). */
int skyrl_moe_combine(const float *y, int64_t y_ld, int64_t y_rows, int H, const int64_t *rowmap,
                      const float *weights, int64_t T, int k, uint16_t *out) {
    for (int64_t p = 0; p < T * k; p++)
        if (rowmap[p] < 0 || rowmap[p] >= y_rows) return -1;
    for (int64_t t = 0; t < T; t++) {
        uint16_t *o = out + t * H;
        const float w0 = rb(weights[t * k]);
        const float *r0 = y + rowmap[t * k] * y_ld;
        for (int h = 0; h < H; h++) {
            float acc = rb(rb(r0[h]) * w0);
            for (int s = 1; s < k; s++) {
                const float ws = rb(weights[t * k + s]);
                const float *r = y + rowmap[t * k + s] * y_ld;
                acc = rb(acc + rb(rb(r[h]) * ws));
            }
            o[h] = f32_to_bf16(acc);
        }
    }
    return 0;
}
