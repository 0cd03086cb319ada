/* pdserve's CPU matmuls for a GGUF's 4- and 8-bit blocks (AVX2 and FMA).
 *
 * y[m, n] = x[m, k] . w[n, k]^T, where w keeps the file's blocks of 32
 * weights (w = q * scale + zero) and each row of x is quantized on the way
 * in to blocks of 32 signed bytes with one float scale each (xd = max|x| /
 * 127, q = round(x / xd)). A block's product is then an exact integer dot
 * product of bytes, scaled once: scale * xd * sum(qw * qx) + zero * xd *
 * sum(qx). Integer products read a quarter of the bytes of float32 ones and
 * multiply 32 pairs per instruction (vpmaddubsw, or AVX512-VNNI's vpdpbusd
 * where the CPU has it, chosen at run time).
 *
 * Every output is computed by one thread in one order (blocks in turn, then
 * the zero terms), whatever the rows beside it, the tile it falls in or the
 * threads sharing the work (cpu/pool.c): a row's result has the same bits
 * alone or batched.
 *
 * Weights come in groups of 8 output rows (the caller pads n to a multiple
 * of 8), block-major within a group, and within a block as 8 vectors whose
 * int32 lane c holds 4 consecutive weights of output c (see GROUP_ROWS):
 *   4 bits: w [n/8][k/32][4][8][4] bytes, byte [p][c][t] being byte 4p + t
 *           of column c's GGUF block (weights 4p + t and 16 + 4p + t in its
 *           low and high nibble); scale, zero [n/8][k/32][8] floats.
 *   8 bits: w [n/8][k/32][8][8][4] signed bytes, [j][c][t] being column
 *           c's weight 4j + t; scale [n/8][k/32][8].
 * Built and loaded by cpu/matmul.py. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pdserve_cpu.h"

#define GROUP 32            /* weights per block, and activations per scale */
#define COLS 8              /* output rows per weight group */

/* x's rows as blocks of GROUP signed bytes q, their scales d, d * sum(q)
 * and sum(q) */
static void quantize_rows(const float *x, int64_t blocks, int8_t *q, float *d, float *s,
                          int32_t *sums) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < blocks; i++) {
        const float *xb = x + i * GROUP;
        __m256 v[4], a = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(xb + 8 * j);
            a = _mm256_max_ps(a, _mm256_andnot_ps(sign, v[j]));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        /* max drops NaNs: a block holding one gets a NaN scale, so its
         * products are NaN, as a float matmul's would be */
        __m256 nan = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[j], v[j], _CMP_UNORD_Q));
        const float di = _mm256_movemask_ps(nan) ? NAN : _mm_cvtss_f32(h) / 127.0f;
        const __m256 inv = _mm256_set1_ps(di != 0.0f ? 1.0f / di : 0.0f);
        __m256i qi[4];
        for (int j = 0; j < 4; j++)
            qi[j] = _mm256_cvtps_epi32(_mm256_round_ps(
                _mm256_mul_ps(v[j], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m256i sum = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]),
                                       _mm256_add_epi32(qi[2], qi[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_hadd_epi32(s4, s4);
        s4 = _mm_hadd_epi32(s4, s4);
        /* packs work within 128-bit lanes: put the 32 bytes back in order */
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                       _mm256_packs_epi32(qi[2], qi[3]));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + i * GROUP), p);
        d[i] = di;
        sums[i] = _mm_cvtsi128_si32(s4);
        s[i] = di * (float)sums[i];
    }
}

/* acc plus four adjacent byte products summed into each int32 lane,
 * unsigned u by signed s: AVX2 needs three instructions (vpmaddubsw's int16 pairs cannot
 * overflow here: |u| <= 128, |s| <= 127), AVX512-VNNI one (vpdpbusd). The
 * sums are exact integers either way, so both give the same bits. */
static inline __m256i dot4_avx2(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                   _mm256_set1_epi16(1)));
}

/* compilers that know AVX512-VNNI's 256-bit form (gcc 8, clang 6 on) build
 * both paths; older ones build AVX2's alone */
#if (defined(__clang__) && __clang_major__ >= 6) || (!defined(__clang__) && __GNUC__ >= 8)
#define HAVE_VNNI 1
#define VNNI __attribute__((target("avx512vnni,avx512vl,avx512bw,avx512f")))
static inline VNNI __m256i dot4_vnni(__m256i acc, __m256i u, __m256i s) {
    return _mm256_dpbusd_epi32(acc, u, s);
}
#endif

/* One group of 8 outputs for rows [r0, r0 + rows). A block's weights are 8
 * vectors, vector j's int32 lane c holding column c's weights 4j..4j+3, so
 * multiplying vector j by the row's bytes 4j..4j+3 (broadcast to every lane)
 * adds to each lane its own column's products: the 8 vectors give the 8
 * columns' block sums with no horizontal adds. 4 bits: vectors j and j + 4
 * share 32 bytes, j's weights in the low nibbles (the GGUF block's byte
 * pairing), unsigned, and zero applies; 8 bits: signed bytes, and
 * vpmaddubsw/vpdpbusd multiply unsigned by signed, so a signed weight lends
 * its sign to the activation. Defined once per dot product. */
