/* Batch-invariant causal attention for CPU: the fused kernel behind skyrl_numerics.kernels.cpu.attention.
 *
 * The arithmetic is specified, operation by operation, in kernels/cpu_attention.py (the
 * docstring and the torch function `attention_spec`, which computes the same float32 operations
 * in the same order, so its results are bitwise equal to this file's). In short, per query row
 * (sequence b, head h, query i, at key position kv_len[b] - Sq + i):
 *
 *   keys lo .. n-1 (n = position + 1 when causal, else kv_len[b]; lo = 0, or with a sliding
 *   window W: max(0, n - W)), in blocks of block_n aligned at key 0 (a block's keys before lo
 *   are skipped: an exact no-op)
 *   m = -inf, l = +0 (with an attention sink s_h of the row's head: m = s_h, l = 1), acc = +0
 *   s_j   = dot8(q, k_j) * scale                      (dot8: 8 lanes, then a fixed fold)
 *   m'    = max(m, max_j s_j);  m* = 0 if m' is +-inf else m'
 *   alpha = exp_s(m - m*);  p_j = exp_s(s_j - m*)     (exp_s: the polynomial below)
 *   l     = l * alpha + (((0 + p_0) + p_1) + ...)
 *   acc_d = acc_d * alpha + (((0 + p_0 v_0d) + p_1 v_1d) + ...)
 *   out_d = acc_d / l
 *
 * Only IEEE-754 binary32 +, -, *, / and comparisons are used, each rounded on its own: this
 * file must be compiled with -ffp-contract=off (no fused multiply-add) and without -ffast-math
 * (no reassociation); vector width is then free (lanes are independent). A row's bits depend
 * only on its own query, its own keys/values and kv_len: not on the batch, the other rows, the
 * number of threads, or prefill vs decode.
 */
#include "fixed_order.h"

#define MAX_BLOCK 256
#define MAX_D 1024
#define TILE 8            /* query rows sharing each key/value load (same KV head) */

/* s[t][j] = dot8(q_t, k_{j0+j}) * scale for the first T rows of a tile: lane c adds
 * q[8u + c] k[8u + c] over u in order from +0, then ((a0 + a4) + (a2 + a6)) + ((a1 + a5) +
 * (a3 + a7)) (fold8, 8 keys at a time). The T rows' chains are interleaved (one key load for
 * all); T is a constant in each copy, so the loops unroll. Rows past the tile's real rows are
 * computed, never used. */
#define SCORES(T)                                                                        \
    static void scores_##T(float s[][MAX_BLOCK], float qf[][MAX_D], const float *K,      \
                           int64_t ksd, int64_t j0, int cnt, int D, float scale) {        \
        const int D8 = D - D % 8;                                                        \
        const v8f sc = (v8f){scale, scale, scale, scale, scale, scale, scale, scale};    \
        for (int j = 0; j < cnt; j += 8) {                                               \
            const int nj = (cnt - j) < 8 ? (cnt - j) : 8;                                \
            v8f a[T][8];                                                                 \
            for (int jj = 0; jj < 8; jj++) {                                             \
                for (int t = 0; t < T; t++) a[t][jj] = (v8f){0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}; \
                if (jj >= nj) continue;                                                  \
                const float *kr = K + (j0 + j + jj) * ksd;                               \
                for (int u = 0; u < D8; u += 8) {                                        \
                    const v8f kv = load8(kr + u);                                        \
                    for (int t = 0; t < T; t++) a[t][jj] = a[t][jj] + load8(qf[t] + u) * kv; \
                }                                                                        \
                for (int c = 0; D8 + c < D; c++)                                         \
                    for (int t = 0; t < T; t++)                                          \
                        a[t][jj][c] = a[t][jj][c] + qf[t][D8 + c] * kr[D8 + c];          \
            }                                                                            \
            for (int t = 0; t < T; t++) {                                                \
                const v8f r = fold8(a[t]) * sc;                                          \
                memcpy(&s[t][j], &r, (size_t)nj * 4);                                    \
            }                                                                            \
        }                                                                                \
    }
SCORES(1)
SCORES(2)
SCORES(4)
SCORES(8)

/* A (sequence b, KV head hk) pair's L key (or value) rows of n values as float32 rows: the
 * tensor itself when it is float32 and strided (*sd = its row stride), else converted into buf
 * (*sd = n). rb: the pair's slot list (paged), or NULL. */
static const float *kv_rows(const void *t, int dtype, int64_t sb, int64_t sh, int64_t ss,
                            const int64_t *rb, int64_t b, int hk, int64_t L, int n, float *buf,
                            int64_t *sd) {
    if (dtype == 0 && !rb) {
        *sd = ss;
        return (const float *)t + b * sb + hk * sh;
    }
    for (int64_t j = 0; j < L; j++)
        load_row(buf + j * n, t, (rb ? rb[j] * ss : b * sb + j * ss) + hk * sh, dtype, n);
    *sd = n;
    return buf;
}

