/* Per-head RMSNorm then rotary embedding, fused (Qwen3's q_norm / k_norm + RoPE) for CPU.
 * The same operations, in the same order, as the unfused torch path
 * (skyrl_numerics.invariant.blocks.rms_norm_heads, then blocks.Rope):
 *
 *   per head row x (D values) with its weight w (q_norm for query heads, k_norm for key heads):
 *     ss = dot8(x, x);  rstd = 1 / sqrt(ss / D + eps);  y_d = bf16((x_d * rstd) * w_d)
 *   (no weights given, a family without q/k norms: y = x)
 *   rotate y at the token's cos/sin (c_i, s_i, i < D/2, float32):
 *     neox: out_i = bf16(y_i c_i - y_{i+D/2} s_i),  out_{i+D/2} = bf16(y_{i+D/2} c_i + y_i s_i)
 *     gptj: out_2i = bf16(y_2i c_i - y_2i+1 s_i),   out_2i+1 = bf16(y_2i+1 c_i + y_2i s_i)
 *
 * Inputs bfloat16: q (T, Hq, D), k (T, Hk, D) with row strides; weights (D,) bf16; cos/sin
 * (T, D/2) float32 contiguous. Outputs bf16: q_out (T, Hq, D) contiguous, k_out at k_out_ld
 * per token (e.g. the first half of a [k | v] cache row). Tokens lo .. hi - 1.
 *
 * skyrl_qkv_norm_rope: the q / k / v projections before it, in the same call (a small model's
 * decode step, where the calls around the arithmetic cost more than the arithmetic):
 *   q, k, v = bf16(x Wq^T), bf16(x Wk^T), bf16(x Wv^T)   each output skyrl_gemm_bf16's dot product,
 *                                                          rounded to nearest even (torch's .to)
 *   with biases (Qwen2's): q = bf16(q + bq) etc.          (torch's bf16 add: one float32 addition)
 *   q_out, k part of rows = the above;  v part of rows = v
 */
#include "fixed_order.h"

#define ROPE_MAX_D 1024

static void norm_rope_row(const uint16_t *x, const float *w, const float *c, const float *s,
                          int D, float eps, int gptj, uint16_t *out) {
    float xf[ROPE_MAX_D], y[ROPE_MAX_D];
    for (int d = 0; d < D; d++) xf[d] = bf16_to_f32(x[d]);
    if (w) {
        const float ss = dot8(xf, xf, D);
        const float rs = 1.0f / sqrtf(ss / (float)D + eps);
        for (int d = 0; d < D; d++) y[d] = bf16_to_f32(f32_to_bf16((xf[d] * rs) * w[d]));
    } else {
        memcpy(y, xf, (size_t)D * sizeof(float));
    }
    const int h = D / 2;
    if (!gptj) {
        for (int i = 0; i < h; i++) {
            out[i] = f32_to_bf16(y[i] * c[i] - y[i + h] * s[i]);
            out[i + h] = f32_to_bf16(y[i + h] * c[i] + y[i] * s[i]);
        }
    } else {
        for (int i = 0; i < h; i++) {
            out[2 * i] = f32_to_bf16(y[2 * i] * c[i] - y[2 * i + 1] * s[i]);
            out[2 * i + 1] = f32_to_bf16(y[2 * i + 1] * c[i] + y[2 * i] * s[i]);
        }
    }
}

int skyrl_qk_norm_rope(const uint16_t *q, int64_t q_ld, int Hq, const uint16_t *k, int64_t k_ld,
                       int Hk, const uint16_t *qw, const uint16_t *kw, const float *cos_,
                       const float *sin_, int D, float eps, int gptj, uint16_t *q_out,
                       uint16_t *k_out, int64_t k_out_ld, int64_t lo, int64_t hi) {
    if (D < 2 || D % 2 || D > ROPE_MAX_D) return -1;
    if (!qw != !kw) return -1;
    float qwf[ROPE_MAX_D], kwf[ROPE_MAX_D];
    for (int d = 0; qw && d < D; d++) { qwf[d] = bf16_to_f32(qw[d]); kwf[d] = bf16_to_f32(kw[d]); }
    const float *qwp = qw ? qwf : NULL, *kwp = kw ? kwf : NULL;
    const int h = D / 2;
    for (int64_t t = lo; t < hi; t++) {
        const float *c = cos_ + t * h, *s = sin_ + t * h;
        for (int j = 0; j < Hq; j++)
            norm_rope_row(q + t * q_ld + (int64_t)j * D, qwp, c, s, D, eps, gptj,
                          q_out + (t * Hq + j) * (int64_t)D);
        for (int j = 0; j < Hk; j++)
            norm_rope_row(k + t * k_ld + (int64_t)j * D, kwp, c, s, D, eps, gptj,
                          k_out + t * k_out_ld + (int64_t)j * D);
    }
    return 0;
}