#define GROUP_ROWS(NAME, DOT, ATTR, TILE, BIASED)                                           \
static inline __attribute__((always_inline)) ATTR void NAME(                                \
        int bits, const int8_t *xq, const float *xd, const float *xs, const int32_t *xn,    \
        int64_t r0, int rows, int64_t nb, const uint8_t *wg, const float *sg,               \
        const float *zg, int64_t n, float *y) {                                             \
    const __m256i low = _mm256_set1_epi8(0x0F);                                             \
    __m256 acc[TILE];                                                                       \
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();                            \
    for (int64_t b = 0; b < nb; b++) {                                                      \
        __m256i wq[8];                                                                      \
        if (bits == 4)                                                                      \
            for (int j = 0; j < 4; j++) {                                                   \
                const __m256i raw = _mm256_loadu_si256(                                     \
                    (const __m256i *)(wg + (b * 4 + j) * 32));                              \
                wq[j] = _mm256_and_si256(raw, low);                                         \
                wq[j + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);               \
            }                                                                               \
        else                                                                                \
            for (int j = 0; j < 8; j++) {                                                   \
                wq[j] = _mm256_loadu_si256((const __m256i *)(wg + (b * 8 + j) * 32));       \
                if (BIASED) wq[j] = _mm256_xor_si256(wq[j], _mm256_set1_epi8((char)0x80));  \
            }                                                                               \
        const __m256 sc = _mm256_loadu_ps(sg + b * COLS);                                   \
        for (int r = 0; r < rows; r++) {                                                    \
            const int64_t xi = (r0 + r) * nb + b;                                           \
            const int8_t *xb = xq + xi * GROUP;                                             \
            __m256i sum = _mm256_setzero_si256();                                           \
            for (int j = 0; j < 8; j++) {                                                   \
                int32_t four;                                                               \
                memcpy(&four, xb + 4 * j, 4);                                               \
                const __m256i xv = _mm256_set1_epi32(four);                                 \
                sum = bits == 4 || BIASED ? DOT(sum, wq[j], xv)                             \
                    : DOT(sum, _mm256_sign_epi8(wq[j], wq[j]), _mm256_sign_epi8(xv, wq[j]));   \
            }                                                                               \
            if (bits == 8 && BIASED)            /* sum((w + 128) q) - 128 sum(q) */          \
                sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(128 * xn[xi]));               \
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum),                               \
                                     _mm256_mul_ps(sc, _mm256_set1_ps(xd[xi])), acc[r]);    \
        }                                                                                   \
    }                                                                                       \
    for (int r = 0; r < rows; r++) {                                                        \
        __m256 out = acc[r];                                                                \
        if (bits == 4) {                                                                    \
            __m256 z = _mm256_setzero_ps();                                                 \
            for (int64_t b = 0; b < nb; b++)                                                \
                z = _mm256_fmadd_ps(_mm256_loadu_ps(zg + b * COLS),                         \
                                    _mm256_set1_ps(xs[(r0 + r) * nb + b]), z);              \
            out = _mm256_add_ps(out, z);                                                    \
        }                                                                                   \
        _mm256_storeu_ps(y + (r0 + r) * n, out);                                            \
    }                                                                                       \
}

/* All of a group's rows, each width's loop compiled on its own */
#define ALL_ROWS(NAME, ROWS, ATTR, TILE)                                                    \
static ATTR void NAME(int bits, const int8_t *xq, const float *xd, const float *xs,         \
                      const int32_t *xn, int64_t m, int64_t nb, const uint8_t *wg,          \
                      const float *sg, const float *zg, int64_t n, float *y) {              \
    for (int64_t r0 = 0; r0 < m; r0 += TILE) {                                              \
        const int rows = m - r0 < TILE ? (int)(m - r0) : TILE;                              \
        if (bits == 4) ROWS(4, xq, xd, xs, xn, r0, rows, nb, wg, sg, zg, n, y);             \
        else ROWS(8, xq, xd, xs, xn, r0, rows, nb, wg, sg, NULL, n, y);                     \
    }                                                                                       \
}

/* TILE: rows of x that share one pass over a group's weights; AVX2's 16
 * vector registers hold 4 rows' sums beside the weights, AVX-512's 32 hold 8 */
GROUP_ROWS(group_rows_avx2, dot4_avx2, , 4, 0)
ALL_ROWS(group_avx2, group_rows_avx2, , 4)
#ifdef HAVE_VNNI
GROUP_ROWS(group_rows_vnni, dot4_vnni, VNNI, 8, 1)
ALL_ROWS(group_vnni, group_rows_vnni, VNNI, 8)
#endif

/* 1 where this build and CPU have AVX512-VNNI (with VL for 256-bit
 * vectors), unless PDSERVE_NO_VNNI is set (to compare the two paths) */
