/* The bf16 GEMM on Intel AMX tiles: the kernel behind cpu_gemm_bf16's "amx" arithmetic
 * (SKYRL_NUMERICS_GEMM=amx), for x and w both bfloat16.
 *
 *   out[m, n] = amx_dot(x[m, 0:K], w[n, 0:K])                x, w bfloat16 (row-major, K contiguous)
 *
 * amx_dot: C = +0; for kb = 0, 1, ... (blocks of 32 values, the last zero-padded):
 *              C = TDPBF16PS(C, w[n, 32kb : 32kb + 32], x[m, 32kb : 32kb + 32])
 * TDPBF16PS adds 16 bf16 pair products to each float32 accumulator in one instruction. Its
 * internal order and rounding are the hardware's (benchmarks/dpbf16: one pair is
 * ftz(RN(c + ftz(RN(a0 b0 + a1 b1)))); no sequential model reproduces 16 pairs), so this
 * arithmetic has no torch specification: it is defined by the instruction, the same on every
 * AMX CPU, and it is not the portable fma arithmetic of gemm_bf16.c. What this kernel promises
 * is what batch invariance needs: each output is computed from its own row of x and of w only,
 * by the same instruction sequence (the k blocks in order) whatever M, N, the tile it falls in
 * or the thread: one output element of TDPBF16PS depends on its row of A, its column of B and
 * its accumulator only.
 *
 * Layout: w's rows are the A operand as stored (16 rows of w x 32 bf16 = one 1 KB tile, loaded
 * with w's row stride; a partial block of rows or of k goes through a zero-padded copy), x is
 * packed once per call (skyrl_amx_pack_x) into the B operand's pair layout, and the accumulator
 * tile C^T [16 n x 16 m] is written transposed into out.
 *
 * Linux grants a process AMX's tile state on request (arch_prctl ARCH_REQ_XCOMP_PERM);
 * skyrl_amx_available asks once. Built only where the compiler targets AMX (-march=native on
 * an AMX CPU); elsewhere skyrl_amx_available answers 0 and the kernel refuses.
 */
#define _GNU_SOURCE      /* syscall() */
#include "fixed_order.h"

/* x (bfloat16 [M, K], row stride ldx) into the B operand's pair layout: block (mb, kb) is 512
 * values at xp + (mb * KB + kb) * 512, row r holding x[16 mb + j, 32 kb + 2r + i] at 32 r + 2 j + i;
 * rows past M and k past K are zero. xp holds MB * KB * 512 values, MB = ceil(M / 16),
 * KB = ceil(K / 32). */
