/* RMSNorm of float32 rows on the CPU: out = x / sqrt(mean(x^2) + eps) * w, one call for what
 * torch runs as six operators (power, mean, add, rsqrt and two products), each dispatched and
 * allocating; at batch 1 a decode step of smollm2-135m runs 61 of them on 576 values each.
 * Built with the other kernels by kernels/quant_build.py; the reference is F.rms_norm. */
#include <math.h>
#include <stdint.h>

void rms_norm(const float *x, const float *w, float *out, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        float ss = 0.0f;
        #pragma omp simd reduction(+:ss)
        for (int64_t i = 0; i < dim; i++) ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        #pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = xr[i] * inv * w[i];
    }
}
