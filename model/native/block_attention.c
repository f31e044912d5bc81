/* One decode step's attention over a KV cache in blocks (model/paged_kv_cache.py), where the keys
   and values lie: no gather, one pass per (row, query head).

   keys, values   one layer's plane, (N, K, P, D): block, key/value head, offset, dims
   table          (B, nb) int64: row b's position p is in block table[b, p / P] at offset p % P
   lengths        (B,) int64: positions row b has (this step's included)
   q              (B, H, D): this step's queries; head h reads key/value head h / (H / K)
   out            (B, H, D) = softmax(scale * q K^T) V per row and head
   probs          (B, H, S) the probabilities, 0 past a row's length (NULL: not wanted)

   A row's positions go in parts of ATTN_CHUNK (the threads share a long row), each part keeping its
   scores (in `probs`, or a buffer), their maximum subtracted, exponentiated (8 at a time), summed,
   and the values weighted in position order; the parts are merged by their maxima and sums
   (flash-decoding): the softmax and weighted sum that torch's kernels compute, to float32
   rounding. */

#include <stdint.h>
#include <stdlib.h>
#include "attnlens_kernels.h"
#include "block_attention.h"

/* Returns 0, or -1 when out of memory. One task per (row, key/value head, ATTN_CHUNK positions): its G
   query heads meet each key and value once, while it is in cache. */
int block_attention(const float *q, const float *keys, const float *values, const int64_t *table, int64_t nb,
                    const int64_t *lengths, int64_t B, int64_t H, int64_t K, int64_t P, int64_t D, float scale,
                    float *out, float *probs, int64_t S) {
    const int64_t G = H / K, C = attention_chunks(lengths, B), parts = B * K * C;
    float *top = malloc(sizeof(float) * (size_t)(parts * G));      /* each part's maximum score, per query head */
    float *sums = malloc(sizeof(float) * (size_t)(parts * G));     /* its sum of exp(score - maximum) */
    float *acc = malloc(sizeof(float) * (size_t)(parts * G * D));  /* its sum of exp(score - maximum) * value */
    int failed = !top || !sums || !acc;
#pragma omp parallel for schedule(dynamic) if (parts > 1 && !failed)
    for (int64_t part = 0; part < (failed ? 0 : parts); part++) {
        float *buffer = probs ? NULL : malloc(sizeof(float) * (size_t)(G * ATTN_CHUNK));
        if (!probs && buffer == NULL) {
            failed = 1;
            continue;
        }
        attention_part(part, q, keys, values, table, nb, lengths, H, K, P, D, C, scale, probs, S, top, sums, acc,
                       buffer);
        free(buffer);
    }
    if (failed) {
        free(top); free(sums); free(acc);
        return -1;
    }
    for (int64_t b = 0; b < B; b++) attention_merge(b, lengths, H, K, D, C, out, probs, S, top, sums, acc);
    free(top); free(sums); free(acc);
    return 0;
}
