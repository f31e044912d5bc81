/* The parts of packed_matmul.c's products with weights in GGUF blocks (included, not compiled on its
   own): packed_matmul.c runs them over OpenMP's threads, decode_layers.c in its own phases. See
   packed_matmul.c for the formats and the sums. */

#ifndef ATTNLENS_PACKED_DOTS_H
#define ATTNLENS_PACKED_DOTS_H

#include <stdint.h>
#include <string.h>
#include "float_dots.h"

enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };
#ifndef NR
#define NR 4 /* without AVX-512 (float_dots.h's tiles): the weight rows widened at a time */
#endif

static inline int block_bytes(int fmt) { return fmt == Q4_0 ? 18 : fmt == Q4_1 ? 20 : 34; }

static inline float half_to_float(const uint8_t *p) {
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

static inline const uint8_t *block_q(const uint8_t *blk, int fmt) { return blk + (fmt == Q4_1 ? 4 : 2); }

#ifndef __AVX2__
/* the block's 32 q as float, in column order */
static inline void block_values(const uint8_t *q, int fmt, float *out) {
    if (fmt == Q8_0) {
        for (int j = 0; j < 32; j++) out[j] = (float)(int8_t)q[j];
    } else {
        for (int j = 0; j < 16; j++) {
            out[j] = (float)(q[j] & 0x0f);
            out[j + 16] = (float)(q[j] >> 4);
        }
    }
}
#endif

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
#endif

/* one block's 32 weights, gguf's values, into out (32 floats) */
static inline void widen_block(const uint8_t *blk, int fmt, float *out) {
    const float d = half_to_float(blk);
#ifdef __AVX2__
    /* the same operations as below, 8 at a time (a multiply, then an add or subtract: no FMA) */
    __m256 v[4];
    block_vectors(block_q(blk, fmt), fmt, v);
    const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(fmt == Q4_1 ? half_to_float(blk + 2) : 0.0f);
    for (int i = 0; i < 4; i++) {
        __m256 x = fmt == Q4_1 ? _mm256_add_ps(_mm256_mul_ps(dv, v[i]), mv)
                 : fmt == Q4_0 ? _mm256_mul_ps(_mm256_sub_ps(v[i], _mm256_set1_ps(8.0f)), dv)
                               : _mm256_mul_ps(dv, v[i]);
        _mm256_storeu_ps(out + 8 * i, x);
    }
#else
    float vals[32];
    block_values(block_q(blk, fmt), fmt, vals);
    if (fmt == Q4_1) {
        const float m = half_to_float(blk + 2);
        for (int j = 0; j < 32; j++) out[j] = d * vals[j] + m;
    } else if (fmt == Q4_0) {
        for (int j = 0; j < 32; j++) out[j] = (vals[j] - 8.0f) * d;
    } else {
        for (int j = 0; j < 32; j++) out[j] = d * vals[j];
    }
#endif
}

/* a weight row of nb blocks as float32 (K = 32 nb) */
static inline void widen_row(const uint8_t *row, int fmt, int64_t nb, float *out) {
    const int bb = block_bytes(fmt);
    for (int64_t b = 0; b < nb; b++) widen_block(row + b * bb, fmt, out + 32 * b);
}

#ifdef __AVX512F__
/* one block's 32 weights as two 16-float vectors, gguf's values (widen_block's operations) */
static inline __attribute__((always_inline)) void widen16(const uint8_t *blk, int fmt, __m512 *lo, __m512 *hi) {
    const uint8_t *q = block_q(blk, fmt);
    const __m512 dv = _mm512_set1_ps(half_to_float(blk));
    if (fmt == Q8_0) {
        *lo = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))));
        *hi = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))));
        return;
    }
    const __m128i raw = _mm_loadu_si128((const __m128i *)q), low = _mm_set1_epi8(0x0f);
    const __m512 l = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, low)));
    const __m512 h = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low)));
    if (fmt == Q4_1) {
        const __m512 mv = _mm512_set1_ps(half_to_float(blk + 2));
        *lo = _mm512_add_ps(_mm512_mul_ps(dv, l), mv);
        *hi = _mm512_add_ps(_mm512_mul_ps(dv, h), mv);
    } else {
        const __m512 eight = _mm512_set1_ps(8.0f);
        *lo = _mm512_mul_ps(_mm512_sub_ps(l, eight), dv);
        *hi = _mm512_mul_ps(_mm512_sub_ps(h, eight), dv);
    }
}

#define FEW 8 /* rows of x that meet each block as it is widened into registers */
/* row_dot(the widened row, x row t) for mt rows of x (mt <= FEW): each block widened once, in
   registers, and met by every row */
static inline __attribute__((always_inline)) void widened_dots(const uint8_t *row, int fmt, int64_t nb,
                                                               const float *x, int64_t K, int mt, float *out) {
    const int bb = block_bytes(fmt);
    __m512 b0[FEW], b1[FEW];
    for (int t = 0; t < mt; t++) b0[t] = b1[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512 lo, hi;
        widen16(row + b * bb, fmt, &lo, &hi);
        for (int t = 0; t < mt; t++) {
            b0[t] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + t * K + 32 * b), b0[t]);
            b1[t] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + t * K + 32 * b + 16), b1[t]);
        }
    }
    if (mt == 8) {  /* a whole tile: its 8 sums at once */
        __m512 v[8];
        for (int t = 0; t < 8; t++) v[t] = _mm512_add_ps(b0[t], b1[t]);
        sums8(v, out);
        for (int t = 0; t < 8; t++) out[t] = out[t] + 0.0f;  /* row_rest's, nothing left */
        return;
    }
    for (int t = 0; t < mt; t++) out[t] = row_rest(sum16(_mm512_add_ps(b0[t], b1[t])), NULL, NULL, 32 * nb, 32 * nb);
}

