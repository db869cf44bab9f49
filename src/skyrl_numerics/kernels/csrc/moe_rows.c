/* The data movement around a grouped MoE layer's GEMMs on CPU, fused (no arithmetic of its own
 * beyond what the unfused torch ops do; wrapped by skyrl_numerics.kernels.cpu_moe, whose torch
 * specifications give the same bits, tested):
 *
 *   skyrl_moe_gather:  out[c, dest[p], :] = float(x[src[p], :])  for every (token, slot) pair p
 *                      and copy c; every other row of out is +0 (the padding of each expert's
 *                      row blocks)
 *   skyrl_moe_combine: per token t, with r_s = bf16(y[rowmap[t k + s], :H]) and
 *                      w_s = bf16(weights[t, s]) (float32 -> bfloat16, nearest even):
 *                      acc = bf16(r_0 * w_0);  acc = bf16(acc + bf16(r_s * w_s)) for s = 1 .. k-1
 *                      (torch's bf16 mul and add: float32 op, one rounding each)
 */
#include "fixed_order.h"

int skyrl_moe_gather(const uint16_t *x, int64_t x_ld, int H, const int64_t *src,
                     const int64_t *dest, int64_t npairs, float *out, int64_t out_rows,
                     int copies) {
    memset(out, 0, (size_t)copies * out_rows * H * 4);
    for (int64_t p = 0; p < npairs; p++) {
        const uint16_t *xr = x + src[p] * x_ld;
        for (int c = 0; c < copies; c++) {
            float *o = out + ((int64_t)c * out_rows + dest[p]) * H;
            for (int h = 0; h < H; h++) o[h] = bf16_to_f32(xr[h]);
        }
    }
    return 0;
}

static inline float rb(float v) { return bf16_to_f32(f32_to_bf16(v)); }

int skyrl_moe_combine(const float *y, int64_t y_ld, int H, const int64_t *rowmap,
                      const float *weights, int64_t T, int k, uint16_t *out) {
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
