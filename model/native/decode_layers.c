/* A decode step through every block of a Llama-like stack in one call (model/fused_decode.py).

   The same operations, in the same order, as model/parts/block.py's pre-norm Block with RMSNorm,
   MultiHeadAttention over a KV cache in blocks (model/paged_kv_cache.py) and the SwiGLU
   FeedForward, for the B rows of one decode step (one new token each):

       h = rms_norm(x, ln1)
       q | k | v = h Wqkv^T (+ b)              q: H heads, k and v: K heads of D dims
       q, k = rms_norm per head (Qwen3's q_norm / k_norm, when given)
       q, k = rotary(q), rotary(k)             the first R dims: x * cos + roll(x, R/2) * signed_sin
       the cache's slot of (row, kv head) = k, v
       a = block_attention(q, the layer's keys and values)           [probs: the maps, when asked]
       x = x + a Wo^T (+ b)
       h = rms_norm(x, ln2)
       g | u = h Wfc^T (+ b);   x = x + (silu(g) * u) Wdown^T (+ b)   [silu(g) * u: swiglu.c]

   What the modular path pays per operator (a torch dispatch, an allocation, a call into C: about
   40 operators a layer, 1,200 a token of SmolLM2) is paid once here. Weights are float32 or a
   GGUF block format (packed_matmul.c); the products, norms and attention are this folder's
   kernels, so the numbers are the modular path's up to the order of a few sums.

   Returns 0, or -1 when out of memory. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "attnlens_kernels.h"

/* y (M, n_out) = x (M, n_in) W^T (+ bias) */
static int linear(const fused_linear *l, const float *x, int64_t M, float *y) {
    if (l->format < 0) {
        float_matmul_few(x, M, l->n_in, (const float *)l->weight, l->n_out, l->bias, y);
        return 0;
    }
    if (packed_matmul(x, M, l->n_in, (const uint8_t *)l->weight, l->n_out, (int)l->format, y)) return -1;
    if (l->bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < l->n_out; n++) y[m * l->n_out + n] += l->bias[n];
    return 0;
}

/* the first R dims of one head's D: x * cos + roll(x, R/2) * signed_sin (positions.py's apply_rotary) */
static void rotate(float *x, const float *cos, const float *signed_sin, int64_t R) {
    float rolled[R > 0 ? R : 1];
    for (int64_t i = 0; i < R; i++) rolled[i] = x[(i + R / 2) % R];
    for (int64_t i = 0; i < R; i++) x[i] = x[i] * cos[i] + rolled[i] * signed_sin[i];
}

int decode_layers(float *x, int64_t B, int64_t C, const fused_layer *layers, int64_t L, int64_t H, int64_t K,
                  int64_t D, int64_t F, int64_t R, const float *cos, const float *signed_sin, const int64_t *slots,
                  const int64_t *table, int64_t nb, const int64_t *lengths, int64_t P, int64_t S, float eps,
                  float scale) {
    const int64_t width = (H + 2 * K) * D;  /* a row's q | k | v */
    float *h = malloc(sizeof(float) * (size_t)(B * C));
    float *qkv = malloc(sizeof(float) * (size_t)(B * width));
    float *q = malloc(sizeof(float) * (size_t)(B * H * D));
    float *att = malloc(sizeof(float) * (size_t)(B * H * D));
    float *gu = malloc(sizeof(float) * (size_t)(B * 2 * F));
    float *act = malloc(sizeof(float) * (size_t)(B * F));
    float *out = malloc(sizeof(float) * (size_t)(B * C));
    int failed = !h || !qkv || !q || !att || !gu || !act || !out;
    for (int64_t i = 0; i < L && !failed; i++) {
        const fused_layer *l = layers + i;
        rms_norm(x, B, C, l->ln1, eps, h);
        if (linear(&l->qkv, h, B, qkv)) { failed = 1; break; }
        for (int64_t b = 0; b < B; b++) {
            float *row = qkv + b * width;  /* q heads, then k's, then v's */
            if (l->q_norm) {
                rms_norm(row, H, D, l->q_norm, eps, row);
                rms_norm(row + H * D, K, D, l->k_norm, eps, row + H * D);
            }
            for (int64_t j = 0; R > 0 && j < H + K; j++) rotate(row + j * D, cos + b * R, signed_sin + b * R, R);
            memcpy(q + b * H * D, row, sizeof(float) * (size_t)(H * D));
            for (int64_t k = 0; k < K; k++) {
                const int64_t slot = slots[b * K + k];
                memcpy(l->keys + slot * D, row + (H + k) * D, sizeof(float) * (size_t)D);
                memcpy(l->values + slot * D, row + (H + K + k) * D, sizeof(float) * (size_t)D);
            }
        }
        if (block_attention(q, l->keys, l->values, table, nb, lengths, B, H, K, P, D, scale, att, l->probs, S)
            || linear(&l->attn_out, att, B, out)) { failed = 1; break; }
        for (int64_t j = 0; j < B * C; j++) x[j] = x[j] + out[j];
        rms_norm(x, B, C, l->ln2, eps, h);
        if (linear(&l->ffn_in, h, B, gu)) { failed = 1; break; }
        swiglu(gu, B, F, act);  /* the modular FeedForward's kernel (swiglu.c): its bits, vectorised */
        if (linear(&l->ffn_out, act, B, out)) { failed = 1; break; }
        for (int64_t j = 0; j < B * C; j++) x[j] = x[j] + out[j];
    }
    free(h); free(qkv); free(q); free(att); free(gu); free(act); free(out);
    return failed ? -1 : 0;
}
