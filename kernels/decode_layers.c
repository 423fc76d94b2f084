/* A decode step's layers in one C call, for a model whose every layer's four products are GGUF
 * blocks kept (model/llama.py: Transformer._decode_in_c): per layer
 *   qkv = rms_norm(x) @ Wqkv^T          quant_matmul_i8, the norm folded in
 *   rotary on q and k, k and v written   rope_kv_write (rope_kv.c)
 *   att = attention of q over the cache  decode_attention (decode_attention.c)
 *   h = att @ Wo^T + x                   quant_matmul_i8, the residual added as written
 *   gu = rms_norm(h) @ Wgate_up^T
 *   x = (silu(gate) * up) @ Wdown^T + h
 * The same C calls Block._compact_forward makes one by one from Python; what this adds is the
 * loop over layers and SwiGLU here, so a step crosses from Python to C once instead of five times
 * and three torch operators a layer (at batch 1 on smollm2-135m the Python, dispatch and
 * allocation between the calls was a tenth of the step).
 *
 * SwiGLU's exp is our own (decode_attention.c's exp512, within 2 ulp of expf): torch's SiLU uses another,
 * so the logits differ from the layer-by-layer path by float rounding carried through the int8
 * rounding of the next product's input (the tolerance tests/kernels/test_decode_layers.py and
 * docs/model.md state). Built only with the integer path (AVX-512 VNNI); elsewhere -2. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

int quant_matmul_i8(int qtype, const uint8_t *w, int64_t n_rows, int64_t k, const float *x, int64_t x_stride,
                    int64_t batch, float *out, int threads, const float *norm_w, float eps, const float *residual);
int rope_kv_write(float *qkv, int64_t n, int64_t heads, int64_t kv_heads, int64_t dim, const float *cos,
                  const float *ssin, float *k_cache, float *v_cache, const int64_t *slots, int64_t num_slots);
int decode_attention(const float *q, const float *k_cache, const float *v_cache, const int64_t *block_tables,
                     const int64_t *context_lens, float *out, int64_t batch, int64_t heads, int64_t kv_heads,
                     int64_t dim, int64_t block_size, int64_t max_blocks, int64_t num_blocks, float scale,
                     int threads);

/* One layer: its products' row-planar blocks and GGML types (q/k/v, o, gate/up, down), its two
 * norms' weights, and its K and V caches ([num_blocks, block_size, kv_heads, head_dim]). */
typedef struct {
    const uint8_t *w[4];
    int32_t type[4];
    const float *attn_norm, *ffn_norm;
    float *k_cache, *v_cache;
} compact_layer;

/* The model's widths and the cache's geometry, the same for every layer. */
typedef struct {
    int64_t dim, heads, kv_heads, head_dim, ffn_dim;
    int64_t num_blocks, block_size, max_blocks;
    float eps, scale;   /* the norms' epsilon; attention's scale (head_dim^-0.5, as Python rounds it) */
} decode_shape;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include <immintrin.h>

__m512 exp512(__m512 x);   /* decode_attention.c: within 2 ulp of expf */

/* act[b] = silu(gate) * up for each row's gate | up halves of gu [batch, 2 * ffn]. */
static void swiglu(const float *gu, float *act, int64_t batch, int64_t ffn) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t b = 0; b < batch; b++) {
        const float *g = gu + b * 2 * ffn, *u = g + ffn;
        float *o = act + b * ffn;
        for (int64_t i = 0; i < ffn; i += 16) {
            __mmask16 m = ffn - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (ffn - i)) - 1);
            __m512 gv = _mm512_maskz_loadu_ps(m, g + i), uv = _mm512_maskz_loadu_ps(m, u + i);
            __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
            _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(s, uv));
        }
    }
}

/* Scratch of one step: the layer's intermediate rows. */
typedef struct { float *qkv, *q, *att, *h, *gu, *act; } scratch;

static int one_layer(const compact_layer *l, const decode_shape *s, float *x, int64_t batch, scratch *t,
                     const float *cos, const float *ssin, const int64_t *slots, const int64_t *tables,
                     const int64_t *lens, int threads) {
    const int64_t qw = s->heads * s->head_dim, width = qw + 2 * s->kv_heads * s->head_dim;
    int st = quant_matmul_i8(l->type[0], l->w[0], width, s->dim, x, s->dim, batch, t->qkv, threads,
                             l->attn_norm, s->eps, NULL);
    st = st ? st : rope_kv_write(t->qkv, batch, s->heads, s->kv_heads, s->head_dim, cos, ssin, l->k_cache,
                                 l->v_cache, slots, s->num_blocks * s->block_size);
    if (st) return st;
    for (int64_t b = 0; b < batch; b++) memcpy(t->q + b * qw, t->qkv + b * width, (size_t)qw * sizeof(float));
    st = decode_attention(t->q, l->k_cache, l->v_cache, tables, lens, t->att, batch, s->heads, s->kv_heads,
                          s->head_dim, s->block_size, s->max_blocks, s->num_blocks, s->scale, threads);
    st = st ? st : quant_matmul_i8(l->type[1], l->w[1], s->dim, qw, t->att, qw, batch, t->h, threads, NULL, 0.0f, x);
    st = st ? st : quant_matmul_i8(l->type[2], l->w[2], 2 * s->ffn_dim, s->dim, t->h, s->dim, batch, t->gu,
                                   threads, l->ffn_norm, s->eps, NULL);
    if (st) return st;
    swiglu(t->gu, t->act, batch, s->ffn_dim);
    return quant_matmul_i8(l->type[3], l->w[3], s->dim, s->ffn_dim, t->act, s->ffn_dim, batch, x, threads, NULL,
                           0.0f, t->h);
}
#endif

/* x [batch, dim] (in place) through layers[0 .. n_layers): the step's hidden rows, the rotary
 * (cos, ssin: [batch, head_dim]), slots [batch], block_tables [batch, max_blocks] and
 * context_lens [batch] as the per-layer calls take them. Returns 0; -1 for shapes or ids the
 * calls refuse (a layer may have written its KV before the refusal); -2 without the int8 path. */
int decode_layers(const compact_layer *layers, int64_t n_layers, const decode_shape *s, float *x, int64_t batch,
                  const float *cos, const float *ssin, const int64_t *slots, const int64_t *block_tables,
                  const int64_t *context_lens, int threads) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
    const int64_t qw = s->heads * s->head_dim, width = qw + 2 * s->kv_heads * s->head_dim;
    float *buf = malloc((size_t)(batch * (width + 2 * qw + s->dim + 3 * s->ffn_dim)) * sizeof(float));
    if (buf == NULL) return -1;
    scratch t = {buf, buf + batch * width, buf + batch * (width + qw), buf + batch * (width + 2 * qw), NULL, NULL};
    t.gu = t.h + batch * s->dim, t.act = t.gu + batch * 2 * s->ffn_dim;
    int st = 0;
    for (int64_t i = 0; i < n_layers && st == 0; i++)
        st = one_layer(layers + i, s, x, batch, &t, cos, ssin, slots, block_tables, context_lens, threads);
    free(buf);
    return st;
#else
    (void)layers, (void)n_layers, (void)s, (void)x, (void)batch, (void)cos, (void)ssin, (void)slots;
    (void)block_tables, (void)context_lens, (void)threads;
    return -2;
#endif
}