/* q, k, v: base pointers with element strides (b, h, s); the last dim is contiguous.
 * dtype codes: 0 = float32, 1 = bfloat16. out: contiguous [B, H, Sq, Dv] of out_dtype.
 * Paged (rows != NULL): k and v are pools of rows, key j of sequence b being pool row
 * rows[b * rows_ld + j] (element offset row * k_ss + kv head * k_sh; k_sb unused), the same
 * values as a gather of those rows would give.
 * Computes the rows of the (sequence, KV head) pairs pair_lo .. pair_hi - 1 (pair = b * Hkv +
 * kv head): each KV head's g = H / Hkv query heads x Sq queries (query-major: row r is query
 * r / g of head r % g). A pair's keys and values are read (bfloat16: converted, exactly) once
 * into float32 rows; its query rows then go in tiles of TILE that share those loads, with the
 * TILE dot products of a key interleaved (a row's arithmetic is its own either way).
 * sinks: NULL, or H float32 logits (one per query head) that join every row's softmax
 * denominator as a key with a zero value, taken first (m = sinks[h], l = 1). window: 0, or
 * the sliding window W (a row sees its last W keys: lo = max(0, n - W)).
 * Returns 0; -1 on a size this build cannot take (block_n > MAX_BLOCK, D or Dv > MAX_D,
 * H not a multiple of Hkv); -2 when memory for the converted rows is not available; -3 when
 * a key's row (paged: rows[b * rows_ld + j], j < kv_lens[b]) is outside 0 .. pool_rows - 1
 * (checked before that pair reads any). */
