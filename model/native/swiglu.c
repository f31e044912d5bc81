/* SwiGLU's product of a prefill's rows (model/parts/feedforward.py): out = silu(g) * u, with
   silu(g) = g / (1 + e^-g), where each row of h is [g | u] (2F floats: the fused gate-and-up
   product's output as it lies) and each row of out F floats.

   torch runs this as three passes over memory (F.silu, the product, and the chunk's strided
   reads); one pass reads h once and writes out once. e^x is vector_math.h's (within ~2 float32
   ulps of expf), its argument clamped to +-88 (e^88 is finite in float32; silu there is g e^g
   or g to well under float32's resolution): torch's silu to float32 rounding. */

#include <math.h>
#include <stdint.h>
#include "attnlens_kernels.h"
#include "vector_math.h"

static inline float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

void swiglu(const float *h, int64_t rows, int64_t F, float *out) {
#pragma omp parallel for schedule(static) if (rows * F >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = h + r * 2 * F, *u = g + F;
        float *o = out + r * F;
        int64_t i = 0;
#if defined(__AVX512F__)
        const __m512 one = _mm512_set1_ps(1.0f), lim = _mm512_set1_ps(88.0f);
        for (; i + 16 <= F; i += 16) {
            const __m512 gv = _mm512_loadu_ps(g + i);
            const __m512 e = exp16(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv), lim));
            _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + i)));
        }
#elif defined(__AVX2__)
        const __m256 one = _mm256_set1_ps(1.0f), lim = _mm256_set1_ps(88.0f);
        for (; i + 8 <= F; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 e = exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv), lim));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < F; i++) o[i] = silu_mul(g[i], u[i]);
    }
}
