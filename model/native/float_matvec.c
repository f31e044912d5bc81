/* y (N) = W (N, K) x (K), float32, W row-major: the product of a decode step's one row with a
   float32 weight (model/parts/linear.py), streamed row by row at the memory's speed.

   BLAS answers one column with a matrix-vector routine, or two with a small sgemm, that on this
   2-core machine reads the weights at about half the rate the memory gives (bench/README.md).
   Here each thread takes a run of rows; a row's dot product keeps two 16-wide sums in flight
   (AVX-512; four 8-wide ones with AVX2), added in a fixed order: the result is F.linear's up to the
   order of the sums, and the same bits with any number of threads.

   Reading ahead: every 128 bytes summed ask for the 128 bytes AHEAD_BYTES further on. The
   hardware's stream prefetcher alone keeps fewer reads in flight than the memory can serve, and
   stops at each 4 KB. Past the end of a thread's rows this reaches into the next rows, or the next
   matrix where the weights lie in one arena in the order a step reads them (model/weight_arena.py).
   SmolLM2's 121 matrices of a decode token (538 MB, cycled so none stays in cache), 2 threads, on
   a 2-core Xeon: 22.9 GB/s as torch allocated them with whole rows fetched 4 rows ahead (what ran
   before); 29.6-30.7 from the arena on 2 MB pages with this (bench/README.md, issue 34). */

#include <stdint.h>
#include "attnlens_kernels.h"
#if defined(__AVX2__) || defined(__SSE__)
#include <immintrin.h>
#endif

#define AHEAD_BYTES 4096

static inline void ask_ahead(const float *w) {
    __builtin_prefetch((const char *)w + AHEAD_BYTES, 0, 3);  /* prefetcht0 on x86 */
    __builtin_prefetch((const char *)w + AHEAD_BYTES + 64, 0, 3);
}

/* w . x over K; `prefetch`: ask for the bytes ahead (the first pass over a weight row) */
static inline float row_dot(const float *w, const float *x, int64_t K, int prefetch) {
    int64_t k = 0;
    float sum = 0.0f;
#ifdef __AVX512F__
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    for (; k + 32 <= K; k += 32) {
        if (prefetch) ask_ahead(w + k);
        b0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k), b0);
        b1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 16), _mm512_loadu_ps(x + k + 16), b1);
    }
    sum = _mm512_reduce_add_ps(_mm512_add_ps(b0, b1));
#endif
#ifdef __AVX2__
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (; k + 32 <= K; k += 32) {  /* without AVX-512 */
        if (prefetch) ask_ahead(w + k);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
    }
    for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
    const __m256 a = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    sum += _mm_cvtss_f32(s);
#endif
    (void)prefetch;
    for (; k < K; k++) sum += w[k] * x[k];
    return sum;
}

void float_matvec(const float *x, int64_t K, const float *w, int64_t N, const float *bias, float *y) {
#pragma omp parallel for schedule(static) if (N * K > 65536)
    for (int64_t n = 0; n < N; n++) {
        y[n] = row_dot(w + n * K, x, K, 1) + (bias ? bias[n] : 0.0f);
    }
}

/* y (M, N) = x (M, K) W^T (+ bias) for a few rows (a batched decode step's): each weight row is read
   from memory once and meets every row of x while it is in cache. Per (m, n), the sum is row_dot's,
   in the same order: the one-row answer for every row. */
void float_matmul_few(const float *x, int64_t M, int64_t K, const float *w, int64_t N, const float *bias, float *y) {
    if (M == 1) {
        float_matvec(x, K, w, N, bias, y);
        return;
    }
#pragma omp parallel for schedule(static) if (N * K * M > 65536)
    for (int64_t n = 0; n < N; n++) {
        const float b = bias ? bias[n] : 0.0f;
        for (int64_t m = 0; m < M; m++) y[m * N + n] = row_dot(w + n * K, x + m * K, K, m == 0) + b;
    }
}
