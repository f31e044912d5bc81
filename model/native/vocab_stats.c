/* Per-row statistics over the vocabulary for the logit lens (model/analysis/vocab_rows.py): a
   row's top k, the log-probability of a picked id and its rank, without writing the row's
   log-probabilities.

   x          (N, V) float32 logits, rows contiguous
   picks      (N,) int64 ids in 0..V-1
   top_logp   (N, k) the k largest log-probabilities, descending (among equal logits, the lower id first)
   top_ids    (N, k) their ids
   picked     (N,) the picked id's log-probability
   ranks      (N,) int64: entries strictly above the picked one (NULL: not wanted)

   Two passes over a row (it stays in cache between them): the first keeps the k largest (a sorted
   list; a block of 8 logits is looked at only when one of them beats the k-th so far) and counts
   the entries above the picked one; the second sums e^(x - max) (8 at a time, in float lanes
   flushed to a double every 1024 entries). log-probability = x - max - log(sum): what torch's
   log_softmax gives, to float32 rounding. Returns the first row (+1) holding a NaN or an infinite
   maximum, whose statistics the caller leaves to torch; 0 when every row was done. */

#include <math.h>
#include <stdint.h>
#include "attnlens_kernels.h"
#include "vector_math.h"

/* insert (v, id) into vals/ids[0..k) (descending), dropping the last */
static inline void insert(float *vals, int64_t *ids, int64_t k, float v, int64_t id) {
    int64_t i = k - 1;
    while (i > 0 && vals[i - 1] < v) {
        vals[i] = vals[i - 1];
        ids[i] = ids[i - 1];
        i--;
    }
    vals[i] = v;
    ids[i] = id;
}

/* the k largest of x[0..V) into vals/ids (descending); returns how many exceed `above`, or -1 where
   the row holds a NaN */
static int64_t top_and_count(const float *x, int64_t V, int64_t k, float *vals, int64_t *ids, float above) {
    for (int64_t i = 0; i < k; i++) {
        vals[i] = -INFINITY;
        ids[i] = -1;
    }
    for (int64_t j = 0; j < k; j++) insert(vals, ids, j + 1, x[j], j);  /* the first k, sorted */
    int64_t greater = 0, nan = 0;
    for (int64_t j = 0; j < k; j++) {
        greater += x[j] > above;
        nan |= isnan(x[j]);
    }
    int64_t j = k;
#ifdef __AVX2__
    for (; j < V && j % 8; j++) {
        greater += x[j] > above;
        nan |= isnan(x[j]);
        if (x[j] > vals[k - 1]) insert(vals, ids, k, x[j], j);
    }
    __m256 floor = _mm256_set1_ps(vals[k - 1]), unordered = _mm256_setzero_ps();
    const __m256 a = _mm256_set1_ps(above);
    for (; j + 8 <= V; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        greater += __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(v, a, _CMP_GT_OQ)));
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        int m = _mm256_movemask_ps(_mm256_cmp_ps(v, floor, _CMP_GT_OQ));
        if (m) {
            for (int b = 0; b < 8; b++)
                if (x[j + b] > vals[k - 1]) insert(vals, ids, k, x[j + b], j + b);
            floor = _mm256_set1_ps(vals[k - 1]);
        }
    }
    nan |= _mm256_movemask_ps(unordered) != 0;
#endif
    for (; j < V; j++) {
        greater += x[j] > above;
        nan |= isnan(x[j]);
        if (x[j] > vals[k - 1]) insert(vals, ids, k, x[j], j);
    }
    return nan ? -1 : greater;
}

/* log(sum over x[0..V) of e^(x - top)) */
static double log_sum_exp_shifted(const float *x, int64_t V, float top) {
    double total = 0.0;
    int64_t j = 0;
#ifdef __AVX2__
    const __m256 t = _mm256_set1_ps(top);
    while (j + 8 <= V) {
        __m256 s = _mm256_setzero_ps();
        const int64_t end = j + 1024 < V ? j + 1024 : V;
        for (; j + 8 <= end; j += 8) s = _mm256_add_ps(s, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), t)));
        float lanes[8];
        _mm256_storeu_ps(lanes, s);
        for (int b = 0; b < 8; b++) total += lanes[b];
    }
#endif
    for (; j < V; j++) total += expf(x[j] - top);
    return log(total);
}

int64_t vocab_stats(const float *x, int64_t N, int64_t V, const int64_t *picks, int64_t k, float *top_logp,
                    int64_t *top_ids, float *picked, int64_t *ranks) {
    int64_t bad = 0;
#pragma omp parallel for schedule(static) if (N * V > 262144)
    for (int64_t r = 0; r < N; r++) {
        const float *xr = x + r * V;
        float *vals = top_logp + r * k;
        int64_t *ids = top_ids + r * k;
        const float chosen = xr[picks[r]];
        const int64_t greater = top_and_count(xr, V, k, vals, ids, ranks ? chosen : INFINITY);
        const float top = vals[0];
        if (greater < 0 || !isfinite(top)) {  /* NaN or an infinite maximum: torch's own rules apply */
#pragma omp critical
            if (bad == 0 || r + 1 < bad) bad = r + 1;
            continue;
        }
        const float shift = (float)log_sum_exp_shifted(xr, V, top);
        for (int64_t i = 0; i < k; i++) vals[i] = (vals[i] - top) - shift;
        picked[r] = (chosen - top) - shift;
        if (ranks) ranks[r] = greater;
    }
    return bad;
}