/* widened_dots with the format and mt constants */
static inline void few_rows(const uint8_t *row, int fmt, int64_t nb, const float *x, int64_t K, int mt, float *out) {
#define CASE(f, n) case f * 16 + n: widened_dots(row, f, nb, x, K, n, out); break;
#define FORMAT(f) CASE(f, 1) CASE(f, 2) CASE(f, 3) CASE(f, 4) CASE(f, 5) CASE(f, 6) CASE(f, 7) CASE(f, 8)
    switch (fmt * 16 + mt) {
        FORMAT(Q4_0) FORMAT(Q4_1) FORMAT(Q8_0)
        default: break;
    }
#undef FORMAT
#undef CASE
}
#else
#define FEW 1
/* row_dot(the widened row, x): each block widened as it comes, then summed as row_dot sums it */
static inline void few_rows(const uint8_t *row, int fmt, int64_t nb, const float *x, int64_t K, int mt, float *out) {
    (void)K;
    (void)mt;  /* always 1 here */
    float w[32] __attribute__((aligned(32)));
#ifdef __AVX2__
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        widen_block(row + b * block_bytes(fmt), fmt, w);
        const float *xb = x + 32 * b;
        a0 = _mm256_fmadd_ps(_mm256_load_ps(w), _mm256_loadu_ps(xb), a0);
        a1 = _mm256_fmadd_ps(_mm256_load_ps(w + 8), _mm256_loadu_ps(xb + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_load_ps(w + 16), _mm256_loadu_ps(xb + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_load_ps(w + 24), _mm256_loadu_ps(xb + 24), a3);
    }
    const __m256 a = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    *out = 0.0f + _mm_cvtss_f32(s);
#else
    float sum = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        widen_block(row + b * block_bytes(fmt), fmt, w);
        for (int j = 0; j < 32; j++) sum += w[j] * x[32 * b + j];
    }
    *out = sum;
#endif
}
#endif

/* Ask for the bytes AHEAD_BYTES past row n's while row n is summed (as float_matvec.c does): the
   hardware's prefetcher alone left the product waiting on memory. SmolLM2's 121 packed matrices of a
   decode token (96 MB, in turns, best of 40, 2 threads): 8.7-9.5 ms without, 5.4-5.8 with (1,024 to
   8,192 bytes ahead all alike) */
static inline void prefetch_ahead(const uint8_t *w, int64_t n, int64_t N, int64_t row_bytes) {
    const int64_t from = (n + 1) * row_bytes + AHEAD_BYTES - row_bytes, end = N * row_bytes;
    for (int64_t b = from; b < from + row_bytes && b < end; b += 64) __builtin_prefetch((const char *)w + b, 0, 3);
}

#define CHUNK 32 /* weight rows that meet one tile of x rows before the next tile: both stay in cache */

/* y[:, n0:n1] of y (M, N) = x (M, K) W^T, n0 a multiple of CHUNK, for one row of x or with AVX-512: each
   run of CHUNK weight rows meets every tile of up to FEW rows of x, each block widened once per
   tile, in registers */
static inline void packed_range(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int fmt, float *y,
                                int64_t n0, int64_t n1) {
    const int64_t nb = K / 32, row_bytes = nb * block_bytes(fmt);
    float out[FEW];
    for (int64_t c0 = n0; c0 < n1; c0 += CHUNK) {
        const int64_t c1 = c0 + CHUNK < n1 ? c0 + CHUNK : n1;
        for (int64_t m0 = 0, tiles = (M + FEW - 1) / FEW; m0 < M; tiles--) {
            const int mt = (int)((M - m0 + tiles - 1) / tiles);  /* the rows in tiles of even sizes */
            for (int64_t n = c0; n < c1; n++) {
                if (m0 == 0) prefetch_ahead(w, n, N, row_bytes);
                few_rows(w + n * row_bytes, fmt, nb, x + m0 * K, K, mt, out);
                for (int t = 0; t < mt; t++) y[(m0 + t) * N + n] = out[t];
            }
            m0 += mt;
        }
    }
}

#ifndef __AVX512F__
/* weight rows n0 .. n0+nr-1 (nr <= NR) widened into buf (NR * K floats), then met by every row of x,
   each pair summed by row_dot (more than one row of x without AVX-512) */
static inline void packed_group(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t n0, int nr,
                                int64_t N, int fmt, float *buf, float *y) {
    const int64_t nb = K / 32, row_bytes = nb * block_bytes(fmt);
    for (int i = 0; i < nr; i++) {
        prefetch_ahead(w, n0 + i, N, row_bytes);
        widen_row(w + (n0 + i) * row_bytes, fmt, nb, buf + i * K);
    }
    for (int i = 0; i < nr; i++)
        for (int64_t m = 0; m < M; m++) y[m * N + n0 + i] = row_dot(buf + i * K, x + m * K, K, 0);
}
#endif

#endif
