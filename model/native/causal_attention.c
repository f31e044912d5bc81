/* A prefill's causal attention (model/parts/causal_attention.py): every query of a piece of T
   positions over the S keys before and up to it, in tiles, the softmax kept online (flash
   attention, Dao et al. 2022) so no (T, S) score matrix is ever held.

   q      (H, T, D): query head h's row t at q + h * q_head + t * q_row (dims contiguous)
   k, v   (K, S, D): likewise with k_head, k_row / v_head, v_row; query head h reads key/value
          head h / (H / K) (grouped-query attention)
   out    (T, H, D) contiguous: the layout the output projection reads, no transpose after

   Query t is at position S - T + t and sees keys 0 .. S - T + t: a whole prompt (S = T), or a
   prompt's later piece after the cached ones (S > T).

   Work items are (query head, tile of BQ queries), the longest first, shared by the threads. An
   item walks its keys in tiles of BK: scores = q K^T * scale from keys transposed once per call,
   tile by tile (a tile's keys side by side in the vector registers, its D rows contiguous), the row maxima and sums updated online, and the
   weighted values added to the item's output rows. Products are float32 fused multiply-adds,
   e^x the polynomial of vector_math.h: torch's flash kernel's numbers to float32 rounding.

   Returns 0, 1 when D is not a multiple of the vector width or over MAX_D (the caller uses
   torch's kernel), 2 when memory for the transposed keys or a thread's tiles cannot be had. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "attnlens_kernels.h"
#include "vector_math.h"

#define BQ 64     /* queries a work item */
#define BK 64     /* keys a tile */
#define MAX_D 256

#if defined(__AVX512F__)
typedef __m512 vf;
#define W 16
#define ROWS 4    /* query rows of a score or value micro-kernel: ROWS x 4 accumulators */
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vset1 _mm512_set1_ps
#define vzero _mm512_setzero_ps
#define vfma _mm512_fmadd_ps
#define vmul _mm512_mul_ps
#define vsub _mm512_sub_ps
#define vadd _mm512_add_ps
#define vmax _mm512_max_ps
#define vexp exp16
static inline float hmax(vf x) { return _mm512_reduce_max_ps(x); }
static inline float hsum(vf x) { return _mm512_reduce_add_ps(x); }
#elif defined(__AVX2__)
typedef __m256 vf;
#define W 8
#define ROWS 2
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vset1 _mm256_set1_ps
#define vzero _mm256_setzero_ps
#define vfma _mm256_fmadd_ps
#define vmul _mm256_mul_ps
#define vsub _mm256_sub_ps
#define vadd _mm256_add_ps
#define vmax _mm256_max_ps
#define vexp exp8
static inline float hmax(vf x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
static inline float hsum(vf x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

#ifdef W
#define NV 4      /* vectors of a micro-kernel's row: 4 W keys (scores) or 4 W dims (values) */

/* sc[r][0..BK) = qs[r] . kt[., 0..BK) for rows r0 .. r0 + ROWS (qs: (BQ, D) pre-scaled queries,
   kt: (D, BK) one tile of keys transposed), and rmx[r] (W floats) their lane-wise maxima */
static inline void score_rows(const float *qs, int64_t r0, const float *kt, int64_t D, float *sc, float *rmx) {
    for (int64_t jj = 0; jj < BK; jj += NV * W) {
        vf acc[ROWS][NV];
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; r++)
#pragma GCC unroll 8
            for (int c = 0; c < NV; c++) acc[r][c] = vzero();
        for (int64_t d = 0; d < D; d++) {
            const float *krow = kt + d * BK + jj;
            vf kv[NV];
#pragma GCC unroll 8
            for (int c = 0; c < NV; c++) kv[c] = vload(krow + c * W);
#pragma GCC unroll 8
            for (int r = 0; r < ROWS; r++) {
                const vf qv = vset1(qs[(r0 + r) * D + d]);
#pragma GCC unroll 8
                for (int c = 0; c < NV; c++) acc[r][c] = vfma(qv, kv[c], acc[r][c]);
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; r++)
#pragma GCC unroll 8
            for (int c = 0; c < NV; c++) vstore(sc + (r0 + r) * BK + jj + c * W, acc[r][c]);
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; r++) {
            vf mx = jj == 0 ? acc[r][0] : vmax(vload(rmx + (r0 + r) * W), acc[r][0]);
#pragma GCC unroll 8
            for (int c = 1; c < NV; c++) mx = vmax(mx, acc[r][c]);
            vstore(rmx + (r0 + r) * W, mx);
        }
    }
}

/* o[r] += p[r][0..n) . v[j0 .. j0 + n) for rows r0 .. r0 + ROWS, dims dd .. dd + C W (o: BQ rows
   o_row apart, p: (BQ, BK)); C a constant, so the accumulators stay in registers */
#define VALUE_ROWS(C)                                                                            \
    do {                                                                                         \
        vf acc[ROWS][C];                                                                         \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++)                                   \
            _Pragma("GCC unroll 8") for (int c = 0; c < C; c++)                                  \
                acc[r][c] = vload(o + (r0 + r) * o_row + dd + c * W);                                \
        for (int64_t j = 0; j < n; j++) {                                                        \
            const float *vrow = v + (j0 + j) * v_row + dd;                                       \
            vf vv[C];                                                                            \
            _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) vv[c] = vload(vrow + c * W);     \
            _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) {                             \
                const vf pv = vset1(p[(r0 + r) * BK + j]);                                       \
                _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) acc[r][c] = vfma(pv, vv[c], acc[r][c]); \
            }                                                                                    \
        }                                                                                        \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++)                                   \
            _Pragma("GCC unroll 8") for (int c = 0; c < C; c++)                                  \
                vstore(o + (r0 + r) * o_row + dd + c * W, acc[r][c]);                                \
    } while (0)

