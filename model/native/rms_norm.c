/* RMSNorm of float32 rows: out = x / sqrt(mean(x^2) + eps) * w.

   torch's fused F.rms_norm takes ~15 us a call on a 576-wide row here, mostly its dispatch; a
   decode token of SmolLM2 makes 61 of them. A prefill's many rows are shared by the threads. The statistic is summed in float32 (in eight lanes,
   then across them), as torch does, to float32 rounding. */

#include <math.h>
#include <stdint.h>
#include "attnlens_kernels.h"

void rms_norm(const float *x, int64_t rows, int64_t C, const float *w, float eps, float *out) {
#pragma omp parallel for schedule(static) if (rows * C >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * C;
        float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int64_t i = 0;
        for (; i + 8 <= C; i += 8)
            for (int j = 0; j < 8; j++) lanes[j] += xr[i + j] * xr[i + j];
        float s = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
        for (; i < C; i++) s += xr[i] * xr[i];
        const float scale = 1.0f / sqrtf(s / (float)C + eps);
        float *o = out + r * C;
        for (int64_t k = 0; k < C; k++) o[k] = xr[k] * scale * w[k];
    }
}
