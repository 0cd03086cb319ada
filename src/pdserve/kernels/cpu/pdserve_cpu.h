/* What pdserve's CPU kernels export to each other (and, through native.py's
 * ctypes signatures, to Python): one declaration each, so a changed
 * signature fails to compile instead of calling with the wrong arguments.
 * Each .c file says what it owns; native.py builds them into one library. */

#ifndef PDSERVE_CPU_H
#define PDSERVE_CPU_H

#include <immintrin.h>
#include <stdint.h>

/* pool.c: a job's items shared among the caller and helper threads */
typedef void (*pd_task)(void *ctx, int64_t item, int worker);
void pd_run(pd_task fn, void *ctx, int64_t n, int64_t chunk, int threads);
int pd_pool_share(int n);
int pd_pool_workers(void);
long long pd_pool_helped(void);

/* matmul.c: a GGUF's 4- and 8-bit blocks times rows cut into 8-bit blocks */
int pd_has_vnni(void);
int pd_linear(int bits, const float *x, int64_t m, int64_t k, const uint8_t *w,
              const float *scale, const float *zero, int64_t n, float *y, int threads);
int pd_linear_precise(int bits, const float *x, int64_t m, int64_t k, const uint8_t *w,
                      const float *scale, const float *zero, int64_t n, float *y,
                      int threads);

/* bf16.c: rows times a packed bfloat16 weight in one AVX512-BF16 pass */
int pd_has_bf16(void);
int pd_linear_bf16(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                   float *y, int threads);

/* dense.c: rows times a dense float32 or bfloat16 weight in a fixed order */
int pd_linear_dense(const float *x, int64_t m, int64_t k, const void *w, int bf16, int64_t n,
                    float *y, int threads);

/* attention.c: rows' attention read in place from the paged cache */
__m256 pd_exp_ps(__m256 x);
int pd_decode_attention(const float *q, const void *k_pages, const void *v_pages, int bf16,
                        int64_t page_stride, int64_t page_size, int64_t kv_heads,
                        int64_t head_dim, int64_t heads, const int64_t *tables,
                        int64_t table_width, const int64_t *base, const int64_t *begin,
                        const int64_t *end, int64_t batch, float scale, float softcap,
                        float *out, int threads);

#endif