static inline void value_rows(const float *p, int64_t r0, const float *v, int64_t v_row, int64_t j0, int64_t n,
                              int64_t D, float *o, int64_t o_row) {
    int64_t dd = 0;
    for (; dd + NV * W <= D; dd += NV * W) VALUE_ROWS(NV);
    for (; dd < D; dd += W) VALUE_ROWS(1);
}

/* A reduced call's plan (causal_attention_reduced): the request, and per key tile its column bins
   as one-hot rows, so that a row's bin sums are one more value product, o_bins += p . onehot */
typedef struct {
    const attention_reduction *red;
    int64_t bin_row;       /* floats of a row's bin accumulator: bins rounded up to W, and a tile's width past them */
    const int64_t *bin0;   /* per key tile: its first bin */
    const int64_t *width;  /* per key tile: its one-hot width, a multiple of W (0: no key of the tile in a bin) */
    const float *onehot;   /* per key tile, (BK, width) in a slot of BK x BK: key j's row is 1 at bin(j) - bin0 */
    int64_t raw_row;       /* floats of a row's raw window scores: d - c rounded up to W */
} plan;

/* a thread's buffers for one item's reduced rows (BQ rows each) */
typedef struct {
    float *bins, *raw, *topv;
    int32_t *topi;
} scratch;

/* Before a tile's e^x: row r's raw scores s (keys j0 .. j0 + valid seen, `top` their maximum) kept
   where the window's columns meet them, and offered to the row's top k (sorted, heaviest first;
   a tile no better than the k-th best is skipped whole). */
static inline void keep_scores(const plan *pl, const scratch *ws, int64_t r, const float *s, int64_t j0,
                               int64_t valid, float top) {
    const attention_reduction *red = pl->red;
    const int64_t lo = red->col0 > j0 ? red->col0 : j0, hi = red->col1 < j0 + valid ? red->col1 : j0 + valid;
    if (lo >= hi) return;
    if (red->window != NULL) memcpy(ws->raw + r * pl->raw_row + (lo - red->col0), s + (lo - j0), sizeof(float) * (hi - lo));
    const int64_t k = red->k;
    if (k <= 0 || top <= ws->topv[r * k + k - 1]) return;
    float *tv = ws->topv + r * k;
    int32_t *ti = ws->topi + r * k;
    for (int64_t j = lo; j < hi; j++) {
        const float x = s[j - j0];
        if (x <= tv[k - 1]) continue;
        int64_t i = k - 1;  /* after equal ones: of equal scores the earlier key comes first */
        for (; i > 0 && tv[i - 1] < x; i--) { tv[i] = tv[i - 1]; ti[i] = ti[i - 1]; }
        tv[i] = x;
        ti[i] = (int32_t)j;
    }
}

/* Rows ra .. rb of an item, done: their bin sums, top k and window as probabilities (divided by
   the row's sum l; e^(x - m) with the row's final maximum m) into the request's outputs of head
   `slot`. pos0: the position of the item's row 0. */
