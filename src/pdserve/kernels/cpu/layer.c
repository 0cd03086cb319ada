/* One Llama-family decoder layer for a round's rows, in one call:
 * what DecoderModel's forward runs eagerly as about 60 torch calls a layer,
 * whose dispatch costs more than a small model's arithmetic at one row.
 *
 *   x = rms_norm(h) * ln1;  q, k, v = x . Wqkv (+ bias);  rotate q and k;
 *   write k, v into the paged cache at each row's slot;  o = attention;
 *   h += o . Wo;  x = rms_norm(h) * ln2;  g, u = x . Wgate_up;
 *   h += (silu(g) * u) . Wdown
 *
 * Every row (a decode's, a verify's, a prefill chunk's) is a query at its
 * position over its sequence's keys up to its own: every row's K/V is
 * written before any row attends, so a chunk's rows see each other. h
 * stays float32 between layers (the caller rounds it to the model's dtype
 * after the last); K/V are stored in the cache's dtype. The matmuls are
 * cpu/matmul.c's (a prompt's rows: cpu/bf16.c's, where the weights have a
 * bfloat16 copy) and the attention cpu/attention.c's; every step computes a
 * row on its own in one order, so a row's result does not depend on the
 * rows beside it or the thread count. Built and loaded by native.py, driven
 * by cpu/layer.py. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pdserve_cpu.h"

/* A packed quantized weight (cpu/matmul.py's NativeMatmul): `rows` output
 * rows (n padded to a multiple of 8) of k inputs; `dense`, its bfloat16
 * copy for a prompt's rows (cpu/bf16.c), or NULL where they take two
 * 8-bit passes */
struct pd_matmul {
    int64_t bits, n, rows, k;
    const uint8_t *w;
    const float *scale, *zero;
    const uint16_t *dense;
};

struct pd_layer {
    struct pd_matmul qkv, o, gate_up, down;
    const float *ln1, *ln2;     /* [hidden] */
    const float *qkv_bias;      /* [q + 2 kv] or NULL */
};

/* What every layer shares: the shapes and the rotary tables, [positions][head_dim]
 * float32, the sin table's first half negated (rope.py's Rotary) */
struct pd_model {
    int64_t hidden, heads, kv_heads, head_dim, inter;
    float eps, scale;
    const float *cos, *sin;
};

/* A round's rows: each one's position and cache slot (-1: not written),
 * and its keys as cpu/attention.c reads them */
struct pd_round {
    int64_t batch;
    int64_t precise;            /* the leading rows (a prompt's) multiplied precisely */
    const int64_t *positions, *slots;
    const int64_t *tables, *base, *begin, *end;
    int64_t table_width, page_size, page_stride;
    int bf16;                   /* the cache's dtype: bfloat16, else float32 */
};

/* silu(g) * u over n values (n a multiple of 8): with e = exp(-|g|), silu
 * is g / (1 + e) for g >= 0 and g e / (1 + e) below */
static void silu_mul(const float *g, const float *u, int64_t n, float *out) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = pd_exp_ps(_mm256_or_ps(gv, sign));            /* e^-|g| */
        const __m256 num = _mm256_blendv_ps(gv, _mm256_mul_ps(gv, e), gv);   /* g < 0: g e */
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(num, _mm256_add_ps(one, e)),
                                                _mm256_loadu_ps(u + i)));
    }
}

/* n a multiple of 8: the squares summed in eight lanes, then across */
static void rms_norm_rows(const float *h, const float *w, int64_t rows, int64_t n, float eps,
                          float *x) {
    for (int64_t r = 0; r < rows; r++) {
        const float *hr = h + r * n;
        __m256 lanes = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i += 8) {
            const __m256 v = _mm256_loadu_ps(hr + i);
            lanes = _mm256_fmadd_ps(v, v, lanes);
        }
        float part[8], sum = 0.0f;
        _mm256_storeu_ps(part, lanes);
        for (int i = 0; i < 8; i++) sum += part[i];
        const float inv = 1.0f / sqrtf(sum / (float)n + eps);
        for (int64_t i = 0; i < n; i++) x[r * n + i] = hr[i] * inv * w[i];
    }
}