int pd_has_vnni(void) {
#ifdef HAVE_VNNI
    static int known = -1;                 /* threads may race to the same answer */
    int have = __atomic_load_n(&known, __ATOMIC_RELAXED);
    if (have < 0) {
        have = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512bw") && !getenv("PDSERVE_NO_VNNI");
        __atomic_store_n(&known, have, __ATOMIC_RELAXED);
    }
    return have;
#else
    return 0;
#endif
}

struct product {
    int bits, vnni;
    const int8_t *xq;
    const float *xd, *xs;
    const int32_t *xn;
    int64_t m, nb, n, wbytes;
    const uint8_t *w;
    const float *scale, *zero;
    float *y;
};

/* one group of COLS output columns, every row */
static void product_group(void *ctx, int64_t g, int worker) {
    (void)worker;
    const struct product *p = ctx;
    const uint8_t *wg = p->w + g * p->nb * COLS * p->wbytes;
    const float *sg = p->scale + g * p->nb * COLS;
    const float *zg = p->bits == 4 ? p->zero + g * p->nb * COLS : NULL;
#ifdef HAVE_VNNI
    if (p->vnni) {
        group_vnni(p->bits, p->xq, p->xd, p->xs, p->xn, p->m, p->nb, wg, sg, zg, p->n,
                   p->y + g * COLS);
        return;
    }
#endif
    group_avx2(p->bits, p->xq, p->xd, p->xs, p->xn, p->m, p->nb, wg, sg, zg, p->n,
               p->y + g * COLS);
}

/* m rows of k activations as quantize_rows leaves them */
struct activations {
    int8_t *q;
    float *d, *s;
    int32_t *sums;
};

static void release(struct activations *a) {
    free(a->q); free(a->d); free(a->s); free(a->sums);
}

/* x's rows quantized into a; -1 (a released) when scratch is short */
static int quantize(const float *x, int64_t m, int64_t k, struct activations *a) {
    const int64_t blocks = m * (k / GROUP);
    a->q = malloc((size_t)(m * k));
    a->d = malloc(sizeof(float) * (size_t)blocks);
    a->s = malloc(sizeof(float) * (size_t)blocks);
    a->sums = malloc(sizeof(int32_t) * (size_t)blocks);
    if (!a->q || !a->d || !a->s || !a->sums) {
        release(a);
        return -1;
    }
    quantize_rows(x, blocks, a->q, a->d, a->s, a->sums);
    return 0;
}

/* y [m, n] = a . w^T, groups shared with up to `threads` workers */
static void multiply(int bits, const struct activations *a, int64_t m, int64_t k,
                     const uint8_t *w, const float *scale, const float *zero, int64_t n,
                     float *y, int threads) {
    struct product p = {bits, pd_has_vnni(), a->q, a->d, a->s, a->sums, m, k / GROUP, n,
                        bits == 4 ? 16 : GROUP, w, scale, zero, y};
    /* chunks of about 128 rows' worth of groups, so that a claim (a cache
     * line the workers pass between them) is paid for, but at least 16 of
     * them, so that the workers end together */
    const int64_t groups = n / COLS;
    int64_t chunk = m >= 128 ? 1 : 128 / m;
    if (chunk > groups / 16) chunk = groups / 16 > 0 ? groups / 16 : 1;
    pd_run(product_group, &p, groups, chunk, threads);
}

/* y [m, n] = x [m, k] . w^T; n a multiple of 8, k of 32; groups shared
 * with up to `threads` workers (cpu/pool.c's pd_run: 0 is every worker).
 * Returns 0, or -1 when the activations' scratch could not be allocated. */
int pd_linear(int bits, const float *x, int64_t m, int64_t k, const uint8_t *w,
              const float *scale, const float *zero, int64_t n, float *y, int threads) {
    struct activations a;
    if (quantize(x, m, k, &a)) return -1;
    multiply(bits, &a, m, k, w, scale, zero, n, y, threads);
    release(&a);
    return 0;
}

/* pd_linear with about 15 bits of activation precision where 8 fall
 * short (a prompt's rows, whose K/V every later token reads): x's 8-bit
 * blocks times w, plus their rounding error's own 8-bit blocks times w.
 * Twice the integer work; the weights stay the file's. */
int pd_linear_precise(int bits, const float *x, int64_t m, int64_t k, const uint8_t *w,
                      const float *scale, const float *zero, int64_t n, float *y,
                      int threads) {
    struct activations a, e;
    float *r = malloc(sizeof(float) * (size_t)(m * k));
    float *y2 = malloc(sizeof(float) * (size_t)(m * n));
    int rc = -1;
    if (r && y2 && !quantize(x, m, k, &a)) {
        for (int64_t i = 0; i < m * k; i++) r[i] = x[i] - (float)a.q[i] * a.d[i / GROUP];
        if (!quantize(r, m, k, &e)) {
            multiply(bits, &a, m, k, w, scale, zero, n, y, threads);
            multiply(bits, &e, m, k, w, scale, zero, n, y2, threads);
            for (int64_t i = 0; i < m * n; i++) y[i] += y2[i];
            release(&e);
            rc = 0;
        }
        release(&a);
    }
    free(r); free(y2);
    return rc;
}
