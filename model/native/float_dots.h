/* Dot products of float32 rows, shared by float_matvec.c and packed_matmul.c (included, not compiled
   on its own): row_dot, one weight row with one row of x, and tile_dots, NR weight rows with up to
   MR rows of x, each pair summed exactly as row_dot sums it. packed_matmul.c sums its dequantized
   rows with these, so a packed product is the float32 product of the dequantized weights, bit for
   bit, whatever the rows of x. */

#ifndef ATTNLENS_FLOAT_DOTS_H
#define ATTNLENS_FLOAT_DOTS_H

#include <stdint.h>
#if defined(__AVX2__) || defined(__SSE__)
#include <immintrin.h>
#endif

#define AHEAD_BYTES 4096 /* float_matvec.c: reading ahead */

static inline void ask_ahead(const float *w) {
    __builtin_prefetch((const char *)w + AHEAD_BYTES, 0, 3);  /* prefetcht0 on x86 */
    __builtin_prefetch((const char *)w + AHEAD_BYTES + 64, 0, 3);
}

#ifdef __AVX512F__
/* v's 16 lanes summed in one fixed order, written out so that no compiler picks another: lanes j
   and j + 8, then i and i + 4 of those, then 0 and 2 beside 1 and 3, then the two (GCC's
   _mm512_reduce_add_ps) */
static inline float sum16(__m512 v) {
    const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 c = _mm_add_ps(b, _mm_shuffle_ps(b, b, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, _MM_SHUFFLE(0, 0, 0, 1))));
}

/* out[i] = sum16(v[i]) for 8 vectors at once, the same additions in the same pairs (bit for bit),
   by moving lanes between the vectors instead of reducing each alone */
static inline void sums8(const __m512 v[8], float *out) {
    __m512 p[4], q[2];
    for (int i = 0; i < 4; i++)  /* lanes j + j + 8: two vectors' 8 sums in one */
        p[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++)  /* i + i + 4: four vectors' 4 sums in one */
        q[i] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* 0 + 2 and 1 + 3: in 128-bit lane L, vector L's two (from q[0]) then vector L + 4's (q[1]) */
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(q[0], q[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(q[0], q[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(r, r, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(r, r, _MM_SHUFFLE(3, 1, 3, 1)));
    float lanes[16];
    _mm512_storeu_ps(lanes, t);
    for (int L = 0; L < 4; L++) {
        out[L] = lanes[4 * L];
        out[L + 4] = lanes[4 * L + 1];
    }
}

/* row_dot's sums after its 32-wide loop (`sum`, from k on): 8 at a time, then one by one */
static inline float row_rest(float sum, const float *w, const float *x, int64_t k, int64_t K) {
    if (k == K) return sum + 0.0f;  /* what the rest below adds when nothing is left (K a multiple of 32) */
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
    const __m256 a = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    sum += _mm_cvtss_f32(s);
    for (; k < K; k++) sum += w[k] * x[k];
    return sum;
}
#endif

/* w . x over K; `prefetch`: ask for the bytes ahead (the first pass over a weight row) */
static inline float row_dot(const float *w, const float *x, int64_t K, int prefetch) {
    int64_t k = 0;
#ifdef __AVX512F__
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    for (; k + 32 <= K; k += 32) {
        if (prefetch) ask_ahead(w + k);
        b0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k), b0);
        b1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 16), _mm512_loadu_ps(x + k + 16), b1);
    }
    return row_rest(sum16(_mm512_add_ps(b0, b1)), w, x, k, K);
#else
    float sum = 0.0f;
#ifdef __AVX2__
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (; k + 32 <= K; k += 32) {
        if (prefetch) ask_ahead(w + k);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
    }
    for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
    const __m256 a = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    sum += _mm_cvtss_f32(s);
#endif
    (void)prefetch;
    for (; k < K; k++) sum += w[k] * x[k];
    return sum;
#endif
}

#ifdef __AVX512F__
/* NR weight rows meet MR rows of x at once, every pair summed exactly as row_dot sums it (b0 over
   the first 16 of each 32 columns, b1 over the second, then row_rest): each weight vector loaded
   once for MR rows and each x vector once for NR weight rows, where row_dot loads both for every
   product. The pair's answer is the one-row answer, bit for bit. */
