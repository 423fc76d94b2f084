/* A decode step's rotary embedding and KV write on the CPU, in one call: q and k of the fused
 * q/k/v product rotated in place, then k and v written into the paged cache at their slots. torch
 * runs this as a dozen operators a layer (views, a roll, two products, a sum, slices and two
 * index_copy_), each dispatched; at batch 1 their dispatch costs more than their arithmetic.
 *
 * The rotation is model/llama.py:apply_rope's, to the bit: x*cos + roll(x, dim/2)*signed_sin,
 * each product rounded on its own (no fused multiply-add). Built with the other kernels by
 * kernels/quant_build.py; the reference is apply_rope and index_copy_ (kernels/rope_kv.py). */
#include <stdint.h>
#include <string.h>

/* qkv: [n, heads + 2 * kv_heads, dim], q heads, then k, then v; cos, ssin: [n, dim];
 * k_cache, v_cache: [num_slots, kv_heads, dim]; slots: [n]. Returns 0, or -1 (nothing written)
 * for an odd dim or a slot outside the cache. */
__attribute__((optimize("fp-contract=off")))
int rope_kv_write(float *qkv, int64_t n, int64_t heads, int64_t kv_heads, int64_t dim, const float *cos,
                  const float *ssin, float *k_cache, float *v_cache, const int64_t *slots, int64_t num_slots) {
    if (dim % 2 || dim > 1024) return -1;
    for (int64_t t = 0; t < n; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
    const int64_t half = dim / 2, width = (heads + 2 * kv_heads) * dim, row = kv_heads * dim;
    float rotated[1024];
    for (int64_t t = 0; t < n; t++) {
        const float *c = cos + t * dim, *s = ssin + t * dim;
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            float *x = qkv + t * width + h * dim;
            for (int64_t i = 0; i < dim; i++) {
                float a = x[i] * c[i], b = x[i < half ? i + half : i - half] * s[i];
                rotated[i] = a + b;
            }
            memcpy(x, rotated, (size_t)dim * sizeof(float));
        }
        memcpy(k_cache + slots[t] * row, qkv + t * width + heads * dim, (size_t)row * sizeof(float));
        memcpy(v_cache + slots[t] * row, qkv + t * width + (heads + kv_heads) * dim, (size_t)row * sizeof(float));
    }
    return 0;
}
