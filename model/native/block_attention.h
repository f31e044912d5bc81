/* The parts of block_attention.c's attention over a KV cache in blocks (included, not compiled on
   its own): block_attention.c runs them over OpenMP's threads, decode_layers.c in its own phases.
   See block_attention.c for what the arguments hold. */

#ifndef ATTNLENS_BLOCK_ATTENTION_H
#define ATTNLENS_BLOCK_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include "vector_math.h"

static inline float dot(const float *a, const float *b, int64_t D) {
#ifdef __AVX2__
    if (D % 8 == 0) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        return _mm_cvtss_f32(s);
    }
#endif
    float s = 0.0f;
    for (int64_t i = 0; i < D; i++) s += a[i] * b[i];
    return s;
}

static inline void add_scaled(float *out, const float *v, float w, int64_t D) {
#ifdef __AVX2__
    if (D % 8 == 0) {
        const __m256 wv = _mm256_set1_ps(w);
        for (int64_t i = 0; i < D; i += 8)
            _mm256_storeu_ps(out + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(out + i)));
        return;
    }
#endif
    for (int64_t i = 0; i < D; i++) out[i] += w * v[i];
}

/* where position p's row of key/value head k starts in a layer's (N, K, P, D) plane, `blocks` the
   row's block table */
static inline int64_t row_at(const int64_t *blocks, int64_t K, int64_t k, int64_t P, int64_t D, int64_t p) {
    return ((blocks[p / P] * K + k) * P + p % P) * D;
}


/* scores[0..n) = exp(scores - top), returning their sum */
static inline float exp_shifted(float *scores, int64_t n, float top) {
    int64_t p = 0;
    float total = 0.0f;
#ifdef __AVX2__
    __m256 sum = _mm256_setzero_ps();
    const __m256 t = _mm256_set1_ps(top);
    for (; p + 8 <= n; p += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + p), t));
        _mm256_storeu_ps(scores + p, e);
        sum = _mm256_add_ps(sum, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, sum);
    total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
#endif
    for (; p < n; p++) {
        scores[p] = expf(scores[p] - top);
        total += scores[p];
    }
    return total;
}

#ifdef __AVX2__
/* the 8 horizontal sums of a[0..7], as one vector [sum a0, ..., sum a7] */
static inline __m256 hsums8(const __m256 a[8]) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

/* scores[p - p0] = scale * q . key(p) for positions p0..p1-1 of key/value head k; returns their
   maximum. With AVX2 and D = 64, eight positions at a time (a block's positions lie in a row, and
   parts start at multiples of 8): the query in registers, each key's 8 products summed into one
   vector, the eight vectors' sums taken together. */
static inline float score_keys(float *scores, const float *q, const float *keys, const int64_t *blocks, int64_t K,
                        int64_t k, int64_t P, int64_t D, int64_t p0, int64_t p1, float scale) {
    float top = -INFINITY;
    int64_t p = p0;
#ifdef __AVX2__
    if (D == 64 && P % 8 == 0 && p0 % 8 == 0) {
        __m256 qv[8], best = _mm256_set1_ps(-INFINITY);
        const __m256 sv = _mm256_set1_ps(scale);
        for (int i = 0; i < 8; i++) qv[i] = _mm256_loadu_ps(q + 8 * i);
        for (; p + 8 <= p1; p += 8) {
            const float *key = keys + row_at(blocks, K, k, P, D, p);  /* 8 rows in a row */
            __m256 a[8];
            for (int j = 0; j < 8; j++) {
                const float *r = key + j * 64;
                __m256 x = _mm256_mul_ps(qv[0], _mm256_loadu_ps(r));
                for (int i = 1; i < 8; i++) x = _mm256_fmadd_ps(qv[i], _mm256_loadu_ps(r + 8 * i), x);
                a[j] = x;
            }
            const __m256 s = _mm256_mul_ps(sv, hsums8(a));
            _mm256_storeu_ps(scores + p - p0, s);
            best = _mm256_max_ps(best, s);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, best);
        for (int i = 0; i < 8; i++) top = lanes[i] > top ? lanes[i] : top;
    }
#endif
    for (; p < p1; p++) {
        const float s = scale * dot(q, keys + row_at(blocks, K, k, P, D, p), D);
        scores[p - p0] = s;
        top = s > top ? s : top;
    }
    return top;
}

/* o[0..w) += sum over positions p0..p1-1 of scores[p - p0] * value(p)[0..w), value(p) the row of
   position p (values offset to the first of the w dims). One query head at a time, its w <= 64
   sums in registers: each value row is read from cache, nothing is stored until the end (adding
   into `o` row by row stored 3 times what it loaded). */