static void emit_rows(const plan *pl, const scratch *ws, int64_t slot, int64_t ra, int64_t rb, int64_t pos0,
                      const float *m, const float *l) {
    const attention_reduction *red = pl->red;
    const int64_t cols = red->col1 - red->col0, k = red->k;
    for (int64_t r = ra; r < rb; r++) {
        const int64_t at = slot * (red->row1 - red->row0) + pos0 + r - red->row0;  /* the row among the outputs' */
        const float inv = 1.0f / hsum(vload(l + r * W));
        if (red->bin_sums != NULL) {
            const float *src = ws->bins + r * pl->bin_row;
            float *dst = red->bin_sums + at * red->bins;
            for (int64_t b = 0; b < red->bins; b++) dst[b] = src[b] * inv;
        }
        float *tw = red->top_weights + at * k;
        int32_t *tp = red->top_positions + at * k;
        for (int64_t i = 0; i < k; i++) {
            const float x = ws->topv[r * k + i];
            const float w = x == -INFINITY ? 0.0f : expf(x - m[r]) * inv;
            int64_t j = i;  /* scores that round to one weight: the earlier key first, as torch.topk orders them */
            for (; j > 0 && w > 0.0f && tw[j - 1] == w && tp[j - 1] > ws->topi[r * k + i]; j--) {
                tw[j] = tw[j - 1];
                tp[j] = tp[j - 1];
            }
            tw[j] = w > 0.0f ? w : 0.0f;
            tp[j] = w > 0.0f ? ws->topi[r * k + i] : -1;  /* weight 0: no link */
        }
        if (red->window == NULL) continue;
        const float *raw = ws->raw + r * pl->raw_row;
        const vf mv = vset1(m[r]), iv = vset1(inv);
        float p[W];
        for (int64_t j = 0; j < cols; j += W) {
            vstore(p, vmul(vexp(vsub(vload(raw + j), mv)), iv));
            const int64_t e = cols - j < W ? cols - j : W;
            for (int64_t i = 0; i < e; i++)  /* vexp clamps at -88: below, expf's subnormals, 0 past them and for unseen keys */
                if (raw[j + i] - m[r] < -87.0f) p[i] = expf(raw[j + i] - m[r]) * inv;
            if (red->window_store == 0) {
                memcpy((float *)red->window + at * cols + j, p, sizeof(float) * e);
            } else if (red->window_store == 1) {
                _Float16 *dst = (_Float16 *)red->window + at * cols + j;
                for (int64_t i = 0; i < e; i++) dst[i] = (_Float16)p[i];
            } else {  /* uint8 steps of window_scale, rounded half to even as torch rounds */
                uint8_t *dst = (uint8_t *)red->window + at * cols + j;
                for (int64_t i = 0; i < e; i++) dst[i] = (uint8_t)fminf(fmaxf(nearbyintf(p[i] / red->window_scale), 0.0f), 255.0f);
            }
        }
    }
}

/* One work item: query head h, queries t0 .. t0 + nq (nq <= BQ, a multiple of ROWS in the
   buffers: rows past nq are zero queries whose results are dropped). With a plan (pl != NULL),
   the rows the request covers also keep their reductions in ws; inlined at both calls, so the
   plain kernel's copy has none of it. */
