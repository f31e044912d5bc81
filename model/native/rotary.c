/* Rotary positions applied to a prefill's queries and keys in one pass (model/parts/positions.py):
   out = x * cos + roll(x, R / 2) * signed_sin over each head's D = R dims, where torch makes four
   passes over memory (the roll's copy, two products, the sum).

   x     (heads, T, D): head h's row t at x + h * x_head + t * x_row (dims contiguous)
   cos, signed_sin   (T, D) contiguous: row t's angles (signed_sin = -sin | sin)
   out   (T, heads, D) contiguous

   Each element is a * b + c * d rounded after each product and after the sum (no fused
   multiply-add: built with -ffp-contract=off), as torch's three operators round it: the same
   floats. */

#include <stdint.h>
#include "attnlens_kernels.h"

void rotary(const float *x, int64_t x_head, int64_t x_row, int64_t heads, int64_t T, int64_t D, const float *cos,
            const float *signed_sin, float *out) {
    const int64_t half = D / 2;
#pragma omp parallel for schedule(static) if (T * heads * D >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * D, *s = signed_sin + t * D;
        for (int64_t h = 0; h < heads; h++) {
            const float *xr = x + h * x_head + t * x_row;
            float *o = out + (t * heads + h) * D;
            for (int64_t i = 0; i < half; i++) o[i] = xr[i] * c[i] + xr[i + half] * s[i];
            for (int64_t i = half; i < D; i++) o[i] = xr[i] * c[i] + xr[i - half] * s[i];
        }
    }
}
