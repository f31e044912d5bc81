/* Products with weights kept in ggml's block formats, as a GGUF file ships them.

   A weight matrix (N rows, K columns) is N rows of K/32 blocks, each block 32 consecutive
   columns of one row, laid out byte for byte as in the file:

       Q4_0  18 bytes: d (float16), 16 bytes of 4-bit q      w = d * (q - 8)
       Q4_1  20 bytes: d, m (float16), 16 bytes of 4-bit q   w = d * q + m
       Q8_0  34 bytes: d (float16), 32 signed bytes q        w = d * q

   In a 4-bit block, byte j holds column j in its low nibble and column j + 16 in its high one.

   The activations stay float32 (llama.cpp rounds them to 8 bits first): the products are the
   dequantized matrix's up to the order of the sums. Per block,

       sum_k w_k x_k = d * sum_k q_k x_k + c * sum_k x_k,   c = -8d (Q4_0), m (Q4_1), 0 (Q8_0)

   so the 32 q are widened to float once, meet each row of x in four 8-wide FMAs, and the
   block's column sums of x (computed once per call) carry the offset.

   packed_matmul      y (M, N) = x (M, K) W^T, rows of W split over OpenMP threads
   packed_dequantize  chosen rows of W as float32 (embedding lookups, prefill tiles, .weight)

   Built once per machine by model/native/library.py (cc -O3 -march=native -fopenmp); without
   AVX2 the plain C loops below are compiled instead. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "attnlens_kernels.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };

static int block_bytes(int fmt) { return fmt == Q4_0 ? 18 : fmt == Q4_1 ? 20 : 34; }

static float half_to_float(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {  /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* the block's scale d and column-sum factor c (see above) */
static void block_scales(const uint8_t *blk, int fmt, float *d, float *c) {
    *d = half_to_float(blk);
    *c = fmt == Q4_0 ? -8.0f * *d : fmt == Q4_1 ? half_to_float(blk + 2) : 0.0f;
}

static const uint8_t *block_q(const uint8_t *blk, int fmt) { return blk + (fmt == Q4_1 ? 4 : 2); }

/* the block's 32 q as float, in column order */
static void block_values(const uint8_t *q, int fmt, float *out) {
    if (fmt == Q8_0) {
        for (int j = 0; j < 32; j++) out[j] = (float)(int8_t)q[j];
    } else {
        for (int j = 0; j < 16; j++) {
            out[j] = (float)(q[j] & 0x0f);
            out[j + 16] = (float)(q[j] >> 4);
        }
    }
}

#ifdef __AVX2__
/* the block's 32 q as four 8-float vectors */
static inline void block_vectors(const uint8_t *q, int fmt, __m256 v[4]) {
    if (fmt == Q8_0) {
        for (int i = 0; i < 4; i++)
            v[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * i))));
        return;
    }
    const __m128i raw = _mm_loadu_si128((const __m128i *)q), low = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(raw, low), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
    v[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    v[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    v[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    v[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

static inline float horizontal_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#ifdef __AVX2__
/* A block widened once, to meet one or more rows of x: its 32 q as float vectors, its scale d and
   column-sum factor c. With AVX-512 16 columns a vector (on this project's 2-core Xeon, SmolLM2's
   packed decode step's products ~1.3x faster than 8 a vector: bench/README.md), else 8. */
#ifdef __AVX512F__
typedef __m512 vsum;
typedef struct { __m512 v0, v1; float d, c; } wide_block;

static inline __attribute__((always_inline)) wide_block widen(const uint8_t *blk, int fmt) {
    wide_block w;
    block_scales(blk, fmt, &w.d, &w.c);
    const uint8_t *q = block_q(blk, fmt);
    if (fmt == Q8_0) {
        w.v0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
        w.v1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
    } else {
        const __m128i raw = _mm_loadu_si128((const __m128i *)q), low = _mm_set1_epi8(0x0f);
        w.v0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, low)));
        w.v1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low)));
    }
    return w;
}

