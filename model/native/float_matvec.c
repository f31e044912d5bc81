/* y (N) = W (N, K) x (K), float32, W row-major: the product of a decode step's one row with a
   float32 weight (model/parts/linear.py), streamed row by row at the memory's speed.

   BLAS answers one column with a matrix-vector routine, or two with a small sgemm, that on this
   2-core machine reads the weights at about half the rate the memory gives (bench/README.md).
   Here each thread takes a run of rows; a row's dot product keeps four 8-wide sums in flight,
   added in a fixed order: the result is F.linear's up to the order of the sums. */

#include <stdint.h>
#if defined(__AVX2__) || defined(__SSE__)
#include <immintrin.h>
#endif

static float row_dot(const float *w, const float *x, int64_t K) {
    int64_t k = 0;
    float tail = 0.0f;
#ifdef __AVX2__
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (; k + 32 <= K; k += 32) {
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
    tail = _mm_cvtss_f32(s);
#endif
    for (; k < K; k++) tail += w[k] * x[k];
    return tail;
}

/* Ask for row n + AHEAD's cache lines while row n is summed: the hardware's stream prefetcher alone kept
   fewer reads in flight than the memory can serve. On a 2-core Xeon, SmolLM2's 121 matrices of a
   decode token (538 MB, cycled so none stays in cache), 2 threads: 22.2-23.3 GB/s without it,
   25.1-25.6 with it, where a plain read of the same bytes runs at 25.2 (bench/README.md). */
#define AHEAD 4

static inline void prefetch_row(const float *w, int64_t n, int64_t N, int64_t K) {
#ifdef __SSE__
    if (n + AHEAD >= N) return;
    const char *p = (const char *)(w + (n + AHEAD) * K);
    for (int64_t b = 0; b < K * (int64_t)sizeof(float); b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
#else
    (void)w; (void)n; (void)N; (void)K;
#endif
}

void float_matvec(const float *x, int64_t K, const float *w, int64_t N, const float *bias, float *y) {
#pragma omp parallel for schedule(static) if (N * K > 65536)
    for (int64_t n = 0; n < N; n++) {
        prefetch_row(w, n, N, K);
        y[n] = row_dot(w + n * K, x, K) + (bias ? bias[n] : 0.0f);
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
        prefetch_row(w, n, N, K);
        const float b = bias ? bias[n] : 0.0f;
        for (int64_t m = 0; m < M; m++) y[m * N + n] = row_dot(w + n * K, x + m * K, K) + b;
    }
}
