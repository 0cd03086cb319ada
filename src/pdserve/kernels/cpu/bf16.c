/* A prompt's rows multiplied in bfloat16 (AVX512-BF16), where the CPU has
 * it: y[m, n] = bf16(x)[m, k] . w[n, k]^T, float32 sums, w the weight's
 * dense bfloat16 copy (a GGUF block's q * scale + zero, rounded once, as
 * the model's bfloat16 dtype holds it).
 *
 * A prompt's rows are many (a 128-token prompt is 128 rows), so their
 * products are bound by the multiply rate, not by reading the weights:
 * vdpbf16ps multiplies 16 pairs an instruction, as vpdpbusd does 32 byte
 * pairs, so one bfloat16 pass costs what one 8-bit pass does and half of
 * the two 8-bit passes (cpu/matmul.c's pd_linear_precise) that give a
 * prompt's rows their precision where this path is absent.
 *
 * w [n/8][k/2][8][2]: per group of 8 output columns, per pair of inputs,
 * one 32-byte vector whose lane c holds column c's two weights. x's rows
 * are rounded to bfloat16 pairs (nearest even) into scratch; a tile of 6
 * rows by 4 groups keeps 24 sums in registers while the 4 weight vectors
 * of a pair are loaded once for the 6 rows. Each output is one thread's
 * sum over the pairs in order, whatever the tile, the rows beside it or
 * the threads sharing the work (cpu/pool.c): a row's bits do not depend on
 * its round. Built and loaded by native.py, driven by cpu/layer.c. */

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "pdserve_cpu.h"

#define COLS 8             /* output columns a weight group */
#define ROWS 6             /* rows of x a tile */
#define GROUPS 4           /* weight groups a tile (a work item) */

#define BF16 __attribute__((target("avx2,fma,avx512f,avx512vl,avx512bw,avx512bf16")))

/* 1 where the CPU multiplies bfloat16 (AVX512-BF16 with VL), unless
 * PDSERVE_NO_BF16 is set (to compare with the 8-bit path) */
int pd_has_bf16(void) {
    static int known = -1;                 /* threads may race to the same answer */
    int have = __atomic_load_n(&known, __ATOMIC_RELAXED);
    if (have < 0) {
        have = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512bw") && !getenv("PDSERVE_NO_BF16");
        __atomic_store_n(&known, have, __ATOMIC_RELAXED);
    }
    return have;
}

struct bf16_product {
    const uint32_t *x;     /* [tiles * ROWS][k/2] bfloat16 pairs, padding rows zero */
    int64_t m, pairs, n, groups;
    const uint16_t *w;
    float *y;
};

/* rows r0.. (ROWS of them, those past m dropped) by groups g0..g0+G-1 */
#define TILE(G)                                                                             \
static BF16 void tile_##G(const struct bf16_product *p, int64_t r0, int64_t g0) {           \
    __m256 acc[ROWS][G];                                                                    \
    for (int r = 0; r < ROWS; r++)                                                          \
        for (int g = 0; g < G; g++) acc[r][g] = _mm256_setzero_ps();                        \
    const uint32_t *xr = p->x + r0 * p->pairs;                                              \
    const __m256i *wg = (const __m256i *)p->w + g0 * p->pairs;                              \
    for (int64_t i = 0; i < p->pairs; i++) {                                                \
        __m256bh w[G];                                                                      \
        for (int g = 0; g < G; g++)                                                         \
            w[g] = (__m256bh)_mm256_loadu_si256(wg + g * p->pairs + i);                     \
        for (int r = 0; r < ROWS; r++) {                                                    \
            const __m256bh xv = (__m256bh)_mm256_set1_epi32((int)xr[r * p->pairs + i]);     \
            for (int g = 0; g < G; g++) acc[r][g] = _mm256_dpbf16_ps(acc[r][g], xv, w[g]);  \
        }                                                                                   \
    }                                                                                       \
    for (int r = 0; r < ROWS && r0 + r < p->m; r++)                                         \
        for (int g = 0; g < G; g++)                                                         \
            _mm256_storeu_ps(p->y + (r0 + r) * p->n + (g0 + g) * COLS, acc[r][g]);          \
}
TILE(1)
TILE(2)
TILE(3)
TILE(4)

/* one work item: GROUPS weight groups (fewer at the end), every row */
static BF16 void product_item(void *ctx, int64_t item, int worker) {
    (void)worker;
    const struct bf16_product *p = ctx;
    const int64_t g0 = item * GROUPS;
    const int64_t g = p->groups - g0 < GROUPS ? p->groups - g0 : GROUPS;
    for (int64_t r0 = 0; r0 < p->m; r0 += ROWS)
        switch (g) {
        case 4: tile_4(p, r0, g0); break;
        case 3: tile_3(p, r0, g0); break;
        case 2: tile_2(p, r0, g0); break;
        default: tile_1(p, r0, g0); break;
        }
}

/* x's rows as bfloat16 pairs, rounded to nearest even; k a multiple of 8 */
static BF16 void round_rows(const float *x, int64_t m, int64_t k, uint32_t *out) {
    for (int64_t i = 0; i < m * k; i += 8)
        _mm_storeu_si128((__m128i *)((uint16_t *)out + i),
                         (__m128i)_mm256_cvtneps_pbh(_mm256_loadu_ps(x + i)));
}

/* y [m, n] = bf16(x) [m, k] . w^T; n a multiple of 8, k of 8; weight
 * groups shared with up to `threads` workers (0: every worker). Returns
 * 0, or -1 when scratch could not be allocated or the CPU lacks
 * AVX512-BF16 (pd_has_bf16). */
int pd_linear_bf16(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                   float *y, int threads) {
    if (!pd_has_bf16()) return -1;
    const int64_t tiles = (m + ROWS - 1) / ROWS;
    uint32_t *xb = calloc((size_t)(tiles * ROWS * (k / 2)), sizeof(uint32_t));
    if (!xb) return -1;
    round_rows(x, m, k, xb);
    struct bf16_product p = {xb, m, k / 2, n, n / COLS, w, y};
    pd_run(product_item, &p, (p.groups + GROUPS - 1) / GROUPS, 1, threads);
    free(xb);
    return 0;
}