/* d * sum q x over the block's 32 columns of one row of x, as a vector of partial sums */
static inline __attribute__((always_inline)) vsum wide_dot(const wide_block *w, const float *xb) {
    const __m512 s = _mm512_fmadd_ps(w->v1, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(w->v0, _mm512_loadu_ps(xb)));
    return _mm512_mul_ps(_mm512_set1_ps(w->d), s);
}
#define VSUM_ZERO _mm512_setzero_ps
#define VSUM_ADD _mm512_add_ps
#define VSUM_TOTAL _mm512_reduce_add_ps
#define TILE 8 /* rows of x that share one widening of a weight block: 16 sums in registers */
#else
typedef __m256 vsum;
typedef struct { __m256 v[4]; float d, c; } wide_block;

static inline __attribute__((always_inline)) wide_block widen(const uint8_t *blk, int fmt) {
    wide_block w;
    block_scales(blk, fmt, &w.d, &w.c);
    block_vectors(block_q(blk, fmt), fmt, w.v);
    return w;
}

/* two independent pairs of products, then their sum */
static inline __attribute__((always_inline)) vsum wide_dot(const wide_block *w, const float *xb) {
    const __m256 s01 = _mm256_fmadd_ps(w->v[1], _mm256_loadu_ps(xb + 8), _mm256_mul_ps(w->v[0], _mm256_loadu_ps(xb)));
    const __m256 s23 = _mm256_fmadd_ps(w->v[3], _mm256_loadu_ps(xb + 24), _mm256_mul_ps(w->v[2], _mm256_loadu_ps(xb + 16)));
    return _mm256_mul_ps(_mm256_set1_ps(w->d), _mm256_add_ps(s01, s23));
}
#define VSUM_ZERO _mm256_setzero_ps
#define VSUM_ADD _mm256_add_ps
#define VSUM_TOTAL horizontal_sum
#define TILE 4
#endif

/* y[n] for rows m0 .. m0+mt-1 of x (mt <= TILE) and one weight row. Each row of x is summed as if it
   came alone: even blocks into one sum and odd ones into another, so no sum waits on the one before
   it, then the two added. A decode step's row gets the same bits in a batch of any size up to the
   kernel's 16 rows as by itself (tests/model/test_packed_weights.py). Each block is widened once per tile
   and met by every row of it. */
static inline __attribute__((always_inline)) void tile_rows(const uint8_t *row, int fmt, int64_t nb, const float *x,
                                                            const float *xsum, int64_t K, int64_t m0, int mt,
                                                            float *out /* mt values */) {
    const int bb = block_bytes(fmt);
    vsum acc0[TILE], acc1[TILE];
    float off0[TILE], off1[TILE];
    for (int t = 0; t < mt; t++) {
        acc0[t] = VSUM_ZERO(); acc1[t] = VSUM_ZERO();
        off0[t] = 0.0f; off1[t] = 0.0f;
    }
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        const wide_block w0 = widen(row + b * bb, fmt);
        for (int t = 0; t < mt; t++) {
            acc0[t] = VSUM_ADD(acc0[t], wide_dot(&w0, x + (m0 + t) * K + b * 32));
            off0[t] += w0.c * xsum[(m0 + t) * nb + b];
        }
        const wide_block w1 = widen(row + (b + 1) * bb, fmt);
        for (int t = 0; t < mt; t++) {
            acc1[t] = VSUM_ADD(acc1[t], wide_dot(&w1, x + (m0 + t) * K + (b + 1) * 32));
            off1[t] += w1.c * xsum[(m0 + t) * nb + b + 1];
        }
    }
    if (b < nb) {
        const wide_block w0 = widen(row + b * bb, fmt);
        for (int t = 0; t < mt; t++) {
            acc0[t] = VSUM_ADD(acc0[t], wide_dot(&w0, x + (m0 + t) * K + b * 32));
            off0[t] += w0.c * xsum[(m0 + t) * nb + b];
        }
    }
    for (int t = 0; t < mt; t++) out[t] = VSUM_TOTAL(VSUM_ADD(acc0[t], acc1[t])) + (off0[t] + off1[t]);
}