static inline __attribute__((always_inline)) void
attend_tile(const float *q, int64_t q_head, int64_t q_row, const float *kt, const float *v, int64_t v_row, int64_t T,
            int64_t S, int64_t D, float scale, int64_t H, int64_t h, int64_t t0, int64_t nq, float *out, float *qs,
            float *sc, float *rmx, float *o, float *m, float *l, const plan *pl, const scratch *ws) {
    const int64_t offset = S - T;  /* query t's position is offset + t */
    const int64_t rows = (nq + ROWS - 1) / ROWS * ROWS;
    /* the item's rows ra .. rb the request covers (none: ra = rb) */
    const int64_t slot = pl != NULL ? pl->red->slot[h] : -1;
    int64_t ra = 0, rb = 0;
    if (slot >= 0) {
        const int64_t a = pl->red->row0 - offset - t0, b = pl->red->row1 - offset - t0;
        ra = a < 0 ? 0 : a > nq ? nq : a;
        rb = b < 0 ? 0 : b > nq ? nq : b;
    }
    const int reduced = ra < rb, binned = reduced && pl->red->bin_sums != NULL;
    const int64_t ra_rows = ra / ROWS * ROWS, rb_rows = (rb + ROWS - 1) / ROWS * ROWS;  /* whole micro-kernels */
    int64_t bins_seen = 0;  /* the bins of the tiles so far, the ones a new maximum rescales */
    if (binned) memset(ws->bins + ra_rows * pl->bin_row, 0, sizeof(float) * (rb_rows - ra_rows) * pl->bin_row);
    if (reduced && pl->red->window != NULL)
        for (int64_t i = ra * pl->raw_row; i < rb * pl->raw_row; i++) ws->raw[i] = -INFINITY;
    if (reduced)
        for (int64_t i = ra * pl->red->k; i < rb * pl->red->k; i++) ws->topv[i] = -INFINITY;
    memset(qs, 0, sizeof(float) * rows * D);
    memset(o, 0, sizeof(float) * rows * D);
    for (int64_t r = 0; r < nq; r++) {
        const float *src = q + h * q_head + (t0 + r) * q_row;
        for (int64_t d = 0; d < D; d++) qs[r * D + d] = src[d] * scale;
    }
    for (int64_t r = 0; r < rows; r++) m[r] = -INFINITY;
    memset(l, 0, sizeof(float) * rows * W);  /* each row's sum, W lanes until the end */
    const int64_t kend = offset + t0 + nq;  /* keys the tile's last query sees */
    for (int64_t j0 = 0; j0 < kend; j0 += BK) {
        const int64_t n = kend - j0 < BK ? kend - j0 : BK;  /* keys of this tile any query sees */
        for (int64_t r = 0; r < rows; r += ROWS) score_rows(qs, r, kt + j0 * D, D, sc, rmx);
        for (int64_t r = 0; r < nq; r++) {
            float *s = sc + r * BK;
            const int64_t seen = offset + t0 + r + 1 - j0;  /* keys of this tile query r sees */
            if (seen <= 0) { memset(s, 0, sizeof(float) * BK); continue; }
            const int64_t valid = seen < BK ? seen : BK;
            vf mx = vset1(-INFINITY), sum = vzero();
            if (valid == BK) {  /* every key of the tile: the maximum from score_rows, one pass for e^x and the sum */
                mx = vload(rmx + r * W);
            } else {  /* the diagonal: keys past the query's position weigh 0 */
                for (int64_t j = valid; j < BK; j++) s[j] = -INFINITY;
                for (int64_t j = 0; j < BK; j += W) mx = vmax(mx, vload(s + j));
            }
            const float top = hmax(mx);
            const int keep = reduced && r >= ra && r < rb;
            if (keep) keep_scores(pl, ws, r, s, j0, valid, top);
            const float m_new = fmaxf(m[r], top);
            const float alpha = m_new > m[r] ? expf(m[r] - m_new) : 1.0f;  /* 0 at the first tile (m = -inf) */
            const vf mv = vset1(m_new);
            if (valid == BK) {
                for (int64_t j = 0; j < BK; j += W) {
                    const vf e = vexp(vsub(vload(s + j), mv));
                    vstore(s + j, e);
                    sum = vadd(sum, e);
                }
            } else {
                for (int64_t j = 0; j < BK; j += W) vstore(s + j, vexp(vsub(vload(s + j), mv)));
                for (int64_t j = valid; j < BK; j++) s[j] = 0.0f;  /* e^x is clamped at x = -88: tiny, not 0 */
                for (int64_t j = 0; j < BK; j += W) sum = vadd(sum, vload(s + j));
            }
            vstore(l + r * W, alpha == 1.0f ? vadd(vload(l + r * W), sum) : vfma(vload(l + r * W), vset1(alpha), sum));
            m[r] = m_new;
            if (alpha != 1.0f) {
                const vf av = vset1(alpha);
                for (int64_t d = 0; d < D; d += W) vstore(o + r * D + d, vmul(vload(o + r * D + d), av));
                if (binned && keep) {  /* the bin sums are a value accumulator: rescaled with it */
                    float *b = ws->bins + r * pl->bin_row;
                    for (int64_t i = 0; i < bins_seen; i += W) vstore(b + i, vmul(vload(b + i), av));
                }
            }
        }
        for (int64_t r = nq; r < rows; r++) memset(sc + r * BK, 0, sizeof(float) * BK);
        for (int64_t r = 0; r < rows; r += ROWS) value_rows(sc, r, v, v_row, j0, n, D, o, D);
        if (binned && pl->width[j0 / BK] > 0) {  /* o_bins += p . onehot: each row's weight on each bin */
            const int64_t tile = j0 / BK, b0 = pl->bin0[tile], w = pl->width[tile];
            for (int64_t r = ra_rows; r < rb_rows; r += ROWS)
                value_rows(sc, r, pl->onehot + tile * BK * BK, w, 0, n, w, ws->bins + b0, pl->bin_row);
            bins_seen = b0 + w > bins_seen ? b0 + w : bins_seen;
        }
    }
    for (int64_t r = 0; r < nq; r++) {
        float *dst = out + ((t0 + r) * H + h) * D;
        const float inv = 1.0f / hsum(vload(l + r * W));
        for (int64_t d = 0; d < D; d++) dst[d] = o[r * D + d] * inv;
    }
    if (reduced) emit_rows(pl, ws, slot, ra, rb, offset + t0, m, l);
}

