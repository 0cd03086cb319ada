/* A dense weight's product in an order this file fixes: y[m, n] = x[m, k]
 * . w[n, k]^T, x float32, w float32 or bfloat16 as stored (row-major, the
 * tensor torch holds, so a tied head needs no second copy).
 *
 * What a QuantizedLinear's dense copy multiplies (a prompt's rows outside
 * the C layers, a prompt's logits through the head) where torch's BLAS
 * would pick its kernel by the row count: on an Intel CPU with AMX a
 * float32 row among 1 to 15 rows came out with other last bits than among
 * 40 at SmolLM2's shapes, so a request's tokens depended on its round.
 *
 * Each output is one dot product: lane j of an 8-wide float32 accumulator
 * sums x[i] * w[i] for i = j, j + 8, j + 16, ... in that order with fused
 * multiply-adds, and the 8 lanes are added in one fixed tree. Only AVX2
 * and FMA instructions run, so the bits are the same on every x86 CPU that
 * has them (AMD or Intel, with AVX-512 and AMX or without), whatever the
 * rows beside it, the tile it falls in or the threads sharing the work
 * (cpu/pool.c). A tile of 4 rows by 3 weight rows keeps 12 sums in
 * registers; a lone row (a prompt's logits, bound by reading the weight)
 * takes 8 weight rows a tile. Built and loaded by native.py. */

#include <immintrin.h>
#include <stdint.h>

#include "pdserve_cpu.h"

#define TR 4               /* rows of x a tile */
#define TC 3               /* weight rows (outputs) a tile */
#define TC1 8              /* ... a tile of one row (a prompt's logits row: bound by reading w) */
#define ITEM_COLS 48       /* outputs a work item (16 tiles of TC) */

#define FMA __attribute__((target("avx2,fma")))

struct dense_product {
    const float *x;
    int64_t m, k, n;
    const void *w;
    int bf16;              /* w holds bfloat16 (else float32) */
    float *y;
};

/* eight of a weight row's values from i, widened to float32 (exact) */
static inline FMA __m256 load_w(const struct dense_product *p, int64_t row, int64_t i) {
    if (p->bf16) {
        const uint16_t *w = (const uint16_t *)p->w + row * p->k + i;
        __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)w));
        return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
    }
    return _mm256_loadu_ps((const float *)p->w + row * p->k + i);
}

/* the 8 lanes' sum, always in this order */
static inline FMA float lanes_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* rows r0..r0+R-1 by outputs c0..c0+C-1; R, C constants where inlined */
static inline __attribute__((always_inline)) FMA void
tile(const struct dense_product *p, int64_t r0, int64_t c0, int R, int C) {
    __m256 acc[TR][TC1];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < p->k; i += 8) {
        __m256 w[TC1];
        for (int c = 0; c < C; c++) w[c] = load_w(p, c0 + c, i);
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_loadu_ps(p->x + (r0 + r) * p->k + i);
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(xv, w[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) p->y[(r0 + r) * p->n + c0 + c] = lanes_sum(acc[r][c]);
}

#define TILE(R, C) static FMA void tile_##R##_##C(const struct dense_product *p, int64_t r0, \
                                                 int64_t c0) { tile(p, r0, c0, R, C); }
TILE(4, 3) TILE(4, 2) TILE(4, 1)
TILE(3, 3) TILE(3, 2) TILE(3, 1)
TILE(2, 3) TILE(2, 2) TILE(2, 1)
TILE(1, 8) TILE(1, 7) TILE(1, 6) TILE(1, 5) TILE(1, 4) TILE(1, 3) TILE(1, 2) TILE(1, 1)

typedef void (*tile_fn)(const struct dense_product *, int64_t, int64_t);
static const tile_fn TILES[TR][TC1] = {
    {tile_1_1, tile_1_2, tile_1_3, tile_1_4, tile_1_5, tile_1_6, tile_1_7, tile_1_8},
    {tile_2_1, tile_2_2, tile_2_3}, {tile_3_1, tile_3_2, tile_3_3}, {tile_4_1, tile_4_2, tile_4_3},
};

/* one work item: ITEM_COLS outputs (fewer at the end), every row */
static void product_item(void *ctx, int64_t item, int worker) {
    (void)worker;
    const struct dense_product *p = ctx;
    const int64_t end = (item + 1) * ITEM_COLS < p->n ? (item + 1) * ITEM_COLS : p->n;
    for (int64_t r0 = 0; r0 < p->m; r0 += TR) {
        const int R = p->m - r0 < TR ? (int)(p->m - r0) : TR;
        const int width = R == 1 ? TC1 : TC;
        for (int64_t c0 = item * ITEM_COLS; c0 < end; c0 += width) {
            const int C = end - c0 < width ? (int)(end - c0) : width;
            TILES[R - 1][C - 1](p, r0, c0);
        }
    }
}

/* y [m, n] = x [m, k] . w^T, w [n, k] float32 (bf16 = 0) or bfloat16
 * (bf16 = 1); k a multiple of 8. Outputs shared with up to `threads`
 * workers (0: every worker). Returns 0, or -1 for a k it does not take. */
int pd_linear_dense(const float *x, int64_t m, int64_t k, const void *w, int bf16, int64_t n,
                    float *y, int threads) {
    if (k % 8) return -1;
    struct dense_product p = {x, m, k, n, w, bf16, y};
    pd_run(product_item, &p, (n + ITEM_COLS - 1) / ITEM_COLS, 1, threads);
    return 0;
}
