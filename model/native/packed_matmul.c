/* Products with weights kept in ggml's block formats, as a GGUF file ships them.
   A weight matrix (N rows, K columns) is N rows of K/32 blocks, each block 32 consecutive
   columns of one row, laid out byte for byte as in the file:
       Q4_0  18 bytes: d (float16), 16 bytes of 4-bit q      w = d * (q - 8)
       Q4_1  20 bytes: d, m (float16), 16 bytes of 4-bit q   w = d * q + m
       Q8_0  34 bytes: d (float16), 32 signed bytes q        w = d * q
   In a 4-bit block, byte j holds column j in its low nibble and column j + 16 in its high one.
   The activations stay float32 (llama.cpp rounds them to 8 bits first). Each block is widened to
   its 32 float32 weights exactly as gguf's dequantizer computes them (a multiply, then an add or
   subtract: no FMA), then summed with x exactly as float_dots.h's row_dot sums a float32 row: a
   packed product is the float32 product of the dequantized matrix bit for bit, and a row of x
   gets the same bits alone or beside any others.
   packed_matmul      y (M, N) = x (M, K) W^T, rows of W split over OpenMP threads: one row of x
                      meets each block as it is widened; more rows meet NR weight rows widened
                      once into a buffer, in float_dots.h's tiles
   packed_dequantize  chosen rows of W as float32 (embedding lookups, prefill tiles, .weight)
   Built once per machine by model/native/library.py (cc -O3 -march=native -fopenmp); without
   AVX2 the plain C loops below are compiled instead. */

#include <stdint.h>
#include <stdlib.h>
#include "attnlens_kernels.h"
#include "packed_dots.h"

#ifndef __AVX512F__
/* more than one row of x without AVX-512: each thread widens runs of NR weight rows into a buffer */
static int buffered(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int fmt, float *y) {
    const int64_t groups = (N + NR - 1) / NR;
    int failed = 0;
#pragma omp parallel if (N * K * M > 32768)
    {
        float *buf = malloc(sizeof(float) * (size_t)(NR * K));  /* this thread's widened weight rows */
        if (buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t n0 = g * NR;
            if (buf != NULL) packed_group(x, M, K, w, n0, N - n0 < NR ? (int)(N - n0) : NR, N, fmt, buf, y);
        }
        free(buf);
    }
    return failed ? -1 : 0;
}
#endif

/* y (M, N) = x (M, K) W^T, W: N rows of K/32 blocks of format fmt. Returns 0, or -1 when out of memory. */
int packed_matmul(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int fmt, float *y) {
#ifndef __AVX512F__
    if (M > 1) return buffered(x, M, K, w, N, fmt, y);
#endif
    const int64_t chunks = (N + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static) if (N * (K / 32) * M > 1024)
    for (int64_t c = 0; c < chunks; c++) packed_range(x, M, K, w, N, fmt, y, c * CHUNK, (c + 1) * CHUNK < N ? (c + 1) * CHUNK : N);
    return 0;
}

/* out (R, K) = rows `rows` (R of them; NULL: rows 0 .. R-1) of W as float32, d * q + c / -8d as
   gguf's dequantizer computes them */
void packed_dequantize(const uint8_t *w, int64_t K, int fmt, const int64_t *rows, int64_t R, float *out) {
    const int64_t nb = K / 32, row_bytes = nb * block_bytes(fmt);
#pragma omp parallel for schedule(static) if (R * K > 65536)
    for (int64_t r = 0; r < R; r++) widen_row(w + (rows ? rows[r] : r) * row_bytes, fmt, nb, out + r * K);
}
