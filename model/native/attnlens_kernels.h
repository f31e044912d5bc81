/* The C kernels' interface, declared once: every function the library exports and the structs
   they share. Each .c file includes this header, so the compiler checks its definitions against
   these declarations; model/native/library.py hands the same text to cffi (ffi.cdef), so Python
   calls exactly these signatures and builds exactly these structs.

   cffi's cdef reads plain C declarations only: Python drops the lines starting with '#' (the
   include guard and <stdint.h>) and reads the rest. Keep it so: no macros, no inline bodies.

   Arrays are row-major and contiguous unless a stride is passed; each .c file says what its
   arguments hold. */

#ifndef ATTNLENS_KERNELS_H
#define ATTNLENS_KERNELS_H

#include <stdint.h>

/* packed_matmul.c: products with weights in GGUF blocks (fmt: 0 Q4_0, 1 Q4_1, 2 Q8_0) */
int packed_matmul(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int fmt, float *y);
void packed_dequantize(const uint8_t *w, int64_t K, int fmt, const int64_t *rows, int64_t R, float *out);

/* float_matvec.c: one or a few rows times a float32 weight (bias may be NULL) */
void float_matvec(const float *x, int64_t K, const float *w, int64_t N, const float *bias, float *y);
void float_matmul_few(const float *x, int64_t M, int64_t K, const float *w, int64_t N, const float *bias, float *y);

/* rms_norm.c, swiglu.c, rotary.c: a prefill's elementwise steps in one pass each */
void rms_norm(const float *x, int64_t rows, int64_t C, const float *w, float eps, float *out);
void swiglu(const float *h, int64_t rows, int64_t F, float *out);
void rotary(const float *x, int64_t x_head, int64_t x_row, int64_t heads, int64_t T, int64_t D, const float *cos,
            const float *signed_sin, float *out);

/* block_attention.c: a decode step's attention over a KV cache in blocks (probs may be NULL) */
int block_attention(const float *q, const float *keys, const float *values, const int64_t *table, int64_t nb,
                    const int64_t *lengths, int64_t B, int64_t H, int64_t K, int64_t P, int64_t D, float scale,
                    float *out, float *probs, int64_t S);

/* causal_attention.c: a prefill's causal attention, flash-style in tiles */
int causal_attention(const float *q, int64_t q_head, int64_t q_row, const float *k, int64_t k_head, int64_t k_row,
                     const float *v, int64_t v_head, int64_t v_row, int64_t H, int64_t K, int64_t T, int64_t S,
                     int64_t D, float scale, float *out);

/* causal_attention_reduced's request: what the asked heads' maps become, made from the forward's
   own scores. H' asked heads, query positions [row0, row1) (R rows), key positions [col0, col1)
   (C columns). Each output is NULL (or k 0) when not asked. */
typedef struct attention_reduction {
    const int64_t *slot;          /* (H,): query head h's index among the asked heads, or -1 */
    int64_t row0, row1, col0, col1;
    const int64_t *col_edges;     /* (bins + 1,) key positions: bin i is [col_edges[i], col_edges[i + 1]) */
    int64_t bins;
    float *bin_sums;              /* (H', R, bins): each row's probability on each column bin */
    int64_t k;
    float *top_weights;           /* (H', R, k): each row's k heaviest columns, heaviest first */
    int32_t *top_positions;       /* (H', R, k): their key positions, -1 where the weight is 0 */
    void *window;                 /* (H', R, C) probabilities as window_store: 0 float32, 1 float16, */
    int64_t window_store;         /* 2 uint8 steps of window_scale */
    float window_scale;
} attention_reduction;

int causal_attention_reduced(const float *q, int64_t q_head, int64_t q_row, const float *k, int64_t k_head,
                             int64_t k_row, const float *v, int64_t v_head, int64_t v_row, int64_t H, int64_t K,
                             int64_t T, int64_t S, int64_t D, float scale, float *out,
                             const attention_reduction *red);

/* vocab_stats.c: the logit lens's per-row top k, picked log-probability and rank (ranks may be NULL) */
int64_t vocab_stats(const float *x, int64_t N, int64_t V, const int64_t *picks, int64_t k, float *top_logp,
                    int64_t *top_ids, float *picked, int64_t *ranks);

/* decode_layers.c: a decode step through every block of a Llama-like stack; one fused_layer a
   block (model/fused_decode.py fills them with ffi.new("fused_layer[]", L)) */
typedef struct fused_linear {
    const void *weight;  /* float32 (n_out, n_in), or n_out rows of packed blocks */
    const float *bias;   /* (n_out,) or NULL */
    int64_t n_out, n_in;
    int64_t format;      /* -1: float32; else packed_matmul's fmt */
} fused_linear;

typedef struct fused_layer {
    const float *ln1, *ln2;        /* (C,) RMSNorm weights */
    const float *q_norm, *k_norm;  /* (D,) per-head RMSNorm weights, or NULL */
    fused_linear qkv, attn_out, ffn_in, ffn_out;
    float *keys, *values;          /* the layer's cache planes, (N, K, P, D) */
    float *probs;                  /* (B, H, S): this step's attention maps, or NULL */
} fused_layer;

int decode_layers(float *x, int64_t B, int64_t C, const fused_layer *layers, int64_t L, int64_t H, int64_t K,
                  int64_t D, int64_t F, int64_t R, const float *cos, const float *signed_sin, const int64_t *slots,
                  const int64_t *table, int64_t nb, const int64_t *lengths, int64_t P, int64_t S, float eps,
                  float scale);

#endif
