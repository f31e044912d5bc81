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

   causal_attention_reduced does the same and, for the query heads and rows its request
   (attention_reduction, attnlens_kernels.h) asks, reduces the maps from those very scores, so
   /attention's overview needs no second q K^T (model/analysis/attention_maps.py):
     bin sums   each row's probability on each column bin: one more value product, the tile's
                probabilities times one-hot bins, rescaled with the output when the maximum rises
                and divided by the row's sum at the end
     top k      the row's k heaviest key tiles kept (their raw scores), the k best picked from
                them at the end (a larger k: from the row's raw scores); the order by raw score
                is the order by probability, weighed with the row's final maximum and sum
     window     the raw scores of the window's columns kept, normalised at the end into float32,
                float16 or uint8 steps
   The plain kernel is the same code inlined without a request: none of it runs there.

   Returns 0, 1 when D is not a multiple of the vector width or over MAX_D (the caller uses
   torch's kernel) or a request is malformed, 2 when memory for the transposed keys or a
   thread's tiles cannot be had. */

#include <float.h>
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
#define vmin _mm512_min_ps
#define vdiv _mm512_div_ps
#define vround(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vstorei(p, x) _mm512_storeu_si512((void *)(p), _mm512_cvtps_epi32(x))
#define vexp exp16
static inline float hmax(vf x) { return _mm512_reduce_max_ps(x); }
static inline float hsum(vf x) { return _mm512_reduce_add_ps(x); }
static inline uint32_t above(vf x, vf y) { return _mm512_cmp_ps_mask(x, y, _CMP_GT_OQ); }  /* lanes with x > y */
static inline uint32_t atleast(vf x, vf y) { return _mm512_cmp_ps_mask(x, y, _CMP_GE_OQ); }
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
#define vmin _mm256_min_ps
#define vdiv _mm256_div_ps
#define vround(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vstorei(p, x) _mm256_storeu_si256((__m256i *)(p), _mm256_cvtps_epi32(x))
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
static inline uint32_t above(vf x, vf y) { return (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(x, y, _CMP_GT_OQ)); }
static inline uint32_t atleast(vf x, vf y) { return (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(x, y, _CMP_GE_OQ)); }
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

/* a thread's buffers for one item's reduced rows (BQ rows each): bin accumulators; the raw scores
   of the window's columns (for a window, or a top k over W); for a top k up to W, each row's k
   heaviest tiles so far (their maxima, heaviest first, their first key and the buffer of BK raw
   scores each holds); and a row's top k (top_row: k, at least W) and chunk maxima while picked */
typedef struct {
    float *bins, *raw, *topv, *chunk_max;
    int32_t *topi;
    int64_t top_row;
    float *tile_max, *tiles;
    int32_t *tile_at, *tile_buf;
} scratch;

/* x at key j into a row's top W (v: scores, heaviest first, of equal ones the earlier key first;
   p: their key positions, as float bits) without a branch: the lanes ahead of x stay, x comes
   next, the rest move one lane down (the last drops) */
static inline void insert_top(vf *v, vf *p, float x, int32_t j) {
    const vf xv = vset1(x);
#if defined(__AVX512F__)
    const __m512i down = _mm512_set_epi32(14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 0);
    const __mmask16 stay = _mm512_cmp_ps_mask(*v, xv, _CMP_GT_OQ)
        | (_mm512_cmp_ps_mask(*v, xv, _CMP_EQ_OQ) & _mm512_cmplt_epi32_mask(_mm512_castps_si512(*p), _mm512_set1_epi32(j)));
    const __mmask16 after = (__mmask16)~((stay << 1) | 1);
    const vf jv = _mm512_castsi512_ps(_mm512_set1_epi32(j));
    *v = _mm512_mask_blend_ps(stay, _mm512_mask_blend_ps(after, xv, _mm512_permutexvar_ps(down, *v)), *v);
    *p = _mm512_mask_blend_ps(stay, _mm512_mask_blend_ps(after, jv, _mm512_permutexvar_ps(down, *p)), *p);
#else
    const __m256i down = _mm256_setr_epi32(0, 0, 1, 2, 3, 4, 5, 6);
    const __m256i ji = _mm256_set1_epi32(j);
    const vf stay = _mm256_or_ps(_mm256_cmp_ps(*v, xv, _CMP_GT_OQ), _mm256_and_ps(
        _mm256_cmp_ps(*v, xv, _CMP_EQ_OQ), _mm256_castsi256_ps(_mm256_cmpgt_epi32(ji, _mm256_castps_si256(*p)))));
    const vf after = _mm256_blend_ps(_mm256_xor_ps(_mm256_permutevar8x32_ps(stay, down),
                                                   _mm256_castsi256_ps(_mm256_set1_epi32(-1))), vzero(), 1);
    *v = _mm256_blendv_ps(_mm256_blendv_ps(xv, _mm256_permutevar8x32_ps(*v, down), after), *v, stay);
    *p = _mm256_blendv_ps(_mm256_blendv_ps(_mm256_castsi256_ps(ji), _mm256_permutevar8x32_ps(*p, down), after),
                          *p, stay);
#endif
}

/* lane k - 1 of v in every lane */
static inline vf lane_of(vf v, int64_t k) {
#if defined(__AVX512F__)
    return _mm512_permutexvar_ps(_mm512_set1_epi32((int)k), v);
#else
    return _mm256_permutevar8x32_ps(v, _mm256_set1_epi32((int)k));
#endif
}

/* x into the first k of a sorted list (tv heaviest first, after any equal to it), scalar */
static inline void insert_sorted(float *tv, int32_t *ti, int64_t k, float x, int32_t j) {
    if (x <= tv[k - 1]) return;
    int64_t i = k - 1;
    for (; i > 0 && tv[i - 1] < x; i--) { tv[i] = tv[i - 1]; ti[i] = ti[i - 1]; }
    tv[i] = x;
    ti[i] = j;
}

/* Before a tile's e^x: row r's raw scores s (keys j0 .. j0 + valid seen, mx their lane-wise
   maxima) where the window's columns meet them: kept whole (ws->raw), or for a top k up to W the
   tile kept if its maximum is among the row's k heaviest tiles' (no key of the k best lies in
   another: k tiles reach its tile's maximum), its keys outside the columns at -inf. */
static inline void keep_scores(const plan *pl, const scratch *ws, int64_t r, const float *s, int64_t j0,
                               int64_t valid, vf mx) {
    const attention_reduction *red = pl->red;
    const int64_t lo = red->col0 > j0 ? red->col0 : j0, hi = red->col1 < j0 + valid ? red->col1 : j0 + valid;
    if (lo >= hi) return;
    if (ws->raw != NULL) memcpy(ws->raw + r * pl->raw_row + (lo - red->col0), s + (lo - j0), sizeof(float) * (hi - lo));
    const int64_t k = red->k;
    if (ws->tiles == NULL) return;
    const int whole = lo == j0 && hi == j0 + valid;  /* every key the row saw of the tile is a column */
    float x = whole ? hmax(mx) : -INFINITY;
    for (int64_t j = lo; !whole && j < hi; j++) x = fmaxf(x, s[j - j0]);
    float *tm = ws->tile_max + r * k;
    if (x <= tm[k - 1]) return;  /* of equal maxima the earlier tile stays */
    int32_t *at = ws->tile_at + r * k, *buf = ws->tile_buf + r * k;
    const int32_t b = buf[k - 1];  /* the lightest tile's buffer takes this one */
    int64_t i = k - 1;
    for (; i > 0 && tm[i - 1] < x; i--) { tm[i] = tm[i - 1]; at[i] = at[i - 1]; buf[i] = buf[i - 1]; }
    tm[i] = x;
    at[i] = (int32_t)j0;
    buf[i] = b;
    float *dst = ws->tiles + (r * k + b) * BK;
    memcpy(dst, s, sizeof(float) * BK);  /* keys past `valid` are -inf already */
    for (int64_t j = j0; j < lo; j++) dst[j - j0] = -INFINITY;
    for (int64_t j = hi; j < j0 + BK; j++) dst[j - j0] = -INFINITY;
}

/* The keys key0 .. key0 + n (scores x) offered to a top k: k <= W in v, p (insert_top; W compared
   at once with the k-th best and `floor`, the few at least both inserted), else tv, ti
   (insert_sorted, in key order). */
static inline void offer_top(const float *x, int64_t n, int32_t key0, float floor, int64_t k, vf *v, vf *p,
                             float *tv, int32_t *ti) {
    for (int64_t j = 0; j < n; j += W) {
        uint32_t lanes = k <= W ? atleast(vload(x + j), vmax(vset1(floor), lane_of(*v, k - 1)))
                                : above(vload(x + j), vset1(fmaxf(floor, tv[k - 1])));
        if (n - j < W) lanes &= (1u << (n - j)) - 1;
        for (; lanes != 0; lanes &= lanes - 1) {
            const int64_t i = j + __builtin_ctz(lanes);
            if (k <= W)
                insert_top(v, p, x[i], key0 + (int32_t)i);
            else
                insert_sorted(tv, ti, k, x[i], key0 + (int32_t)i);
        }
    }
}

/* Row r's k best keys into tv, ti (heaviest first; of equal scores the earlier key first; -inf
   where fewer): k <= W from its kept tiles, in key order; else from its raw scores raw[0 .. n)
   (the window's columns it saw): the k-th largest maximum of their chunks of BK is a floor no key
   of the k best is under (k chunks reach it), so only the chunks reaching it are read again. */
static void top_of_row(const plan *pl, const scratch *ws, int64_t r, int64_t n, float *tv, int32_t *ti) {
    const int64_t k = pl->red->k;
    for (int64_t i = 0; i < ws->top_row; i++) tv[i] = -INFINITY;
    vf v = vload(tv), p = vzero();
    if (k <= W) {  /* the kept tiles, heaviest first: the k-th best rises soonest */
        const float *tm = ws->tile_max + r * k;
        const int32_t *at = ws->tile_at + r * k, *buf = ws->tile_buf + r * k;
        const float floor = fmaxf(tm[k - 1], -FLT_MAX);  /* keys under it are not among the k best; never -inf keys */
        for (int64_t i = 0; i < k && tm[i] > -INFINITY; i++)
            offer_top(ws->tiles + (r * k + buf[i]) * BK, BK, at[i], floor, k, &v, &p, tv, ti);
        vstore(tv, v);
        vstore((float *)ti, p);
        return;
    }
    const float *raw = ws->raw + r * pl->raw_row;
    const int64_t chunks = (n + BK - 1) / BK, col0 = pl->red->col0;
    for (int64_t t = 0; t < chunks; t++) {
        const int64_t end = n < (t + 1) * BK ? n : (t + 1) * BK;
        int64_t j = t * BK;
        vf mx = vset1(-INFINITY);
        for (; j + W <= end; j += W) mx = vmax(mx, vload(raw + j));
        float x = hmax(mx);
        for (; j < end; j++) x = fmaxf(x, raw[j]);
        ws->chunk_max[t] = x;
        insert_sorted(tv, ti, k, x, 0);  /* the chunks' k best maxima, for now */
    }
    const float floor = nextafterf(tv[k - 1], -INFINITY);  /* keys equal to it may be among the k best */
    for (int64_t i = 0; i < ws->top_row; i++) tv[i] = -INFINITY;
    for (int64_t t = 0; t < chunks; t++) {
        const int64_t end = n < (t + 1) * BK ? n : (t + 1) * BK;
        if (ws->chunk_max[t] > floor) offer_top(raw + t * BK, end - t * BK, (int32_t)(col0 + t * BK), floor, k, &v, &p, tv, ti);
    }
}

/* p (W lanes, e of them kept) into dst[0 .. e) as `store`: float32, float16, or uint8 steps of
   `step` (p / step rounded half to even, as torch rounds, clamped to 0 .. 255) */
static inline void store_probs(vf p, int64_t store, float step, void *dst, int64_t e) {
    if (store == 0) {
        float f[W];
        vstore(f, p);
        memcpy(dst, f, sizeof(float) * e);
        return;
    }
    if (store == 1) {
        uint16_t h[W];
#if defined(__AVX512F__)
        _mm256_storeu_si256((__m256i *)h, _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__)
        _mm_storeu_si128((__m128i *)h, _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
        float f[W];
        vstore(f, p);
        for (int i = 0; i < W; i++) { _Float16 x = (_Float16)f[i]; memcpy(h + i, &x, 2); }
#endif
        memcpy(dst, h, 2 * e);
        return;
    }
    const vf u = vmax(vzero(), vmin(vset1(255.0f), vround(vdiv(p, vset1(step)))));
    int32_t n[W];
    uint8_t b[W];
    vstorei(n, u);
    for (int i = 0; i < W; i++) b[i] = (uint8_t)n[i];
    memcpy(dst, b, e);
}

/* Rows ra .. rb of an item, done: their bin sums, top k and window as probabilities (divided by
   the row's sum l; e^(x - m) with the row's final maximum m) into the request's outputs of head
   `slot`. pos0: the position of the item's row 0. */
static void emit_rows(const plan *pl, const scratch *ws, int64_t slot, int64_t ra, int64_t rb, int64_t pos0,
                      const float *m, const float *l) {
    const attention_reduction *red = pl->red;
    const int64_t cols = red->col1 - red->col0, k = red->k;
    const int64_t size = red->window_store == 0 ? 4 : red->window_store == 1 ? 2 : 1;  /* a window cell's bytes */
    for (int64_t r = ra; r < rb; r++) {
        const int64_t at = slot * (red->row1 - red->row0) + pos0 + r - red->row0;  /* the row among the outputs' */
        const float inv = 1.0f / hsum(vload(l + r * W));
        if (red->bin_sums != NULL) {
            const float *src = ws->bins + r * pl->bin_row;
            float *dst = red->bin_sums + at * red->bins;
            for (int64_t b = 0; b < red->bins; b++) dst[b] = src[b] * inv;
        }
        /* the columns the row saw (the rest weigh 0): c .. min(d, its position + 1) */
        const int64_t pos = pos0 + r, seen_to = red->col1 < pos + 1 ? red->col1 : pos + 1;
        const int64_t seen = seen_to - red->col0 < 0 ? 0 : seen_to - red->col0;
        const float *raw = ws->raw != NULL ? ws->raw + r * pl->raw_row : NULL;
        if (k > 0) {
            float *tv = ws->topv;
            int32_t *ti = ws->topi;
            top_of_row(pl, ws, r, seen, tv, ti);
            float *tw = red->top_weights + at * k;
            int32_t *tp = red->top_positions + at * k;
            int64_t got = 0;
            for (int64_t i = 0; i < k; i++) {
                const float w = tv[i] == -INFINITY ? 0.0f : expf(tv[i] - m[r]) * inv;
                if (!(w > 0.0f)) break;  /* weight 0 (too few keys, or underflow): no link, nor any after it */
                int64_t j = got++;  /* scores that round to one weight: the earlier key first */
                for (; j > 0 && tw[j - 1] == w && tp[j - 1] > ti[i]; j--) { tw[j] = tw[j - 1]; tp[j] = tp[j - 1]; }
                tw[j] = w;
                tp[j] = ti[i];
            }
            for (int64_t i = got; i < k; i++) { tw[i] = 0.0f; tp[i] = -1; }
        }
        if (red->window == NULL) continue;
        char *dst = (char *)red->window + at * cols * size;
        const vf mv = vset1(m[r]), iv = vset1(inv), far = vset1(-87.0f);
        for (int64_t j = 0; j < seen; j += W) {
            const int64_t e = seen - j < W ? seen - j : W;  /* lanes past e: not kept */
            const vf x = vsub(vload(raw + j), mv);
            vf p = vmul(vexp(x), iv);
            if ((above(far, x) & (e == W ? ~0u : (1u << e) - 1)) != 0) {  /* vexp clamps at -88: expf's subnormals there, as torch's */
                float f[W];
                vstore(f, p);
                for (int i = 0; i < e; i++) if (raw[j + i] - m[r] < -87.0f) f[i] = expf(raw[j + i] - m[r]) * inv;
                p = vload(f);
            }
            store_probs(p, red->window_store, red->window_scale, dst + j * size, e);
        }
        memset(dst + seen * size, 0, (size_t)((cols - seen) * size));
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
    if (reduced && ws->tiles != NULL)
        for (int64_t i = ra * pl->red->k; i < rb * pl->red->k; i++) {
            ws->tile_max[i] = -INFINITY;
            ws->tile_buf[i] = (int32_t)(i % pl->red->k);
        }
    if (binned) memset(ws->bins + ra_rows * pl->bin_row, 0, sizeof(float) * (rb_rows - ra_rows) * pl->bin_row);
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
            const int keep = reduced && r >= ra && r < rb;
            if (keep && (ws->raw != NULL || ws->tiles != NULL)) keep_scores(pl, ws, r, s, j0, valid, mx);
            const float m_new = fmaxf(m[r], hmax(mx));
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
        scratch ws = {NULL, NULL, NULL, NULL, NULL, 0, NULL, NULL, NULL, NULL};
        int lacking = qs == NULL;
        if (pl != NULL) {
            const attention_reduction *red = pl->red;
            const int raw = red->window != NULL || red->k > W, tiles = red->k > 0 && red->k <= W;
            if (tiles) {
                ws.tile_max = malloc(sizeof(float) * (size_t)(BQ * red->k * (BK + 1)));
                ws.tiles = ws.tile_max + BQ * red->k;
                ws.tile_at = malloc(sizeof(int32_t) * (size_t)(2 * BQ * red->k));
                ws.tile_buf = ws.tile_at + BQ * red->k;
                lacking |= ws.tile_max == NULL || ws.tile_at == NULL;
            }
            ws.top_row = red->k > 0 ? (red->k + W - 1) / W * W : 0;
            ws.bins = red->bin_sums != NULL ? malloc(sizeof(float) * BQ * pl->bin_row) : NULL;
            ws.raw = raw ? malloc(sizeof(float) * (BQ * pl->raw_row + W)) : NULL;
            ws.topv = malloc(sizeof(float) * (size_t)(ws.top_row + pl->raw_row / BK + 1));
            ws.chunk_max = ws.topv + ws.top_row;
            ws.topi = malloc(sizeof(int32_t) * (size_t)(ws.top_row + 1));
            lacking |= (red->bin_sums != NULL && ws.bins == NULL) || (raw && ws.raw == NULL) || ws.topv == NULL
                       || ws.topi == NULL;
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
        free(ws.tile_max);
        free(ws.tile_at);
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
    /* columns may pass S: a prompt's piece (its rows see no key past S; those cells weigh 0) */
    if (red->row0 < 0 || red->row1 < red->row0 || red->col0 < 0 || red->col1 < red->col0
        || red->k < 0 || (red->bin_sums != NULL && (red->bins <= 0 || red->col_edges == NULL))
        || (red->k > 0 && (red->top_weights == NULL || red->top_positions == NULL))
        || red->window_store < 0 || red->window_store > 2)
        return 1;
    plan pl = {red, 0, NULL, NULL, NULL, (red->col1 - red->col0 + W - 1) / W * W};
    return attend(q, q_head, q_row, k, k_head, k_row, v, v_head, v_row, H, K, T, S, D, scale, out, &pl);
#endif
}