int skyrl_attention_fwd(const void *q, int q_dtype, int64_t q_sb, int64_t q_sh, int64_t q_ss,
                        const void *k, int k_dtype, int64_t k_sb, int64_t k_sh, int64_t k_ss,
                        const void *v, int v_dtype, int64_t v_sb, int64_t v_sh, int64_t v_ss,
                        const int64_t *rows, int64_t rows_ld, int64_t pool_rows,
                        void *out, int out_dtype, const int64_t *kv_lens,
                        int B, int H, int Hkv, int Sq, int D, int Dv, int causal, float scale,
                        int block_n, int64_t pair_lo, int64_t pair_hi, const float *sinks,
                        int64_t window) {
    if (block_n < 1 || block_n > MAX_BLOCK || D > MAX_D || Dv > MAX_D || Hkv < 1 || H % Hkv
        || window < 0)
        return -1;
    (void)B;
    const int g = H / Hkv;
    const int64_t R = (int64_t)g * Sq;
    float qf[TILE][MAX_D], acc[TILE][MAX_D];
    float s[TILE][MAX_BLOCK];
    float m[TILE], l[TILE];
    int64_t nk[TILE], lo[TILE];
    int64_t orow[TILE];
    float *kbuf = NULL, *vbuf = NULL;
    int64_t cap = 0;
    int rc = 0;
    for (int64_t pair = pair_lo; pair < pair_hi && rc == 0; pair++) {
        const int b = (int)(pair / Hkv), hk = (int)(pair % Hkv);
        const int64_t L = kv_lens[b];
        /* this pair's keys and values as float32 rows: in place when stored as float32 */
        const float *K, *V;
        int64_t ksd, vsd;
        if ((k_dtype != 0 || v_dtype != 0 || rows) && L > cap) {
            free(kbuf);
            free(vbuf);
            cap = L;
            kbuf = (float *)malloc((size_t)cap * D * 4);
            vbuf = (float *)malloc((size_t)cap * Dv * 4);
            if (!kbuf || !vbuf) { rc = -2; break; }
        }
        const int64_t *rb = rows ? rows + b * rows_ld : NULL;
        for (int64_t j = 0; rb && j < L; j++)
            if (rb[j] < 0 || rb[j] >= pool_rows) rc = -3;
        if (rc) break;
        K = kv_rows(k, k_dtype, k_sb, k_sh, k_ss, rb, b, hk, L, D, kbuf, &ksd);
        V = kv_rows(v, v_dtype, v_sb, v_sh, v_ss, rb, b, hk, L, Dv, vbuf, &vsd);
        for (int64_t r0 = 0; r0 < R; r0 += TILE) {
            const int nt = (int)((R - r0) < TILE ? (R - r0) : TILE);
            int64_t nmax = 0, lmin = INT64_MAX;
            for (int t = 0; t < TILE; t++) {
                if (t >= nt) {       /* spare rows of the last tile: computed, never stored */
                    memcpy(qf[t], qf[0], (size_t)D * 4);
                    nk[t] = 0;
                    lo[t] = 0;
                    continue;
                }
                const int64_t r = r0 + t, i = r / g;
                const int h = hk * g + (int)(r % g);
                int64_t n = causal ? (L - Sq + i + 1) : L;
                nk[t] = n > L ? L : n;
                if (nk[t] > nmax) nmax = nk[t];
                lo[t] = (window > 0 && nk[t] > window) ? nk[t] - window : 0;
                if (lo[t] < lmin) lmin = lo[t];
                orow[t] = (((int64_t)b * H + h) * Sq + i) * Dv;
                load_row(qf[t], q, b * q_sb + h * q_sh + i * q_ss, q_dtype, D);
                m[t] = sinks ? sinks[h] : -INFINITY;
                l[t] = sinks ? 1.f : 0.f;
                for (int d = 0; d < Dv; d++) acc[t][d] = 0.f;
            }
            if (lmin == INT64_MAX) lmin = 0;
            for (int64_t j0 = lmin - lmin % block_n; j0 < nmax; j0 += block_n) {
                const int cnt = (int)((nmax - j0) < block_n ? (nmax - j0) : block_n);
                int cr[TILE], ca[TILE];                    /* this block's keys per row: ca .. cr-1 */
                for (int t = 0; t < TILE; t++) {
                    int64_t c = nk[t] - j0, a = lo[t] - j0;
                    cr[t] = c <= 0 ? 0 : (c < cnt ? (int)c : cnt);
                    ca[t] = a <= 0 ? 0 : (a < cr[t] ? (int)a : cr[t]);
                }
                if (nt <= 1) scores_1(s, qf, K, ksd, j0, cnt, D, scale);
                else if (nt <= 2) scores_2(s, qf, K, ksd, j0, cnt, D, scale);
                else if (nt <= 4) scores_4(s, qf, K, ksd, j0, cnt, D, scale);
                else scores_8(s, qf, K, ksd, j0, cnt, D, scale);
                for (int t = 0; t < nt; t++) {
                    const int c = cr[t], a0 = ca[t];
                    if (c == a0) continue;  /* none of this row's keys: an exact no-op */
                    float bm = -INFINITY;
                    for (int j = a0; j < c; j++) {
                        const float sj = s[t][j];
                        bm = (bm != bm) ? bm : ((sj != sj || sj > bm) ? sj : bm);
                    }
                    const float mn = (m[t] != m[t] || bm != bm) ? NAN : (bm > m[t] ? bm : m[t]);
                    const float ms = (mn == INFINITY || mn == -INFINITY) ? 0.f : mn;
                    const float alpha = exp_s(m[t] - ms);
                    float *p = s[t];
                    for (int j = a0; j < c; j++) p[j] = exp_s(p[j] - ms);
                    float ls = 0.f;
                    for (int j = a0; j < c; j++) ls = ls + p[j];
                    l[t] = l[t] * alpha + ls;
                    m[t] = mn;
                    /* acc_d = acc_d * alpha + (((+0 + p_0 v_0d) + p_1 v_1d) + ...), a chunk of
                     * d at a time summed over this block's keys in order */
                    float *ar = acc[t];
                    for (int d0 = 0; d0 < Dv; d0 += 32) {
                        const int w = (Dv - d0) < 32 ? (Dv - d0) : 32;
                        float pv[32];
                        for (int d = 0; d < 32; d++) pv[d] = 0.f;
                        const float *vr = V + (j0 + a0) * vsd + d0;
                        if (w == 32) {
                            for (int j = a0; j < c; j++, vr += vsd)
                                for (int d = 0; d < 32; d++) pv[d] = pv[d] + p[j] * vr[d];
                        } else {
                            for (int j = a0; j < c; j++, vr += vsd)
                                for (int d = 0; d < w; d++) pv[d] = pv[d] + p[j] * vr[d];
                        }
                        for (int d = 0; d < w; d++) ar[d0 + d] = ar[d0 + d] * alpha + pv[d];
                    }
                }
            }
            for (int t = 0; t < nt; t++) {
                float *a = acc[t];
                if (nk[t] <= lo[t] && !sinks) {
                    for (int d = 0; d < Dv; d++) a[d] = 0.f;
                } else {
                    for (int d = 0; d < Dv; d++) a[d] = a[d] / l[t];
                }
                if (out_dtype == 0) {
                    memcpy((float *)out + orow[t], a, (size_t)Dv * 4);
                } else {                 /* rounded once, to nearest even */
                    uint16_t *o = (uint16_t *)out + orow[t];
                    for (int d = 0; d < Dv; d++) o[d] = f32_to_bf16(a[d]);
                }
            }
        }
    }
    free(kbuf);
    free(vbuf);
    return rc;
}