#define NR 4
#define MR 2
#define TILE_MIN_ROWS 9 /* rows of x from which the tiles are the faster (bench/README.md, issue 50) */
static inline __attribute__((always_inline)) void tile_dots(const float *w, const float *x, int64_t K, int nr,
                                                            int mr, int prefetch, const char *next, int next_lines,
                                                            float *out /* [nr][mr] */) {
    __m512 b0[NR][MR], b1[NR][MR];
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < mr; j++) b0[i][j] = b1[i][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        for (int l = 0; l < next_lines; l++) __builtin_prefetch(next + ((k / 32) * next_lines + l) * 64, 0, 2);  /* to L2 */
        __m512 xa[MR], xb[MR];
        for (int j = 0; j < mr; j++) {
            xa[j] = _mm512_loadu_ps(x + j * K + k);
            xb[j] = _mm512_loadu_ps(x + j * K + k + 16);
        }
        for (int i = 0; i < nr; i++) {
            if (prefetch) ask_ahead(w + i * K + k);
            const __m512 wa = _mm512_loadu_ps(w + i * K + k), wb = _mm512_loadu_ps(w + i * K + k + 16);
            for (int j = 0; j < mr; j++) {
                b0[i][j] = _mm512_fmadd_ps(wa, xa[j], b0[i][j]);
                b1[i][j] = _mm512_fmadd_ps(wb, xb[j], b1[i][j]);
            }
        }
    }
    if (nr * mr == 8 && k == K) {  /* a whole tile: its 8 sums at once */
        __m512 v[8];
        for (int i = 0; i < nr; i++)
            for (int j = 0; j < mr; j++) v[i * mr + j] = _mm512_add_ps(b0[i][j], b1[i][j]);
        sums8(v, out);
        for (int i = 0; i < 8; i++) out[i] = out[i] + 0.0f;  /* row_rest's, nothing left */
        return;
    }
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < mr; j++)
            out[i * mr + j] = row_rest(sum16(_mm512_add_ps(b0[i][j], b1[i][j])), w + i * K, x + j * K, k, K);
}

/* tile_dots with nr and mr constants (the sums stay in registers) */
static inline void tile(const float *w, const float *x, int64_t K, int nr, int mr, int prefetch, const char *next,
                        int next_lines, float *out) {
    switch (nr * 4 + mr) {
#define TILE_CASE(a, b) case a * 4 + b: tile_dots(w, x, K, a, b, prefetch, next, next_lines, out); break;
        TILE_CASE(1, 1) TILE_CASE(1, 2) TILE_CASE(2, 1) TILE_CASE(2, 2)
        TILE_CASE(3, 1) TILE_CASE(3, 2) TILE_CASE(4, 1) TILE_CASE(4, 2)
#undef TILE_CASE
        default: break;
    }
}

#endif

/* y[:, n0:n1] (+ bias) of y (M, N) = x (M, K) W^T, each element as float_matvec.c's kernels compute it
   (row_dot's sums, the one-row answer): from TILE_MIN_ROWS rows with AVX-512 in tiles of NR weight
   rows (n0 a multiple of NR), else row by row */
static inline void float_range(const float *x, int64_t M, int64_t K, const float *w, int64_t N, const float *bias,
                               float *y, int64_t n0, int64_t n1) {
#ifdef __AVX512F__
    if (M >= TILE_MIN_ROWS) {
        float out[NR * MR];
        /* while a tile's weight rows meet the rows of x (from cache after the first pass), the next
           tile's are asked for, a few lines each step of the passes: the memory streams them while
           the sums run, where the first pass would otherwise wait for them */
        const int64_t passes = (M + MR - 1) / MR, steps = K / 32 > 0 ? K / 32 : 1;
        const int64_t lines = (NR * K * (int64_t)sizeof(float) + 63) / 64;
        const int next_lines = (int)((lines + passes * steps - 1) / (passes * steps));  /* a step's share */
        for (int64_t g = n0; g < n1; g += NR) {
            const int nr = n1 - g < NR ? (int)(n1 - g) : NR;
            const char *next = (const char *)(w + (g + NR) * K);
            for (int64_t m0 = 0; m0 < M; m0 += MR) {
                const int mr = M - m0 < MR ? (int)(M - m0) : MR;
                const int64_t pass = m0 / MR;
                tile(w + g * K, x + m0 * K, K, nr, mr, m0 == 0 && g == n0, next + pass * steps * next_lines * 64,
                     next_lines, out);
                for (int i = 0; i < nr; i++)
                    for (int j = 0; j < mr; j++) y[(m0 + j) * N + g + i] = out[i * mr + j] + (bias ? bias[g + i] : 0.0f);
            }
        }
        return;
    }
#endif
    for (int64_t n = n0; n < n1; n++) {
        const float b = bias ? bias[n] : 0.0f;
        for (int64_t m = 0; m < M; m++) y[m * N + n] = row_dot(w + n * K, x + m * K, K, m == 0) + b;
    }
}

#endif
