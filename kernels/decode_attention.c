/* Paged decode attention on the CPU, float32: one query token per sequence against its cached K/V
 * read in place through its block table. The torch reference (kernels/attention.py:
 * paged_decode_attention_ref) first gathers each layer's whole context into a buffer (K and V
 * copied once more per layer and step) and then runs SDPA; at batch 1 on smollm2-135m that was
 * ~18% of a decode step. Built with quant_matmul.c by kernels/quant_build.py.
 *
 * Per (sequence, KV head): the scores of its query heads over the context (scale * q.k), a
 * softmax in float32 (max subtracted), then the probability-weighted sum of V, divided once by the
 * sum at the end.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* q, out: [batch, heads, dim]; k_cache, v_cache: [num_blocks, block_size, kv_heads, dim];
 * block_tables: [batch, max_blocks]; context_lens: [batch]. Returns 0, or -1 for bad shapes, a
 * length the table cannot hold or a block id outside the cache (checked before any read). */
int decode_attention(const float *q, const float *k_cache, const float *v_cache, const int64_t *block_tables,
                     const int64_t *context_lens, float *out, int64_t batch, int64_t heads, int64_t kv_heads,
                     int64_t dim, int64_t block_size, int64_t max_blocks, int64_t num_blocks, float scale,
                     int threads) {
    if (kv_heads <= 0 || heads % kv_heads || dim <= 0 || block_size <= 0) return -1;
    for (int64_t b = 0; b < batch; b++) {
        if (context_lens[b] <= 0 || context_lens[b] > max_blocks * block_size) return -1;
        for (int64_t i = 0; i < (context_lens[b] + block_size - 1) / block_size; i++)
            if (block_tables[b * max_blocks + i] < 0 || block_tables[b * max_blocks + i] >= num_blocks) return -1;
    }
    const int64_t group = heads / kv_heads, row = kv_heads * dim;
    int status = 0;
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1) collapse(2)
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t g = 0; g < kv_heads; g++) {
            const int64_t len = context_lens[b];
            float *scores = malloc((size_t)(group * len) * sizeof(float));
            if (scores == NULL) { status = -1; continue; }
            const float *qg = q + (b * heads + g * group) * dim;
            float *og = out + (b * heads + g * group) * dim;
            for (int64_t t = 0; t < len; t++) {
                const float *k = k_cache + (block_tables[b * max_blocks + t / block_size] * block_size
                                            + t % block_size) * row + g * dim;
                for (int64_t h = 0; h < group; h++) {
                    float s = 0.0f;
                    #pragma omp simd reduction(+:s)
                    for (int64_t d = 0; d < dim; d++) s += qg[h * dim + d] * k[d];
                    scores[h * len + t] = s * scale;
                }
            }
            float sums[group];
            for (int64_t h = 0; h < group; h++) {
                float *sc = scores + h * len, mx = -INFINITY, sum = 0.0f;
                for (int64_t t = 0; t < len; t++) mx = fmaxf(mx, sc[t]);
                for (int64_t t = 0; t < len; t++) { sc[t] = expf(sc[t] - mx); sum += sc[t]; }
                sums[h] = sum;
                memset(og + h * dim, 0, (size_t)dim * sizeof(float));
            }
            for (int64_t t = 0; t < len; t++) {
                const float *v = v_cache + (block_tables[b * max_blocks + t / block_size] * block_size
                                            + t % block_size) * row + g * dim;
                for (int64_t h = 0; h < group; h++) {
                    const float p = scores[h * len + t];
                    #pragma omp simd
                    for (int64_t d = 0; d < dim; d++) og[h * dim + d] += p * v[d];
                }
            }
            for (int64_t h = 0; h < group; h++)
                for (int64_t d = 0; d < dim; d++) og[h * dim + d] /= sums[h];
            free(scores);
        }
    }
    return status;
}