/* The bins' one-hot tiles of a plan (bin_sums asked): per key tile of BK, the bins its keys within
   [c, d) fall in. 2 when memory cannot be had. */
static int plan_bins(plan *pl, int64_t S, int64_t Sp, int64_t **bin0, float **onehot) {
    const attention_reduction *red = pl->red;
    const int64_t tiles = Sp / BK;
    *bin0 = calloc((size_t)(2 * tiles), sizeof(int64_t));
    *onehot = calloc((size_t)(tiles * BK * BK), sizeof(float));
    if (*bin0 == NULL || *onehot == NULL) return 2;
    int64_t *width = *bin0 + tiles;
    const int64_t end = red->col1 < S ? red->col1 : S;
    int64_t bin = 0;  /* key j's bin: edges[bin] <= j < edges[bin + 1], j rising */
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t lo = red->col0 > t * BK ? red->col0 : t * BK, hi = end < (t + 1) * BK ? end : (t + 1) * BK;
        if (lo >= hi) continue;
        for (; bin + 1 < red->bins && red->col_edges[bin + 1] <= lo; bin++) {}
        int64_t last = bin;
        for (; last + 1 < red->bins && red->col_edges[last + 1] <= hi - 1; last++) {}
        (*bin0)[t] = bin;
        width[t] = (last - bin + W) / W * W;
        float *tile = *onehot + t * BK * BK;
        for (int64_t j = lo, b = bin; j < hi; j++) {
            for (; b + 1 < red->bins && red->col_edges[b + 1] <= j; b++) {}
            tile[(j - t * BK) * width[t] + b - bin] = 1.0f;
        }
    }
    pl->bin0 = *bin0;
    pl->width = width;
    pl->onehot = *onehot;
    pl->bin_row = (red->bins + W - 1) / W * W + BK;
    return 0;
}

