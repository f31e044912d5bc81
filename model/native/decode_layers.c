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
   GGUF block format; the products, norms and attention are this folder's kernels (float_dots.h,
   packed_dots.h, block_attention.h, rms_norm.c, swiglu.c), each value computed as they compute
   it, so the numbers are the modular path's up to the order of a few sums.

   The threads: one OpenMP region for the whole step, in phases (a layer's norm, each product,
   the attention's parts and their merge, ...). A phase is cut into chunks (a run of weight rows,
   a row of x, an attention part) that the threads take from a counter as they come, and a thread
   starts the next phase once every chunk of this one is done. No thread waits for another to
   arrive: a thread the system took away (another process on the machine, the server's own
   threads) only holds up the chunk it was running, and the others go on without it, where
   a barrier per operator (about 300 a SmolLM2 step) would wait a time slice each for it.

   Returns 0, or -1 when out of memory. */

#include <limits.h>
#include <sched.h>
#include <stdatomic.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "attnlens_kernels.h"
#include "block_attention.h"
#include "packed_dots.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* a product's chunks, this many a thread: few for one row of x (long streams for the reading ahead,
   where memory bounds the product), more where the sums bound it (even shares) */
#define CHUNKS_PER_THREAD(M) ((M) == 1 ? 2 : 8)

/* one phase's chunks: the next to take, how many are done, and how many threads sleep until all
   are, on a cache line of their own */
typedef struct {
    _Alignas(64) atomic_llong next;
    atomic_int done;
    atomic_int sleepers;
} phase;

/* the next chunk of ph for this thread, or -1 when all are taken */
static inline int64_t take(phase *ph, int64_t n) {
    if (atomic_load_explicit(&ph->next, memory_order_relaxed) >= n) return -1;
    const int64_t c = atomic_fetch_add_explicit(&ph->next, 1, memory_order_relaxed);
    return c < n ? c : -1;
}

/* a chunk of ph is done; the last one wakes the threads that sleep on the phase */
static inline void finish(phase *ph, int64_t n) {
    if (atomic_fetch_add(&ph->done, 1) + 1 == n && atomic_load(&ph->sleepers) > 0) {
#ifdef __linux__
        syscall(SYS_futex, &ph->done, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
#endif
    }
}

/* returns once the n chunks of ph are done (and their writes seen): a short spin (the other threads'
   last chunks), then asleep until the last one is done: a thread that was taken away in the middle
   of its chunk may hold the phase for a time slice, and the waiting one gives its processor up
   meanwhile (it is not counted as work, and the absent thread may get it) */
static inline void wait_done(phase *ph, int64_t n) {
    for (int spins = 0; spins < 2000; spins++) {
        if (atomic_load_explicit(&ph->done, memory_order_acquire) >= n) return;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }
    atomic_fetch_add(&ph->sleepers, 1);
    for (int d; (d = atomic_load(&ph->done)) < n;) {
#ifdef __linux__
        syscall(SYS_futex, &ph->done, FUTEX_WAIT_PRIVATE, d, NULL, NULL, 0);
#else
        sched_yield();
#endif
    }
    atomic_fetch_sub(&ph->sleepers, 1);
}

#define PHASE(ph, n, c, body)                                                           \
    do {                                                                                \
        for (int64_t c; (c = take((ph), (n))) >= 0;) {                                   \
            body;                                                                       \
            finish((ph), (n));                                                          \
        }                                                                               \
        wait_done((ph), (n));                                                           \
    } while (0)

/* y[:, n0:n1] of y (M, n_out) = x (M, n_in) W^T (+ bias); with `residual`, residual[:, n0:n1] += that
   (the block's x = x + ...). `scratch`: NR * n_in floats (packed weights, more than one row of x,
   without AVX-512) */
static void linear_range(const fused_linear *l, const float *x, int64_t M, float *y, int64_t n0, int64_t n1,
                         float *residual, float *scratch) {
    const int64_t N = l->n_out, K = l->n_in;
    if (l->format < 0) {
        float_range(x, M, K, (const float *)l->weight, N, l->bias, y, n0, n1);
    } else {
        const uint8_t *w = (const uint8_t *)l->weight;
#ifndef __AVX512F__
        if (M > 1) {
            for (int64_t g = n0; g < n1; g += NR)
                packed_group(x, M, K, w, g, n1 - g < NR ? (int)(n1 - g) : NR, N, (int)l->format, scratch, y);
        } else
#endif
            packed_range(x, M, K, w, N, (int)l->format, y, n0, n1);
        (void)scratch;
        if (l->bias)
            for (int64_t m = 0; m < M; m++)
                for (int64_t n = n0; n < n1; n++) y[m * N + n] += l->bias[n];
    }
    if (residual)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = n0; n < n1; n++) residual[m * N + n] = residual[m * N + n] + y[m * N + n];
}

/* weight rows of a product's chunk: a few chunks a thread (contiguous runs, read ahead as one
   stream), in multiples of packed_dots.h's CHUNK (and so of float_dots.h's NR) */
static inline int64_t rows_per_chunk(const fused_linear *l, int64_t M, int threads) {
    const int64_t chunks = CHUNKS_PER_THREAD(M) * threads, rows = (l->n_out + chunks - 1) / chunks;
    return (rows + CHUNK - 1) / CHUNK * CHUNK;
}

/* a product's phase: its chunks (runs of weight rows), then every one of them done */
static void product(phase *ph, const fused_linear *l, const float *x, int64_t M, float *y, float *residual,
                    float *scratch, int threads) {
    const int64_t rows = rows_per_chunk(l, M, threads), N = l->n_out;
    PHASE(ph, (N + rows - 1) / rows, c, linear_range(l, x, M, y, c * rows, (c + 1) * rows < N ? (c + 1) * rows : N,
                                                     residual, scratch));
}