int skyrl_gemm_bf16(const float *x, int64_t ldx, const uint16_t *w, int64_t ldw, float *out,
                    int64_t ldo, int64_t M, int64_t K, int64_t n_lo, int64_t n_hi);

/* x: T bf16 rows of K at x_ld (widened once, exactly); wq [Hq D, K], wk / wv [Hk D, K] bf16 at
 * their leading dims; bq, bk, bv: their bf16 biases, or all NULL; qw, kw: the q/k norm weights,
 * or both NULL. rows: bf16 [T, 2 Hk D] at rows_ld ([k | v]). Returns 0; -1 on a bad size;
 * -2 without memory. */
int skyrl_qkv_norm_rope(const uint16_t *x, int64_t x_ld, int64_t K, const uint16_t *wq, int64_t wq_ld,
                        const uint16_t *wk, int64_t wk_ld, const uint16_t *wv, int64_t wv_ld,
                        const uint16_t *bq, const uint16_t *bk, const uint16_t *bv, int Hq,
                        int Hk, const uint16_t *qw, const uint16_t *kw, const float *cos_,
                        const float *sin_, int D, float eps, int gptj, uint16_t *q_out,
                        uint16_t *rows, int64_t rows_ld, int64_t T) {
    if (D < 2 || D % 2 || D > ROPE_MAX_D || T < 0 || K < 1) return -1;
    const int64_t nq = (int64_t)Hq * D, nk = (int64_t)Hk * D, n = nq + 2 * nk;
    const int64_t rows_t = T > 0 ? T : 1;
    float *f = (float *)malloc((size_t)rows_t * (n + K) * sizeof(float));
    uint16_t *b = (uint16_t *)malloc((size_t)rows_t * n * sizeof(uint16_t));
    int rc = (!f || !b) ? -2 : 0;
    float *xf = f + rows_t * n;
    for (int64_t t = 0; !rc && t < T; t++) load_row(xf + t * K, x, t * x_ld, 1, (int)K);
    if (!rc) rc = skyrl_gemm_bf16(xf, K, wq, wq_ld, f, n, T, K, 0, nq);
    if (!rc) rc = skyrl_gemm_bf16(xf, K, wk, wk_ld, f + nq, n, T, K, 0, nk);
    if (!rc) rc = skyrl_gemm_bf16(xf, K, wv, wv_ld, f + nq + nk, n, T, K, 0, nk);
    if (!rc) {
        for (int64_t i = 0; i < T * n; i++) b[i] = f32_to_bf16(f[i]);
        for (int64_t t = 0; bq && t < T; t++) {
            uint16_t *r = b + t * n;
            for (int64_t j = 0; j < nq; j++) r[j] = f32_to_bf16(bf16_to_f32(r[j]) + bf16_to_f32(bq[j]));
            for (int64_t j = 0; j < nk; j++) {
                r[nq + j] = f32_to_bf16(bf16_to_f32(r[nq + j]) + bf16_to_f32(bk[j]));
                r[nq + nk + j] = f32_to_bf16(bf16_to_f32(r[nq + nk + j]) + bf16_to_f32(bv[j]));
            }
        }
        rc = skyrl_qk_norm_rope(b, n, Hq, b + nq, n, Hk, qw, kw, cos_, sin_, D, eps, gptj, q_out,
                                rows, rows_ld, 0, T);
    }
    if (!rc)
        for (int64_t t = 0; t < T; t++)
            memcpy(rows + t * rows_ld + nk, b + t * n + nq + nk, (size_t)nk * sizeof(uint16_t));
    free(f);
    free(b);
    return rc;
}
