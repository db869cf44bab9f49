/* RMSNorm for CPU, fixed order: the fused kernel behind skyrl_numerics.kernels.cpu.rms_norm.
 * Specified operation by operation in kernels/cpu_norm.py (`rms_norm_spec` gives the same bits):
 *
 *   ss_r   = dot8(x_r, x_r)                     (fixed_order.h)
 *   rstd_r = 1 / sqrt(ss_r / N + eps)
 *   y_rd   = round((x_rd * rstd_r) * w_rd)       (w_rd = w[r * w_ld + d]; w_ld = 0: one weight row)
 *
 * round: to the output type (bfloat16: nearest even; float32: none).
 *
 * skyrl_add_rms_norm: the residual add before it, in the same pass (below).
 */
#include "fixed_order.h"

#define NORM_MAX_N 65536

/* y_r of one float32 row xf (wf: its weight row), into y (y_dtype) at row offset yo; returns rstd_r */
static inline float norm_row(const float *xf, const float *wf, int N, float eps, void *y, int y_dtype,
                             int64_t yo) {
    const float ss = dot8(xf, xf, N);
    const float rs = 1.0f / sqrtf(ss / (float)N + eps);
    if (y_dtype == 0) {
        float *o = (float *)y + yo;
        for (int d = 0; d < N; d++) o[d] = (xf[d] * rs) * wf[d];
    } else {
        uint16_t *o = (uint16_t *)y + yo;
        for (int d = 0; d < N; d++) o[d] = f32_to_bf16((xf[d] * rs) * wf[d]);
    }
    return rs;
}

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
        const float rs = norm_row(xf, wf, N, eps, y, y_dtype, r * (int64_t)N);
        if (rstd) rstd[r] = rs;
    }
    free(xf);
    return 0;
}

/* The residual add and the norm after it (a pre-norm decoder's h = h + a; y = rms_norm(h)), one
 * pass per row: s_rd = round(float32(h_rd) + float32(a_rd)) (one binary32 addition of exact
 * widenings, rounded once to bfloat16: torch's bfloat16 add), then y_r = the norm above of s_r
 * (its bfloat16 values) with the weight w (w_dtype, one row). h, a: bfloat16 rows at h_ld /
 * a_ld; s, y: contiguous bfloat16 [M, N]. Rows lo .. hi - 1. Returns as skyrl_rms_norm_fwd. */
int skyrl_add_rms_norm(const uint16_t *h, int64_t h_ld, const uint16_t *a, int64_t a_ld,
                       const void *w, int w_dtype, uint16_t *s, uint16_t *y, int64_t lo, int64_t hi,
                       int N, float eps) {
    if (N < 1 || N > NORM_MAX_N) return -1;
    float *xf = (float *)malloc((size_t)N * 8);
    if (!xf) return -2;
    float *wf = xf + N;
    load_row(wf, w, 0, w_dtype, N);
    for (int64_t r = lo; r < hi; r++) {
        uint16_t *sr = s + r * (int64_t)N;
        for (int d = 0; d < N; d++) {
            sr[d] = f32_to_bf16(bf16_to_f32(h[r * h_ld + d]) + bf16_to_f32(a[r * a_ld + d]));
            xf[d] = bf16_to_f32(sr[d]);
        }
        norm_row(xf, wf, N, eps, y, 1, r * (int64_t)N);
    }
    free(xf);
    return 0;
}