/* round to nearest even, as torch converts float32 to bfloat16 */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);   /* NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static void store_row(void *pages, int64_t at, const float *src, int64_t n, int bf16) {
    if (bf16) {
        uint16_t *dst = (uint16_t *)pages + at;
        for (int64_t i = 0; i < n; i++) dst[i] = to_bf16(src[i]);
    } else {
        memcpy((float *)pages + at, src, sizeof(float) * (size_t)n);
    }
}

/* x . w for rows, into y [rows][w.rows] */
static int mm(const struct pd_matmul *w, const float *x, int64_t rows, int64_t precise,
              float *y, int threads) {
    const int bits = (int)w->bits;
    if (precise > 0 && (w->dense ? pd_linear_bf16(x, precise, w->k, w->dense, w->rows, y,
                                                  threads)
                                 : pd_linear_precise(bits, x, precise, w->k, w->w, w->scale,
                                                     w->zero, w->rows, y, threads)))
        return -1;
    return rows > precise ? pd_linear(bits, x + precise * w->k, rows - precise, w->k, w->w,
                                      w->scale, w->zero, w->rows, y + precise * w->rows,
                                      threads)
                          : 0;
}

/* h [batch][hidden], updated in place. Returns 0, or -1 when scratch could
 * not be allocated (the round is then lost: the caller raises). */
int pd_layer(const struct pd_model *M, const struct pd_layer *L, const struct pd_round *R,
                    float *h, void *k_pages, void *v_pages, int threads) {
    const int64_t B = R->batch, hid = M->hidden, d = M->head_dim, half = d / 2;
    const int64_t qd = M->heads * d, kvd = M->kv_heads * d, inter = M->inter;
    const int64_t widest = L->gate_up.rows > L->qkv.rows ? L->gate_up.rows : L->qkv.rows;
    float *x = malloc(sizeof(float) * (size_t)(B * (hid > inter ? hid : inter)));
    float *y = malloc(sizeof(float) * (size_t)(B * widest));
    float *q = malloc(sizeof(float) * (size_t)(B * qd));
    float *o = malloc(sizeof(float) * (size_t)(B * qd));
    float *res = malloc(sizeof(float) * (size_t)(B * (L->o.rows > L->down.rows ? L->o.rows
                                                                              : L->down.rows)));
    int rc = -1;
    if (!x || !y || !q || !o || !res) goto done;

    rms_norm_rows(h, L->ln1, B, hid, M->eps, x);
    if (mm(&L->qkv, x, B, R->precise, y, threads)) goto done;
    for (int64_t b = 0; b < B; b++) {
        float *row = y + b * L->qkv.rows;
        if (L->qkv_bias)
            for (int64_t i = 0; i < qd + 2 * kvd; i++) row[i] += L->qkv_bias[i];
        const float *c = M->cos + R->positions[b] * d, *s = M->sin + R->positions[b] * d;
        /* q's and k's heads rotate alike: x * cos + roll(x, d / 2) * sin */
        for (int64_t head = 0; head < M->heads + M->kv_heads; head++) {
            float *v = row + head * d, rot[d];
            for (int64_t i = 0; i < half; i++) rot[i] = v[i] * c[i] + v[i + half] * s[i];
            for (int64_t i = half; i < d; i++) rot[i] = v[i] * c[i] + v[i - half] * s[i];
            memcpy(head < M->heads ? q + b * qd + head * d : v, rot, sizeof(float) * (size_t)d);
        }
        const int64_t slot = R->slots[b];
        if (slot >= 0) {
            const int64_t at = (slot / R->page_size) * R->page_stride +
                               (slot % R->page_size) * kvd;
            store_row(k_pages, at, row + qd, kvd, R->bf16);
            store_row(v_pages, at, row + qd + kvd, kvd, R->bf16);
        }
    }
    if (pd_decode_attention(q, k_pages, v_pages, R->bf16, R->page_stride, R->page_size,
                            M->kv_heads, d, M->heads, R->tables, R->table_width, R->base,
                            R->begin, R->end, B, M->scale, 0.0f, o, threads))
        goto done;
    if (mm(&L->o, o, B, R->precise, res, threads)) goto done;
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < hid; i++) h[b * hid + i] += res[b * L->o.rows + i];

    rms_norm_rows(h, L->ln2, B, hid, M->eps, x);
    if (mm(&L->gate_up, x, B, R->precise, y, threads)) goto done;
    for (int64_t b = 0; b < B; b++)
        silu_mul(y + b * L->gate_up.rows, y + b * L->gate_up.rows + inter, inter, x + b * inter);
    if (mm(&L->down, x, B, R->precise, res, threads)) goto done;
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < hid; i++) h[b * hid + i] += res[b * L->down.rows + i];
    rc = 0;
done:
    free(x); free(y); free(q); free(o); free(res);
    return rc;
}
