/* One decode step's attention over a KV cache in blocks (model/paged_kv_cache.py), where the keys
   and values lie: no gather, one pass per (row, query head).

   keys, values   one layer's plane, (N, K, P, D): block, key/value head, offset, dims
   table          (B, nb) int64: row b's position p is in block table[b, p / P] at offset p % P
   lengths        (B,) int64: positions row b has (this step's included)
   q              (B, H, D): this step's queries; head h reads key/value head h / (H / K)
   out            (B, H, D) = softmax(scale * q K^T) V per row and head
   probs          (B, H, S) the probabilities, 0 past a row's length (NULL: not wanted)

   The scores are kept (in `probs`, or a buffer of the row's length), their maximum subtracted,
   exponentiated, summed; then the values are weighted in position order: the softmax and
   weighted sum that torch's kernels compute, to float32 rounding. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

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

/* Returns 0, or -1 when out of memory. One task per (row, key/value head): its G query heads meet
   each key and value once, while it is in cache. */
int block_attention(const float *q, const float *keys, const float *values, const int64_t *table, int64_t nb,
                    const int64_t *lengths, int64_t B, int64_t H, int64_t K, int64_t P, int64_t D, float scale,
                    float *out, float *probs, int64_t S) {
    const int64_t G = H / K;
    int failed = 0;
#pragma omp parallel for schedule(dynamic) if (B * K > 1)
    for (int64_t task = 0; task < B * K; task++) {
        const int64_t b = task / K, k = task % K, n = lengths[b], h0 = b * H + k * G; /* its first (row, head) */
        float *buffer = probs ? NULL : malloc(sizeof(float) * (size_t)(G * (n > 0 ? n : 1)));
        if (!probs && buffer == NULL) {
            failed = 1;
            continue;
        }
        float top[G > 0 ? G : 1];
        for (int64_t g = 0; g < G; g++) top[g] = -INFINITY;
        for (int64_t p = 0; p < n; p++) {
            const float *key = keys + ((table[b * nb + p / P] * K + k) * P + p % P) * D;
            for (int64_t g = 0; g < G; g++) {
                float *scores = probs ? probs + (h0 + g) * S : buffer + g * n;
                const float s = scale * dot(q + (h0 + g) * D, key, D);
                scores[p] = s;
                top[g] = s > top[g] ? s : top[g];
            }
        }
        float inv[G > 0 ? G : 1];
        for (int64_t g = 0; g < G; g++) {
            float *scores = probs ? probs + (h0 + g) * S : buffer + g * n, total = 0.0f;
            for (int64_t p = 0; p < n; p++) {
                scores[p] = expf(scores[p] - top[g]);
                total += scores[p];
            }
            inv[g] = 1.0f / total;
            memset(out + (h0 + g) * D, 0, sizeof(float) * (size_t)D);
        }
        for (int64_t p = 0; p < n; p++) {
            const float *value = values + ((table[b * nb + p / P] * K + k) * P + p % P) * D;
            for (int64_t g = 0; g < G; g++) {
                const float *scores = probs ? probs + (h0 + g) * S : buffer + g * n;
                add_scaled(out + (h0 + g) * D, value, scores[p], D);
            }
        }
        for (int64_t g = 0; g < G; g++) {
            float *o = out + (h0 + g) * D;
            for (int64_t i = 0; i < D; i++) o[i] *= inv[g];
            if (probs) {
                float *scores = probs + (h0 + g) * S;
                for (int64_t p = 0; p < n; p++) scores[p] *= inv[g];
                for (int64_t p = n; p < S; p++) scores[p] = 0.0f;
            }
        }
        free(buffer);
    }
    return failed ? -1 : 0;
}
