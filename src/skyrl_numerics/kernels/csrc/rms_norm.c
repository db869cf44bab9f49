/* RMSNorm for CPU, fixed order: the fused kernel behind skyrl_numerics.kernels.cpu.rms_norm.
 * Specified operation by operation in kernels/cpu_norm.py (`rms_norm_spec` gives the same bits):
 *
 *   ss_r   = dot8(x_r, x_r)                     (fixed_order.h)
 *   rstd_r = 1 / sqrt(ss_r / N + eps)
 *   y_rd   = round((x_rd * rstd_r) * w_rd)       (w_rd = w[r * w_ld + d]; w_ld = 0: one weight row)
 *
 * round: to the output type (bfloat16: nearest even; float32: none).
 */
#include "fixed_order.h"

#define NORM_MAX_N 65536

/* x, w: dtype codes 0 = float32, 1 = bfloat16; rows of x at x_ld elements; y (y_dtype) and
 * rstd (float32, may be NULL) contiguous. Rows lo .. hi - 1. Returns 0; -1 if N is too large, -2 without memory. */
int skyrl_rms_norm_fwd(const void *x, int x_dtype, int64_t x_ld, const void *w, int w_dtype,
                       int64_t w_ld, void *y, int y_dtype, float *rstd, int64_t lo, int64_t hi,
                       int N, float eps) {
    if (N < 1 || N > NORM_MAX_N) return -1;
    float *xf = (float *)malloc((size_t)N * 8);
    if (!xf) return -2;
    float *wf = xf + N;
    if (w_ld == 0) load_row(wf, w, 0, w_dtype, N);
    for (int64_t r = lo; r < hi; r++) {
        load_row(xf, x, r * x_ld, x_dtype, N);
        if (w_ld != 0) load_row(wf, w, r * w_ld, w_dtype, N);
        const float ss = dot8(xf, xf, N);
        const float rs = 1.0f / sqrtf(ss / (float)N + eps);
        if (rstd) rstd[r] = rs;
        if (y_dtype == 0) {
            float *o = (float *)y + r * (int64_t)N;
            for (int d = 0; d < N; d++) o[d] = (xf[d] * rs) * wf[d];
        } else {
            uint16_t *o = (uint16_t *)y + r * (int64_t)N;
            for (int d = 0; d < N; d++) o[d] = f32_to_bf16((xf[d] * rs) * wf[d]);
        }
    }
    free(xf);
    return 0;
}