/* one row of x: the tile of one, with the format a constant (the callers below) */
static inline __attribute__((always_inline)) float one_row(const uint8_t *row, int fmt, int64_t nb, const float *x,
                                                           const float *xsum) {
    float out;
    tile_rows(row, fmt, nb, x, xsum, 0, 0, 1, &out);
    return out;
}

/* a tile of mt rows of x, mt a constant in each case (the sums stay in registers) */
static void some_rows(const uint8_t *row, int fmt, int64_t nb, const float *x, const float *xsum, int64_t K,
                      int64_t m0, int mt, float *out) {
    switch (mt) {
#define ROWS(n) case n: tile_rows(row, fmt, nb, x, xsum, K, m0, n, out); break;
        ROWS(1) ROWS(2) ROWS(3) ROWS(4)
#if TILE > 4
        ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#endif
#undef ROWS
        default: tile_rows(row, fmt, nb, x, xsum, K, m0, mt, out);
    }
}
#else
#define TILE 4 /* rows of x that share one widening of a weight block */

/* y[m, n] for rows m0 .. m0+mt-1 of x and one weight row (without AVX2: plain C) */
static void some_rows(const uint8_t *row, int fmt, int64_t nb, const float *x, const float *xsum, int64_t K,
                      int64_t m0, int mt, float *out /* mt values */) {
    const int bb = block_bytes(fmt);
    float vals[32];
    for (int t = 0; t < mt; t++) out[t] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * bb;
        float d, c;
        block_scales(blk, fmt, &d, &c);
        block_values(block_q(blk, fmt), fmt, vals);
        for (int t = 0; t < mt; t++) {
            const float *xb = x + (m0 + t) * K + b * 32;
            float s = 0.0f;
            for (int j = 0; j < 32; j++) s += vals[j] * xb[j];
            out[t] += d * s + c * xsum[(m0 + t) * nb + b];
        }
    }
}
#endif

#ifdef __AVX2__
/* Ask for the bytes AHEAD_BYTES past row n's while row n is summed (as float_matvec.c does): the
   hardware's prefetcher alone left the product waiting on memory. SmolLM2's 121 packed matrices of a
   decode token (96 MB, in turns, best of 40, 2 threads): 8.7-9.5 ms without, 5.4-5.8 with (1,024 to
   8,192 bytes ahead all alike) */
#define AHEAD_BYTES 4096

static inline void prefetch_ahead(const uint8_t *w, int64_t n, int64_t N, int64_t row_bytes) {
    const int64_t from = (n + 1) * row_bytes + AHEAD_BYTES - row_bytes, end = N * row_bytes;
    for (int64_t b = from; b < from + row_bytes && b < end; b += 64) _mm_prefetch((const char *)w + b, _MM_HINT_T0);
}

static void one_row_q4_0(const uint8_t *w, int64_t row_bytes, int64_t N, int64_t nb, const float *x, const float *xs,
                         float *y) {
#pragma omp parallel for schedule(static) if (N * nb > 1024)
    for (int64_t n = 0; n < N; n++) {
        prefetch_ahead(w, n, N, row_bytes);
        y[n] = one_row(w + n * row_bytes, Q4_0, nb, x, xs);
    }
}

static void one_row_q4_1(const uint8_t *w, int64_t row_bytes, int64_t N, int64_t nb, const float *x, const float *xs,
                         float *y) {
#pragma omp parallel for schedule(static) if (N * nb > 1024)
    for (int64_t n = 0; n < N; n++) {
        prefetch_ahead(w, n, N, row_bytes);
        y[n] = one_row(w + n * row_bytes, Q4_1, nb, x, xs);
    }
}

