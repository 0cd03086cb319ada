/* pdserve's CPU attention for decode rows (AVX2 and FMA): one query row
 * per sequence against its keys where they lie in the paged cache, with
 * no gather into a contiguous copy.
 *
 * For sequence b and query head h (KV head h / group): the scores
 * scale * q . k over positions begin[b] <= p < end[b] (optionally
 * softcap * tanh(s / softcap)), their softmax in float32, and the
 * probability-weighted sum of the values. Position p lies in page
 * table[b][(p - base[b]) / page_size] at slot (p - base[b]) % page_size.
 *
 * Pages are [page_size][kv_heads][head_dim] of float32 or bfloat16, page
 * after page `page_stride` elements apart (a layer's view of the cache's
 * page-major storage). Each (sequence, KV head) is computed by one thread
 * in one order, so a row's output does not depend on the rows beside it
 * or the thread count.
 *
 * A decode round reads every key and value once from memory, in pages
 * scattered over the cache, so the loops are arranged for that: the keys
 * are read (and bfloat16 ones widened) once for the group's query heads,
 * with the keys a few positions on and the values prefetched; the scores
 * are taken eight positions at a time, eight independent sums reduced
 * together, where one sum a position waited on its own chain of
 * multiply-adds. Built and loaded by native.py. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "pdserve_cpu.h"

/* e^x for x <= 0 (Cephes' single precision polynomial, ~1 ulp); shared
 * with cpu/layer.c as pd_exp_ps */
static inline __m256 exp_ps(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                         _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

__m256 pd_exp_ps(__m256 x) { return exp_ps(x); }

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* lane t: the sum of a[t]'s eight lanes */
static inline __m256 hsum8(const __m256 a[8]) {
    const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20),
                         _mm256_permute2f128_ps(s0, s1, 0x31));
}

/* eight values of a key or value row as float32 */
static inline __m256 load8(const void *row, int64_t i, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)row + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

struct attention {
    const float *q;
    const void *k_pages, *v_pages;
    int bf16;
    int64_t page_stride, page_size, kv_heads, head_dim, heads, table_width, longest;
    const int64_t *tables, *base, *begin, *end;
    float scale, softcap;
    float *out;
    float *scores;              /* per worker: [group][longest] */
    int64_t *offs;              /* per worker: [longest], each position's byte offset */
    float *keys;                /* per worker: [longest][head_dim], bfloat16 keys widened */
    const float **krows;        /* per worker: [longest], each position's float32 key */
};

