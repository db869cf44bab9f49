/* Row sums for CPU, fixed order: the kernel behind skyrl_numerics.kernels.cpu.row_sum, whose
 * torch code is its specification (the same bits; tests/kernels/test_cpu_isa.py also checks
 * both against a numpy model of the tree):
 *
 *   P = min(pow2(N), 1024),  nb = ceil(N / P)
 *   block b: its P elements (zero-padded past N), halved in place while P > 1:
 *            x[i] = x[i] + x[i + h],  h = P/2, P/4, ..., 1
 *   the nb block sums, zero-padded to pow2(nb), halved the same way;  result + 0.0f
 *
 * Every operation is an IEEE binary32 addition (no reassociation: -fno-fast-math), so trailing
 * zeros, the number of rows and the CPU's vector width change no bits.
 */
#include "fixed_order.h"

#define SUM_BLOCK 1024

static int64_t pow2_at_least(int64_t n) {
    int64_t p = 1;
    while (p < n) p <<= 1;
    return p;
}

static float halve(float *x, int64_t p) {
    for (int64_t h = p / 2; h >= 1; h /= 2)
        for (int64_t i = 0; i < h; i++) x[i] = x[i] + x[i + h];
    return x[0];
}

/* x float32, rows lo .. hi - 1 of N elements at x_ld; out float32 (one per row). Returns 0,
 * -2 without memory. */
int skyrl_row_sum(const float *x, int64_t x_ld, int64_t N, float *out, int64_t lo, int64_t hi) {
    const int64_t P = N < SUM_BLOCK ? pow2_at_least(N) : SUM_BLOCK;
    const int64_t nb = (N + P - 1) / P, Q = pow2_at_least(nb);
    float *buf = (float *)malloc((size_t)(P + Q) * sizeof(float));
    if (!buf) return -2;
    float *sums = buf + P;
    for (int64_t r = lo; r < hi; r++) {
        const float *row = x + r * x_ld;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t j0 = b * P, n = N - j0 < P ? N - j0 : P;
            for (int64_t i = 0; i < n; i++) buf[i] = row[j0 + i];
            for (int64_t i = n; i < P; i++) buf[i] = 0.0f;
            sums[b] = halve(buf, P);
        }
        for (int64_t b = nb; b < Q; b++) sums[b] = 0.0f;
        out[r] = halve(sums, Q) + 0.0f;
    }
    free(buf);
    return 0;
}