static inline void weigh_values(float *o, const float *values, const int64_t *blocks, int64_t K, int64_t k, int64_t P,
                         int64_t D, int64_t p0, int64_t p1, const float *scores, int64_t w) {
#ifdef __AVX2__
    if (w == 64) {
        __m256 a[8];
        for (int i = 0; i < 8; i++) a[i] = _mm256_loadu_ps(o + 8 * i);
        for (int64_t p = p0; p < p1; p++) {
            const float *v = values + row_at(blocks, K, k, P, D, p);
            const __m256 s = _mm256_set1_ps(scores[p - p0]);
            for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(s, _mm256_loadu_ps(v + 8 * i), a[i]);
        }
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(o + 8 * i, a[i]);
        return;
    }
#endif
    for (int64_t p = p0; p < p1; p++) {
        const float *v = values + row_at(blocks, K, k, P, D, p);
        for (int64_t i = 0; i < w; i++) o[i] += scores[p - p0] * v[i];
    }
}

/* Positions a task takes: a long row's keys are split over the threads (flash-decoding's split),
   each part with its own maximum, sum and weighted values, merged after. */
#define ATTN_CHUNK 512

/* One part of block_attention (part = (row b, key/value head k, ATTN_CHUNK positions c), C parts a
   row): its G query heads' maximum score (top), sum of exp(score - maximum) (sums) and weighted
   values (acc), the scores kept in `probs` or in `buffer` (G * ATTN_CHUNK floats). */
static inline void attention_part(int64_t part, const float *q, const float *keys, const float *values,
                                  const int64_t *table, int64_t nb, const int64_t *lengths, int64_t H, int64_t K,
                                  int64_t P, int64_t D, int64_t C, float scale, float *probs, int64_t S, float *top,
                                  float *sums, float *acc, float *buffer) {
    const int64_t G = H / K;
    const int64_t b = part / (K * C), k = part / C % K, c = part % C, n = lengths[b], h0 = b * H + k * G;
    const int64_t p0 = c * ATTN_CHUNK, p1 = n < p0 + ATTN_CHUNK ? n : p0 + ATTN_CHUNK, m = p1 - p0;
    float *ptop = top + part * G, *psum = sums + part * G, *pacc = acc + part * G * D;
    memset(pacc, 0, sizeof(float) * (size_t)(G * D));
    for (int64_t g = 0; g < G; g++) { ptop[g] = -INFINITY; psum[g] = 0.0f; }
    if (m <= 0) return;
    for (int64_t g = 0; g < G; g++)
        ptop[g] = score_keys(probs ? probs + (h0 + g) * S + p0 : buffer + g * m, q + (h0 + g) * D, keys,
                             table + b * nb, K, k, P, D, p0, p1, scale);
    for (int64_t g = 0; g < G; g++)
        psum[g] = exp_shifted(probs ? probs + (h0 + g) * S + p0 : buffer + g * m, m, ptop[g]);
    for (int64_t g = 0; g < G; g++)
        for (int64_t d0 = 0; d0 < D; d0 += 64)
            weigh_values(pacc + g * D + d0, values + d0, table + b * nb, K, k, P, D, p0, p1,
                         probs ? probs + (h0 + g) * S + p0 : buffer + g * m, D - d0 < 64 ? D - d0 : 64);
}

/* Row b's parts merged for each query head: weights exp(part max - max) / total; out (H, D) of the
   row, and its probabilities scaled (0 past its length) */
static inline void attention_merge(int64_t b, const int64_t *lengths, int64_t H, int64_t K, int64_t D, int64_t C,
                                   float *out, float *probs, int64_t S, const float *top, const float *sums,
                                   const float *acc) {
    const int64_t G = H / K, n = lengths[b];
    for (int64_t h = 0; h < H; h++) {
        const int64_t k = h / G, g = h % G, first = (b * K + k) * C;
        float best = -INFINITY, total = 0.0f;
        for (int64_t c = 0; c < C; c++) best = top[(first + c) * G + g] > best ? top[(first + c) * G + g] : best;
        float weight[C];
        for (int64_t c = 0; c < C; c++) {
            const float t = top[(first + c) * G + g];
            weight[c] = t == -INFINITY ? 0.0f : expf(t - best);
            total += sums[(first + c) * G + g] * weight[c];
        }
        float *o = out + (b * H + h) * D;
        memset(o, 0, sizeof(float) * (size_t)D);
        for (int64_t c = 0; c < C; c++)
            if (weight[c] != 0.0f) add_scaled(o, acc + ((first + c) * G + g) * D, weight[c] / total, D);
        if (probs) {
            float *row = probs + (b * H + h) * S;
            for (int64_t c = 0; c < C && c * ATTN_CHUNK < n; c++) {
                const float f = weight[c] / total;
                const int64_t end = n < (c + 1) * ATTN_CHUNK ? n : (c + 1) * ATTN_CHUNK;
                for (int64_t p = c * ATTN_CHUNK; p < end; p++) row[p] *= f;
            }
            for (int64_t p = n; p < S; p++) row[p] = 0.0f;
        }
    }
}

/* parts of a step's attention: ATTN_CHUNK positions of the longest row */
static inline int64_t attention_chunks(const int64_t *lengths, int64_t B) {
    int64_t longest = 1;
    for (int64_t b = 0; b < B; b++) longest = lengths[b] > longest ? lengths[b] : longest;
    return (longest + ATTN_CHUNK - 1) / ATTN_CHUNK;
}

#endif
