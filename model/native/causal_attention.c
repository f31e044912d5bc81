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

/* o[r] += p[r][0..n) . v[j0 .. j0 + n) for rows r0 .. r0 + ROWS, dims dd .. dd + C W (o: (BQ, D),
   p: (BQ, BK)); C a constant, so the accumulators stay in registers */
#define VALUE_ROWS(C)                                                                            \
    do {                                                                                         \
        vf acc[ROWS][C];                                                                         \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++)                                   \
            _Pragma("GCC unroll 8") for (int c = 0; c < C; c++)                                  \
                acc[r][c] = vload(o + (r0 + r) * D + dd + c * W);                                \
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
                vstore(o + (r0 + r) * D + dd + c * W, acc[r][c]);                                \
    } while (0)

static inline void value_rows(const float *p, int64_t r0, const float *v, int64_t v_row, int64_t j0, int64_t n,
                              int64_t D, float *o) {
    int64_t dd = 0;
    for (; dd + NV * W <= D; dd += NV * W) VALUE_ROWS(NV);
    for (; dd < D; dd += W) VALUE_ROWS(1);
}

/* One work item: query head h, queries t0 .. t0 + nq (nq <= BQ, a multiple of ROWS in the
   buffers: rows past nq are zero queries whose results are dropped). */
static void attend_tile(const float *q, int64_t q_head, int64_t q_row, const float *kt,
                        const float *v, int64_t v_row, int64_t T, int64_t S, int64_t D, float scale,
                        int64_t H, int64_t h, int64_t t0, int64_t nq, float *out,
                        float *qs, float *sc, float *rmx, float *o, float *m, float *l) {
    const int64_t offset = S - T;  /* query t's position is offset + t */
    const int64_t rows = (nq + ROWS - 1) / ROWS * ROWS;
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
            }
        }
        for (int64_t r = nq; r < rows; r++) memset(sc + r * BK, 0, sizeof(float) * BK);
        for (int64_t r = 0; r < rows; r += ROWS) value_rows(sc, r, v, v_row, j0, n, D, o);
    }
    for (int64_t r = 0; r < nq; r++) {
        float *dst = out + ((t0 + r) * H + h) * D;
        const float inv = 1.0f / hsum(vload(l + r * W));
        for (int64_t d = 0; d < D; d++) dst[d] = o[r * D + d] * inv;
    }
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
    if (D % W != 0 || D > MAX_D || T <= 0 || S < T || K <= 0 || H % K != 0) return 1;
    const int64_t Sp = (S + BK - 1) / BK * BK;  /* keys padded to whole tiles (zeros) */
    float *kt = aligned_alloc(64, sizeof(float) * (size_t)(K * D * Sp));
    if (kt == NULL) return 2;
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
        if (qs == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < H * tiles; item++) {
            if (failed) continue;
            const int64_t tile = tiles - 1 - item / H, h = item % H;  /* the longest tiles first */
            const int64_t t0 = tile * BQ, nq = T - t0 < BQ ? T - t0 : BQ;
            attend_tile(q, q_head, q_row, kt + (h / G) * D * Sp, v + (h / G) * v_head, v_row, T, S, D, scale,
                        H, h, t0, nq, out, qs, sc, rmx, o, m, l);
        }
        free(qs);
    }
    free(kt);
    return failed ? 2 : 0;
#endif
}
