/* One decode step's attention over a KV cache in blocks (model/paged_kv_cache.py), where the keys
   and values lie: no gather, one pass per (row, query head).

   keys, values   one layer's plane, (N, K, P, D): block, key/value head, offset, dims
   table          (B, nb) int64: row b's position p is in block table[b, p / P] at offset p % P
   lengths        (B,) int64: positions row b has (this step's included)
   q              (B, H, D): this step's queries; head h reads key/value head h / (H / K)
   out            (B, H, D) = softmax(scale * q K^T) V per row and head
   probs          (B, H, S) the probabilities, 0 past a row's length (NULL: not wanted)

   A row's positions go in parts of CHUNK (the threads share a long row), each part keeping its
   scores (in `probs`, or a buffer), their maximum subtracted, exponentiated (8 at a time), summed,
   and the values weighted in position order; the parts are merged by their maxima and sums
   (flash-decoding): the softmax and weighted sum that torch's kernels compute, to float32
   rounding. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "attnlens_kernels.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include "vector_math.h"

static float dot(const float *a, const float *b, int64_t D) {
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

static void add_scaled(float *out, const float *v, float w, int64_t D) {
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
static float exp_shifted(float *scores, int64_t n, float top) {
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
static inline __m256 sums8(const __m256 a[8]) {
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
static float score_keys(float *scores, const float *q, const float *keys, const int64_t *blocks, int64_t K,
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
            const __m256 s = _mm256_mul_ps(sv, sums8(a));
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
static void weigh_values(float *o, const float *values, const int64_t *blocks, int64_t K, int64_t k, int64_t P,
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
#define CHUNK 512

/* Returns 0, or -1 when out of memory. One task per (row, key/value head, CHUNK positions): its G
   query heads meet each key and value once, while it is in cache. */
int block_attention(const float *q, const float *keys, const float *values, const int64_t *table, int64_t nb,
                    const int64_t *lengths, int64_t B, int64_t H, int64_t K, int64_t P, int64_t D, float scale,
                    float *out, float *probs, int64_t S) {
    const int64_t G = H / K;
    int64_t longest = 1;
    for (int64_t b = 0; b < B; b++) longest = lengths[b] > longest ? lengths[b] : longest;
    const int64_t C = (longest + CHUNK - 1) / CHUNK, parts = B * K * C;
    float *top = malloc(sizeof(float) * (size_t)(parts * G));      /* each part's maximum score, per query head */
    float *sums = malloc(sizeof(float) * (size_t)(parts * G));     /* its sum of exp(score - maximum) */
    float *acc = malloc(sizeof(float) * (size_t)(parts * G * D));  /* its sum of exp(score - maximum) * value */
    int failed = !top || !sums || !acc;
#pragma omp parallel for schedule(dynamic) if (parts > 1 && !failed)
    for (int64_t part = 0; part < (failed ? 0 : parts); part++) {
        const int64_t b = part / (K * C), k = part / C % K, c = part % C, n = lengths[b], h0 = b * H + k * G;
        const int64_t p0 = c * CHUNK, p1 = n < p0 + CHUNK ? n : p0 + CHUNK, m = p1 - p0;
        float *ptop = top + part * G, *psum = sums + part * G, *pacc = acc + part * G * D;
        memset(pacc, 0, sizeof(float) * (size_t)(G * D));
        for (int64_t g = 0; g < G; g++) { ptop[g] = -INFINITY; psum[g] = 0.0f; }
        if (m <= 0) continue;
        float *buffer = probs ? NULL : malloc(sizeof(float) * (size_t)(G * m));
        if (!probs && buffer == NULL) {
            failed = 1;
            continue;
        }
        for (int64_t g = 0; g < G; g++)
            ptop[g] = score_keys(probs ? probs + (h0 + g) * S + p0 : buffer + g * m, q + (h0 + g) * D, keys,
                                 table + b * nb, K, k, P, D, p0, p1, scale);
        for (int64_t g = 0; g < G; g++)
            psum[g] = exp_shifted(probs ? probs + (h0 + g) * S + p0 : buffer + g * m, m, ptop[g]);
        for (int64_t g = 0; g < G; g++)
            for (int64_t d0 = 0; d0 < D; d0 += 64)
                weigh_values(pacc + g * D + d0, values + d0, table + b * nb, K, k, P, D, p0, p1,
                             probs ? probs + (h0 + g) * S + p0 : buffer + g * m, D - d0 < 64 ? D - d0 : 64);
        free(buffer);
    }
    if (failed) {
        free(top); free(sums); free(acc);
        return -1;
    }
    /* merge each (row, query head)'s parts: weights exp(part max - max) / total */
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = lengths[b];
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
                for (int64_t c = 0; c < C && c * CHUNK < n; c++) {
                    const float f = weight[c] / total;
                    const int64_t end = n < (c + 1) * CHUNK ? n : (c + 1) * CHUNK;
                    for (int64_t p = c * CHUNK; p < end; p++) row[p] *= f;
                }
                for (int64_t p = n; p < S; p++) row[p] = 0.0f;
            }
        }
    }
    free(top); free(sums); free(acc);
    return 0;
}
