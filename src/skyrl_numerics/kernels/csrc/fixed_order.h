/* Binary32 primitives shared by the fused CPU kernels (the .c files beside this one). Each is written out,
 * operation by operation, in kernels/fixed_order.py, whose torch versions give the same bits.
 * Compile with -ffp-contract=off and without -ffast-math (kernels/native.py does). */
#ifndef SKYRL_FIXED_ORDER_H
#define SKYRL_FIXED_ORDER_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* exp_s(x): Cody-Waite reduction and Cephes' degree-5 polynomial, all in binary32, written
 * without branches (so loops over it vectorize). x > 88 -> +inf; x <= -87 (and -inf) -> 0;
 * NaN -> x. */
static inline float exp_s(float x) {
    float xc = x < -87.0f ? -87.0f : x;
    xc = xc > 88.0f ? 88.0f : xc;
    xc = (x != x) ? 0.0f : xc;
    float t = xc * 1.44269502162933349609375f;         /* log2(e) as binary32 */
    float n = (t + 12582912.0f) - 12582912.0f;        /* nearest integer, ties to even */
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float r2 = r * r;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r2 + r;
    p = p + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &e, 4);
    float out = p * two_n;
    out = x > 88.0f ? INFINITY : out;
    out = x > -87.0f ? out : 0.0f;
    return (x != x) ? x : out;
}

static inline void load_row(float *dst, const void *base, int64_t off, int dtype, int n) {
    if (dtype == 0) {
        memcpy(dst, (const float *)base + off, (size_t)n * 4);
    } else {
        const uint16_t *src = (const uint16_t *)base + off;
        for (int d = 0; d < n; d++) dst[d] = bf16_to_f32(src[d]);
    }
}

typedef float v8f __attribute__((vector_size(32)));   /* 8 lanes; elementwise IEEE ops */

static inline v8f load8(const float *p) {
    v8f x;
    memcpy(&x, p, sizeof x);
    return x;
}

/* fold8: out[i] = dot8's fold ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) of v[i], for 8
 * lane vectors at once: the same additions in the same association, on whole registers
 * (attention's scores, the AVX2 GEMM's tiles: a fold per output cost about what its dot
 * product did at 64 values). Slot s of the network takes
 * v[SLOT[s]] so that the outputs come out in order:
 *   C_p = (b_0..3 of slot 2p, b_0..3 of slot 2p + 1)             b_i = l_i + l_(i+4)
 *   D_q = (b0 + b2, b1 + b3) of slots 4q, 4q + 2, 4q + 1, 4q + 3
 *   out = (b0 + b2) + (b1 + b3) of slots 0, 2, 1, 3, 4, 6, 5, 7   (= v[0] .. v[7]) */
static const int SLOT[8] = {0, 2, 1, 3, 4, 6, 5, 7};

static inline v8f fold8(const v8f *v) {
    v8f C[4], Dq[2];
    for (int p = 0; p < 4; p++) {
        const v8f a = v[SLOT[2 * p]], b = v[SLOT[2 * p + 1]];
        C[p] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11)
             + __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
    }
    for (int q = 0; q < 2; q++)
        Dq[q] = __builtin_shufflevector(C[2 * q], C[2 * q + 1], 0, 1, 8, 9, 4, 5, 12, 13)
              + __builtin_shufflevector(C[2 * q], C[2 * q + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(Dq[0], Dq[1], 0, 2, 4, 6, 8, 10, 12, 14)
         + __builtin_shufflevector(Dq[0], Dq[1], 1, 3, 5, 7, 9, 11, 13, 15);
}

/* float32 -> bfloat16, round to nearest even, as torch's conversion; NaN -> 0x7FC0, as torch's
 * scalar loop (ATEN_CPU_CAPABILITY=default) — its AVX2 / AVX-512 loops give 0xFFFF (torch 2.13,
 * measured), so a NaN's payload is the one pattern that can differ from torch's .to there */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* dot8 over n values: lane c adds a[8u + c] * b[8u + c] over u in order from +0, then
 * ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) */
static inline float dot8(const float *a, const float *b, int n) {
    const int n8 = n - n % 8;
    v8f acc = (v8f){0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int u = 0; u < n8; u += 8) acc = acc + load8(a + u) * load8(b + u);
    for (int c = 0; n8 + c < n; c++) acc[c] = acc[c] + a[n8 + c] * b[n8 + c];
    const float b0 = acc[0] + acc[4], b1 = acc[1] + acc[5], b2 = acc[2] + acc[6], b3 = acc[3] + acc[7];
    return (b0 + b2) + (b1 + b3);
}

#endif