/* the first R dims of one head's D: x * cos + roll(x, R/2) * signed_sin (positions.py's apply_rotary) */
static void rotate(float *x, const float *cos, const float *signed_sin, int64_t R) {
    float rolled[R > 0 ? R : 1];
    for (int64_t i = 0; i < R; i++) rolled[i] = x[(i + R / 2) % R];
    for (int64_t i = 0; i < R; i++) x[i] = x[i] * cos[i] + rolled[i] * signed_sin[i];
}

/* row b of the step after its q | k | v product: the heads' norms and angles, its query copied out,
   its key and values written to the cache's slots */
static void place_row(const fused_layer *l, int64_t b, float *qkv, float *q, int64_t H, int64_t K, int64_t D,
                      int64_t R, const float *cos, const float *signed_sin, const int64_t *slots, float eps) {
    float *row = qkv + b * (H + 2 * K) * D;  /* q heads, then k's, then v's */
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

/* the phases of one layer (see the module comment) */
enum { NORM1, QKV, PLACE, PARTS, MERGE, ATTN_OUT, NORM2, FFN_IN, SWIGLU, FFN_OUT, PHASES };

int decode_layers(float *x, int64_t B, int64_t C, const fused_layer *layers, int64_t L, int64_t H, int64_t K,
                  int64_t D, int64_t F, int64_t R, const float *cos, const float *signed_sin, const int64_t *slots,
                  const int64_t *table, int64_t nb, const int64_t *lengths, int64_t P, int64_t S, float eps,
                  float scale) {
    const int64_t width = (H + 2 * K) * D, G = H / K;  /* a row's q | k | v; query heads a key head serves */
    const int64_t parts_per_row = attention_chunks(lengths, B), parts = B * K * parts_per_row;
#ifdef _OPENMP
    const int threads = omp_get_max_threads();
#else
    const int threads = 1;
#endif
    const int64_t widest = C > F ? C : F;  /* the longest n_in: the scratch of packed products */
    float *h = malloc(sizeof(float) * (size_t)(B * C));
    float *qkv = malloc(sizeof(float) * (size_t)(B * width));
    float *q = malloc(sizeof(float) * (size_t)(B * H * D));
    float *att = malloc(sizeof(float) * (size_t)(B * H * D));
    float *gu = malloc(sizeof(float) * (size_t)(B * 2 * F));
    float *act = malloc(sizeof(float) * (size_t)(B * F));
    float *out = malloc(sizeof(float) * (size_t)(B * C));
    float *top = malloc(sizeof(float) * (size_t)(parts * G));      /* the attention parts' maxima */
    float *sums = malloc(sizeof(float) * (size_t)(parts * G));     /* their sums of exp(score - maximum) */
    float *acc = malloc(sizeof(float) * (size_t)(parts * G * D));  /* their weighted values */
    /* each thread's: an attention part's scores (when no maps are asked), widened packed weight rows */
    const int64_t per_thread = G * ATTN_CHUNK > NR * widest ? G * ATTN_CHUNK : NR * widest;
    float *scratch_all = malloc(sizeof(float) * (size_t)(threads * per_thread));
    phase *phases = aligned_alloc(64, sizeof(phase) * (size_t)(L * PHASES));
    int failed = !h || !qkv || !q || !att || !gu || !act || !out || !top || !sums || !acc || !scratch_all || !phases;
    if (!failed) {
        for (int64_t i = 0; i < L * PHASES; i++) {
            atomic_init(&phases[i].next, 0);
            atomic_init(&phases[i].done, 0);
            atomic_init(&phases[i].sleepers, 0);
        }
#pragma omp parallel if (threads > 1)
        {
#ifdef _OPENMP
            float *scratch = scratch_all + omp_get_thread_num() * per_thread;
#else
            float *scratch = scratch_all;
#endif
            for (int64_t i = 0; i < L; i++) {
                const fused_layer *l = layers + i;
                phase *ph = phases + i * PHASES;
                PHASE(ph + NORM1, B, b, rms_norm(x + b * C, 1, C, l->ln1, eps, h + b * C));
                product(ph + QKV, &l->qkv, h, B, qkv, NULL, scratch, threads);
                PHASE(ph + PLACE, B, b, place_row(l, b, qkv, q, H, K, D, R, cos, signed_sin, slots, eps));
                PHASE(ph + PARTS, parts, p,
                      attention_part(p, q, l->keys, l->values, table, nb, lengths, H, K, P, D, parts_per_row, scale,
                                     l->probs, S, top, sums, acc, scratch));
                PHASE(ph + MERGE, B, b,
                      attention_merge(b, lengths, H, K, D, parts_per_row, att, l->probs, S, top, sums, acc));
                product(ph + ATTN_OUT, &l->attn_out, att, B, out, x, scratch, threads);
                PHASE(ph + NORM2, B, b, rms_norm(x + b * C, 1, C, l->ln2, eps, h + b * C));
                product(ph + FFN_IN, &l->ffn_in, h, B, gu, NULL, scratch, threads);
                PHASE(ph + SWIGLU, B, b, swiglu(gu + b * 2 * F, 1, F, act + b * F));
                product(ph + FFN_OUT, &l->ffn_out, act, B, out, x, scratch, threads);
            }
        }
    }
    free(h); free(qkv); free(q); free(att); free(gu); free(act); free(out); free(top); free(sums); free(acc);
    free(scratch_all); free(phases);
    return failed ? -1 : 0;
}