/* one (sequence, KV head): its query heads' outputs */
static void attend(void *ctx, int64_t w, int worker) {
    const struct attention *A = ctx;
    const int64_t kv_heads = A->kv_heads, d = A->head_dim, heads = A->heads;
    const int64_t group = heads / kv_heads, page_size = A->page_size;
    const int64_t elem = A->bf16 ? 2 : 4;
    const int bf16 = A->bf16;
    const float scale = A->scale, softcap = A->softcap;
    float *scores = A->scores + worker * group * A->longest;
    int64_t *offs = A->offs + worker * A->longest;
    const float **krows = A->krows + worker * A->longest;
    const int64_t b = w / kv_heads, g = w % kv_heads;
    const int64_t n = A->end[b] - A->begin[b];
    const float *qg = A->q + (b * heads + g * group) * d;
    float *og = A->out + (b * heads + g * group) * d;
    const int64_t *table = A->tables + b * A->table_width;
    const void *k_pages = A->k_pages, *v_pages = A->v_pages;
    for (int64_t p = 0; p < n; p++) {
        const int64_t at = A->begin[b] + p - A->base[b];
        offs[p] = (table[at / page_size] * A->page_stride +
                   (at % page_size) * kv_heads * d + g * d) * elem;
    }
    /* float32 keys read in place; bfloat16 ones widened once for every query
     * head. The pages are scattered: the keys a few positions ahead, and
     * each position's values (read after the softmax), are fetched early. */
    float *kf = A->keys + worker * A->longest * d;
    const int64_t row_bytes = d * elem;
    for (int64_t p = 0; p < n; p++) {
        const char *k = (const char *)k_pages + offs[p];
        const char *ahead = (const char *)k_pages + offs[p + 16 < n ? p + 16 : p];
        const char *v = (const char *)v_pages + offs[p];
        for (int64_t c = 0; c < row_bytes; c += 64) {
            _mm_prefetch(ahead + c, _MM_HINT_T0);
            _mm_prefetch(v + c, _MM_HINT_T1);
        }
        if (!bf16) {
            krows[p] = (const float *)k;
            continue;
        }
        for (int64_t i = 0; i < d; i += 8) _mm256_storeu_ps(kf + p * d + i, load8(k, i, 1));
        krows[p] = kf + p * d;
    }
    /* scores eight positions at a time: eight independent sums, reduced together */
    const int64_t n8 = n - n % 8;
    for (int64_t j = 0; j < group; j++) {
        const float *qj = qg + j * d;
        float *sj = scores + j * n;
        for (int64_t p = 0; p < n8; p += 8) {
            __m256 acc[8];
            for (int t = 0; t < 8; t++) acc[t] = _mm256_setzero_ps();
            for (int64_t i = 0; i < d; i += 8) {
                const __m256 qv = _mm256_loadu_ps(qj + i);
                for (int t = 0; t < 8; t++)
                    acc[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(krows[p + t] + i), acc[t]);
            }
            _mm256_storeu_ps(sj + p, _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale)));
        }
        for (int64_t p = n8; p < n; p++) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t i = 0; i < d; i += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(qj + i), _mm256_loadu_ps(krows[p] + i), acc);
            sj[p] = hsum(acc) * scale;
        }
        if (softcap > 0.0f)
            for (int64_t p = 0; p < n; p++) sj[p] = softcap * tanhf(sj[p] / softcap);
    }
    for (int64_t j = 0; j < group; j++) {
        float *sj = scores + j * n, top = -INFINITY, total = 0.0f;
        for (int64_t p = 0; p < n; p++) top = sj[p] > top ? sj[p] : top;
        int64_t p = 0;
        __m256 sum = _mm256_setzero_ps();
        for (; p + 8 <= n; p += 8) {
            const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(sj + p),
                                                  _mm256_set1_ps(top)));
            _mm256_storeu_ps(sj + p, e);
            sum = _mm256_add_ps(sum, e);
        }
        total = hsum(sum);
        for (; p < n; p++) {
            float tail[8] = {sj[p] - top};
            const float e = _mm256_cvtss_f32(exp_ps(_mm256_loadu_ps(tail)));
            sj[p] = e;
            total += e;
        }
        const float inv = 1.0f / total;
        for (p = 0; p < n; p++) sj[p] *= inv;
    }
    /* the values' weighted sum, 16 outputs of up to 4 query heads at a
     * time held in registers over every position */
    for (int64_t j0 = 0; j0 < group; j0 += 4) {
        const int64_t jn = group - j0 < 4 ? group - j0 : 4;
        for (int64_t i = 0; i < d; i += 16) {
            const int two = i + 8 < d;
            __m256 a0[4], a1[4];
            for (int64_t j = 0; j < jn; j++) a0[j] = a1[j] = _mm256_setzero_ps();
            for (int64_t p = 0; p < n; p++) {
                const char *v = (const char *)v_pages + offs[p];
                const __m256 v0 = load8(v, i, bf16);
                const __m256 v1 = two ? load8(v, i + 8, bf16) : v0;
                for (int64_t j = 0; j < jn; j++) {
                    const __m256 sp = _mm256_set1_ps(scores[(j0 + j) * n + p]);
                    a0[j] = _mm256_fmadd_ps(sp, v0, a0[j]);
                    a1[j] = _mm256_fmadd_ps(sp, v1, a1[j]);
                }
            }
            for (int64_t j = 0; j < jn; j++) {
                _mm256_storeu_ps(og + (j0 + j) * d + i, a0[j]);
                if (two) _mm256_storeu_ps(og + (j0 + j) * d + i + 8, a1[j]);
            }
        }
    }
}

/* q, out: [batch][heads][head_dim] float32, head_dim a multiple of 8 (the
 * caller checks); (sequence, KV head) pairs shared with up to `threads`
 * workers (cpu/pool.c's pd_run: 0 is every worker). Returns 0, or -1 when scratch could not be
 * allocated. */
int pd_decode_attention(const float *q, const void *k_pages, const void *v_pages, int bf16,
                        int64_t page_stride, int64_t page_size, int64_t kv_heads,
                        int64_t head_dim, int64_t heads, const int64_t *tables,
                        int64_t table_width, const int64_t *base, const int64_t *begin,
                        const int64_t *end, int64_t batch, float scale, float softcap,
                        float *out, int threads) {
    int64_t longest = 1;
    for (int64_t b = 0; b < batch; b++)
        if (end[b] - begin[b] > longest) longest = end[b] - begin[b];
    const int64_t all = pd_pool_workers();       /* scratch for every worker that may take part */
    const int64_t workers = threads <= 0 || threads > all ? all : threads;
    struct attention A = {q, k_pages, v_pages, bf16, page_stride, page_size, kv_heads,
                          head_dim, heads, table_width, longest, tables, base, begin, end,
                          scale, softcap, out, NULL, NULL, NULL, NULL};
    A.scores = malloc(sizeof(float) * (size_t)(workers * (heads / kv_heads) * longest));
    A.offs = malloc(sizeof(int64_t) * (size_t)(workers * longest));
    A.keys = bf16 ? malloc(sizeof(float) * (size_t)(workers * longest * head_dim)) : NULL;
    A.krows = malloc(sizeof(float *) * (size_t)(workers * longest));
    int rc = -1;
    if (A.scores && A.offs && A.krows && (A.keys || !bf16)) {
        pd_run(attend, &A, batch * kv_heads, 1, threads <= 0 ? 0 : (int)workers);
        rc = 0;
    }
    free(A.scores);
    free(A.offs);
    free(A.keys);
    free(A.krows);
    return rc;
}