int skyrl_amx_pack_x(const uint16_t *x, int64_t ldx, int64_t M, int64_t K, uint16_t *xp) {
    if (M < 0 || K < 0 || ldx < K) return -1;
    const int64_t MB = (M + 15) / 16, KB = (K + 31) / 32;
    memset(xp, 0, (size_t)(MB * KB * 512) * 2);
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *xr = x + m * ldx;
        uint16_t *row = xp + (m / 16) * KB * 512 + 2 * (m % 16);
        for (int64_t kb = 0; kb < KB; kb++) {
            uint16_t *dst = row + kb * 512;
            const int64_t k0 = kb * 32, kc = K - k0 < 32 ? K - k0 : 32;
            if (kc == 32)
                for (int r = 0; r < 16; r++) memcpy(dst + r * 32, xr + k0 + 2 * r, 4);
            else
                for (int64_t t = 0; t < kc; t++) dst[(t / 2) * 32 + (t & 1)] = xr[k0 + t];
        }
    }
    return 0;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int skyrl_amx_available(void) {
    static volatile int state = -1;          /* a race only repeats the same request */
    if (state < 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return state;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void configure(void) {   /* 8 tiles of 16 rows x 64 bytes: C 0-3, w 4-5, x 6-7 */
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = 16;
    }
    _tile_loadconfig(&c);
}

/* A tile of w: rows n .. n+15, k from k0 (32 values). Full: w itself; else the zero-padded
 * copy in buf. Sets *stride (bytes). */
static const uint16_t *w_tile(const uint16_t *w, int64_t ldw, int64_t n, int64_t n_end, int64_t k0,
                              int64_t K, uint16_t *buf, int64_t *stride) {
    if (n + 16 <= n_end && k0 + 32 <= K) {
        *stride = ldw * 2;
        return w + n * ldw + k0;
    }
    memset(buf, 0, 1024);
    const int64_t kc = K - k0 < 32 ? K - k0 : 32;
    for (int64_t r = 0; r < 16 && n + r < n_end; r++) memcpy(buf + r * 32, w + (n + r) * ldw + k0, kc * 2);
    *stride = 64;
    return buf;
}

static void scatter(const float *c, float *out, int64_t ldo, int64_t n, int64_t n_end, int64_t m,
                    int64_t M) {
    const int64_t ni = n_end - n < 16 ? n_end - n : 16, mj = M - m < 16 ? M - m : 16;
    /* c is C^T: column j of c is row m + j of out (16 values a gather, stored under a mask) */
    const __m512i col = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48,
                                         32, 16, 0);
    const __mmask16 keep = (__mmask16)((1u << ni) - 1u);
    for (int64_t j = 0; j < mj; j++)
        _mm512_mask_storeu_ps(out + (m + j) * ldo + n, keep,
                              _mm512_i32gather_ps(_mm512_add_epi32(col, _mm512_set1_epi32((int)j)), c, 4));
}

/* NT w tiles x MT x tiles of accumulators (tile numbers are immediates, hence the macro) */
#define BLOCK(NT, MT)                                                                             \
    static void block_##NT##x##MT(const uint16_t *xp, int64_t KB, const uint16_t *w, int64_t ldw, \
                                  int64_t K, int64_t n, int64_t n_end, int64_t mb, float *out,    \
                                  int64_t ldo, int64_t M) {                                       \
        uint16_t buf0[512], buf1[512];                                                            \
        float c[256];                                                                             \
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);                               \
        for (int64_t kb = 0; kb < KB; kb++) {                                                     \
            int64_t s0, s1;                                                                       \
            const uint16_t *a0 = w_tile(w, ldw, n, n_end, kb * 32, K, buf0, &s0);                 \
            _tile_loadd(4, a0, s0);                                                               \
            _tile_loadd(6, xp + (mb * KB + kb) * 512, 64);                                        \
            if (MT == 2) _tile_loadd(7, xp + ((mb + 1) * KB + kb) * 512, 64);                     \
            _tile_dpbf16ps(0, 4, 6);                                                              \
            if (MT == 2) _tile_dpbf16ps(1, 4, 7);                                                 \
            if (NT == 2) {                                                                        \
                const uint16_t *a1 = w_tile(w, ldw, n + 16, n_end, kb * 32, K, buf1, &s1);        \
                _tile_loadd(5, a1, s1);                                                           \
                _tile_dpbf16ps(2, 5, 6);                                                          \
                if (MT == 2) _tile_dpbf16ps(3, 5, 7);                                             \
            }                                                                                     \
        }                                                                                         \
        _tile_stored(0, c, 64); scatter(c, out, ldo, n, n_end, mb * 16, M);                       \
        if (MT == 2) { _tile_stored(1, c, 64); scatter(c, out, ldo, n, n_end, mb * 16 + 16, M); } \
        if (NT == 2) {                                                                            \
            _tile_stored(2, c, 64); scatter(c, out, ldo, n + 16, n_end, mb * 16, M);              \
            if (MT == 2) { _tile_stored(3, c, 64); scatter(c, out, ldo, n + 16, n_end, mb * 16 + 16, M); } \
        }                                                                                         \
    }
BLOCK(2, 2)
BLOCK(2, 1)
BLOCK(1, 2)
BLOCK(1, 1)

