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
#include "float_dots.h"

void float_matvec(const float *x, int64_t K, const float *w, int64_t N, const float *bias, float *y) {
#pragma omp parallel for schedule(static) if (N * K > 65536)
    for (int64_t n = 0; n < N; n++) {
        y[n] = row_dot(w + n * K, x, K, 1) + (bias ? bias[n] : 0.0f);
    }
}

/* y (M, N) = x (M, K) W^T (+ bias) for a few rows (a batched decode step's): each weight row is read
   from memory once and meets every row of x while it is in cache. Per (m, n), the sum is row_dot's,
   in the same order: the one-row answer for every row. From TILE_MIN_ROWS rows with AVX-512, in
   tiles (tile_dots: bench/README.md, issue 50); below, where the weights' reading bounds it, row by row. */
void float_matmul_few(const float *x, int64_t M, int64_t K, const float *w, int64_t N, const float *bias, float *y) {
    if (M == 1) {
        float_matvec(x, K, w, N, bias, y);
        return;
    }
    int64_t step = 1;  /* weight rows a thread takes at a time: a tile's NR from TILE_MIN_ROWS rows of x */
#ifdef __AVX512F__
    if (M >= TILE_MIN_ROWS) step = NR;
#endif
    const int64_t groups = (N + step - 1) / step;
#pragma omp parallel for schedule(static) if (N * K * M > 65536)
    for (int64_t g = 0; g < groups; g++) float_range(x, M, K, w, N, bias, y, g * step, g * step + step < N ? g * step + step : N);
}