/* Both entry points: the plain kernel (pl NULL) and the reduced one. */
static int attend(const float *q, int64_t q_head, int64_t q_row, const float *k, int64_t k_head, int64_t k_row,
                  const float *v, int64_t v_head, int64_t v_row, int64_t H, int64_t K, int64_t T, int64_t S,
                  int64_t D, float scale, float *out, plan *pl) {
    if (D % W != 0 || D > MAX_D || T <= 0 || S < T || K <= 0 || H % K != 0) return 1;
    const int64_t Sp = (S + BK - 1) / BK * BK;  /* keys padded to whole tiles (zeros) */
    int64_t *bin0 = NULL;
    float *onehot = NULL;
    if (pl != NULL && pl->red->bin_sums != NULL && plan_bins(pl, S, Sp, &bin0, &onehot) != 0) {
        free(bin0);
        free(onehot);
        return 2;
    }
    float *kt = aligned_alloc(64, sizeof(float) * (size_t)(K * D * Sp));
    if (kt == NULL) {
        free(bin0);
        free(onehot);
        return 2;
    }
    const int64_t G = H / K, tiles = (T + BQ - 1) / BQ;
    int failed = 0;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t kh = 0; kh < K; kh++) {
            float *dst = kt + kh * D * Sp;  /* tile by tile, each (D, BK): a tile's rows side by side in memory */
            memset(dst + (Sp - BK) * D, 0, sizeof(float) * BK * D);
            for (int64_t s = 0; s < S; s++) {
                const float *src = k + kh * k_head + s * k_row;
                float *tile = dst + (s / BK) * BK * D + s % BK;
                for (int64_t d = 0; d < D; d++) tile[d * BK] = src[d];
            }
        }
        float *qs = aligned_alloc(64, sizeof(float) * BQ * (2 * MAX_D + BK + 2 * W + 1));  /* BQ floats: a multiple of 64 bytes */
        float *o = qs + BQ * MAX_D, *sc = o + BQ * MAX_D, *rmx = sc + BQ * BK, *l = rmx + BQ * W, *m = l + BQ * W;
        scratch ws = {NULL, NULL, NULL, NULL};
        int lacking = qs == NULL;
        if (pl != NULL) {
            const attention_reduction *red = pl->red;
            const size_t top = (size_t)(BQ * (red->k > 0 ? red->k : 0));
            ws.bins = red->bin_sums != NULL ? malloc(sizeof(float) * BQ * pl->bin_row) : NULL;
            ws.raw = red->window != NULL ? malloc(sizeof(float) * (BQ * pl->raw_row + W)) : NULL;
            ws.topv = malloc(sizeof(float) * (top + 1));
            ws.topi = malloc(sizeof(int32_t) * (top + 1));
            lacking |= (red->bin_sums != NULL && ws.bins == NULL) || (red->window != NULL && ws.raw == NULL)
                       || ws.topv == NULL || ws.topi == NULL;
        }
        if (lacking) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < H * tiles; item++) {
            if (failed) continue;
            const int64_t tile = tiles - 1 - item / H, h = item % H;  /* the longest tiles first */
            const int64_t t0 = tile * BQ, nq = T - t0 < BQ ? T - t0 : BQ;
            if (pl == NULL)
                attend_tile(q, q_head, q_row, kt + (h / G) * D * Sp, v + (h / G) * v_head, v_row, T, S, D, scale,
                            H, h, t0, nq, out, qs, sc, rmx, o, m, l, NULL, NULL);
            else
                attend_tile(q, q_head, q_row, kt + (h / G) * D * Sp, v + (h / G) * v_head, v_row, T, S, D, scale,
                            H, h, t0, nq, out, qs, sc, rmx, o, m, l, pl, &ws);
        }
        free(qs);
        free(ws.bins);
        free(ws.raw);
        free(ws.topv);
        free(ws.topi);
    }
    free(kt);
    free(bin0);
    free(onehot);
    return failed ? 2 : 0;
}
#endif

int causal_attention(const float *q, int64_t q_head, int64_t q_row, const float *k, int64_t k_head, int64_t k_row,
                     const float *v, int64_t v_head, int64_t v_row, int64_t H, int64_t K, int64_t T, int64_t S,
                     int64_t D, float scale, float *out) {
#ifndef W
    (void)q; (void)q_head; (void)q_row; (void)k; (void)k_head; (void)k_row; (void)v; (void)v_head; (void)v_row;
    (void)H; (void)K; (void)T; (void)S; (void)D; (void)scale; (void)out;
    return 1;
#else
    return attend(q, q_head, q_row, k, k_head, k_row, v, v_head, v_row, H, K, T, S, D, scale, out, NULL);
#endif
}

int causal_attention_reduced(const float *q, int64_t q_head, int64_t q_row, const float *k, int64_t k_head,
                             int64_t k_row, const float *v, int64_t v_head, int64_t v_row, int64_t H, int64_t K,
                             int64_t T, int64_t S, int64_t D, float scale, float *out,
                             const attention_reduction *red) {
#ifndef W
    (void)q; (void)q_head; (void)q_row; (void)k; (void)k_head; (void)k_row; (void)v; (void)v_head; (void)v_row;
    (void)H; (void)K; (void)T; (void)S; (void)D; (void)scale; (void)out; (void)red;
    return 1;
#else
    if (red->row0 < 0 || red->row1 < red->row0 || red->col0 < 0 || red->col1 < red->col0 || red->col1 > S
        || red->k < 0 || (red->bin_sums != NULL && (red->bins <= 0 || red->col_edges == NULL))
        || (red->k > 0 && (red->top_weights == NULL || red->top_positions == NULL))
        || red->window_store < 0 || red->window_store > 2)
        return 1;
    plan pl = {red, 0, NULL, NULL, NULL, (red->col1 - red->col0 + W - 1) / W * W};
    return attend(q, q_head, q_row, k, k_head, k_row, v, v_head, v_row, H, K, T, S, D, scale, out, &pl);
#endif
}