static void one_row_q8_0(const uint8_t *w, int64_t row_bytes, int64_t N, int64_t nb, const float *x, const float *xs,
                         float *y) {
#pragma omp parallel for schedule(static) if (N * nb > 1024)
    for (int64_t n = 0; n < N; n++) {
        prefetch_ahead(w, n, N, row_bytes);
        y[n] = one_row(w + n * row_bytes, Q8_0, nb, x, xs);
    }
}
#endif

/* y (M, N) = x (M, K) W^T, W: N rows of K/32 blocks of format fmt. Returns 0, or -1 when out of memory. */
int packed_matmul(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int fmt, float *y) {
    const int64_t nb = K / 32, row_bytes = nb * block_bytes(fmt);
    float *xsum = malloc(sizeof(float) * (size_t)(M * nb));  /* each block's column sum, per row of x */
    if (xsum == NULL) return -1;
    for (int64_t i = 0; i < M * nb; i++) {
        float s = 0.0f;
        for (int j = 0; j < 32; j++) s += x[i * 32 + j];
        xsum[i] = s;
    }
#ifdef __AVX2__
    if (M == 1) {
        if (fmt == Q4_0) one_row_q4_0(w, row_bytes, N, nb, x, xsum, y);
        else if (fmt == Q4_1) one_row_q4_1(w, row_bytes, N, nb, x, xsum, y);
        else one_row_q8_0(w, row_bytes, N, nb, x, xsum, y);
        free(xsum);
        return 0;
    }
#endif
#pragma omp parallel for schedule(static) if (N * K * M > 32768)
    for (int64_t n = 0; n < N; n++) {
        float out[TILE];
#ifdef __AVX2__
        prefetch_ahead(w, n, N, row_bytes);
#endif
        for (int64_t m0 = 0; m0 < M; m0 += TILE) {
            const int mt = M - m0 < TILE ? (int)(M - m0) : TILE;
            some_rows(w + n * row_bytes, fmt, nb, x, xsum, K, m0, mt, out);
            for (int t = 0; t < mt; t++) y[(m0 + t) * N + n] = out[t];
        }
    }
    free(xsum);
    return 0;
}

/* out (R, K) = rows `rows` (R of them; NULL: rows 0 .. R-1) of W as float32, d * q + c / -8d as
   gguf's dequantizer computes them */
void packed_dequantize(const uint8_t *w, int64_t K, int fmt, const int64_t *rows, int64_t R, float *out) {
    const int64_t nb = K / 32, row_bytes = nb * block_bytes(fmt);
#pragma omp parallel for schedule(static) if (R * K > 65536)
    for (int64_t r = 0; r < R; r++) {
        const uint8_t *row = w + (rows ? rows[r] : r) * row_bytes;
        float vals[32];
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * block_bytes(fmt);
            float d = half_to_float(blk);
            float *o = out + r * K + b * 32;
#ifdef __AVX2__
            /* the same operations as below, 8 at a time (a multiply, then an add or subtract: no FMA) */
            __m256 v[4];
            block_vectors(block_q(blk, fmt), fmt, v);
            const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(fmt == Q4_1 ? half_to_float(blk + 2) : 0.0f);
            for (int i = 0; i < 4; i++) {
                __m256 x = fmt == Q4_1 ? _mm256_add_ps(_mm256_mul_ps(dv, v[i]), mv)
                         : fmt == Q4_0 ? _mm256_mul_ps(_mm256_sub_ps(v[i], _mm256_set1_ps(8.0f)), dv)
                                       : _mm256_mul_ps(dv, v[i]);
                _mm256_storeu_ps(o + 8 * i, x);
            }
            continue;
#endif
            block_values(block_q(blk, fmt), fmt, vals);
            if (fmt == Q4_1) {
                float m = half_to_float(blk + 2);
                for (int j = 0; j < 32; j++) o[j] = d * vals[j] + m;
            } else if (fmt == Q4_0) {
                for (int j = 0; j < 32; j++) o[j] = (vals[j] - 8.0f) * d;
            } else {
                for (int j = 0; j < 32; j++) o[j] = d * vals[j];
            }
        }
    }
}