/* out[m, n] (float32, row stride ldo) for m < M and n_lo <= n < n_hi, from x packed by
 * skyrl_amx_pack_x and w bfloat16 [N, K] (row stride ldw). Returns 0, -1 for a bad shape, -2
 * when AMX is not available. */
int skyrl_gemm_bf16_amx(const uint16_t *xp, const uint16_t *w, int64_t ldw, float *out, int64_t ldo,
                        int64_t M, int64_t K, int64_t n_lo, int64_t n_hi) {
    if (M < 0 || K < 0 || n_lo < 0 || n_hi < n_lo || ldw < K) return -1;
    if (!skyrl_amx_available()) return -2;
    if (M == 0 || n_hi == n_lo) return 0;
    const int64_t MB = (M + 15) / 16, KB = (K + 31) / 32;
    configure();
    for (int64_t n = n_lo; n < n_hi; n += 32) {
        const int two_n = n + 16 < n_hi;
        for (int64_t mb = 0; mb < MB; mb += 2) {
            const int two_m = mb + 1 < MB;
            if (two_n && two_m) block_2x2(xp, KB, w, ldw, K, n, n_hi, mb, out, ldo, M);
            else if (two_n) block_2x1(xp, KB, w, ldw, K, n, n_hi, mb, out, ldo, M);
            else if (two_m) block_1x2(xp, KB, w, ldw, K, n, n_hi, mb, out, ldo, M);
            else block_1x1(xp, KB, w, ldw, K, n, n_hi, mb, out, ldo, M);
        }
    }
    _tile_release();
    return 0;
}

#else
int skyrl_amx_available(void) { return 0; }
int skyrl_gemm_bf16_amx(const uint16_t *xp, const uint16_t *w, int64_t ldw, float *out, int64_t ldo,
                        int64_t M, int64_t K, int64_t n_lo, int64_t n_hi) {
    (void)xp; (void)w; (void)ldw; (void)out; (void)ldo; (void)M; (void)K; (void)n_lo; (void)n_hi;
    return -2;
}
#endif

/* Grouped rows (an MoE layer's experts), as skyrl_gemm_bf16_grouped: rows row_off[g] ..
 * row_off[g + 1] - 1 of x times w_ptrs[g]. skyrl_amx_pack_grouped packs each group on its own
 * (its rows from block 0) one after the other into xp; skyrl_gemm_bf16_amx_grouped computes
 * columns n_lo .. n_hi - 1 of every group from it. Each output is skyrl_gemm_bf16_amx's. */
static int64_t packed_size(int64_t rows, int64_t K) { return (rows + 15) / 16 * ((K + 31) / 32) * 512; }

int skyrl_amx_pack_grouped(const uint16_t *x, int64_t ldx, const int64_t *row_off, int64_t G,
                           int64_t K, uint16_t *xp) {
    for (int64_t g = 0; g < G; g++) {
        const int64_t r0 = row_off[g], r1 = row_off[g + 1];
        if (r1 < r0) return -1;
        const int rc = skyrl_amx_pack_x(x + r0 * ldx, ldx, r1 - r0, K, xp);
        if (rc) return rc;
        xp += packed_size(r1 - r0, K);
    }
    return 0;
}

int skyrl_gemm_bf16_amx_grouped(const uint16_t *xp, const uint64_t *w_ptrs, int64_t ldw,
                                const int64_t *row_off, int64_t G, float *out, int64_t ldo,
                                int64_t K, int64_t n_lo, int64_t n_hi) {
    for (int64_t g = 0; g < G; g++) {
        const int64_t r0 = row_off[g], r1 = row_off[g + 1];
        if (r1 < r0) return -1;
        if (r1 == r0) continue;
        const int rc = skyrl_gemm_bf16_amx(xp, (const uint16_t *)(uintptr_t)w_ptrs[g], ldw,
                                           out + r0 * ldo, ldo, r1 - r0, K, n_lo, n_hi);
        if (rc) return rc;
        xp += packed_size(r1 - r0, K);
    }
    return 0;
}
