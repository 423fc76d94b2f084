/* Paged decode attention on the CPU, float32: one query token per sequence against its cached K/V
 * read in place through its block table. The torch reference (kernels/attention.py:
 * paged_decode_attention_ref) first gathers each layer's whole context into a buffer (K and V
 * copied once more per layer and step) and then runs SDPA; at batch 1 on smollm2-135m that was
 * ~18% of a decode step. Built with quant_matmul.c by kernels/quant_build.py.
 *
 * Per (sequence, KV head): the scores of its query heads over the context (scale * q.k), a
 * softmax in float32 (max subtracted), then the probability-weighted sum of V, divided once by the
 * sum at the end. With AVX-512 sixteen tokens' scores come out of one transposing reduction and
 * V is summed for up to four query heads from one read of each row (the portable loops below
 * reduced each score on its own and re-read each head's output row per token: 4.5 ms of a 17.8 ms
 * smollm2-135m step at 256 cached tokens; docs/results/2026-11-29-roof.md).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>

/* The lines of n rows of width values each (at rows into base), fetched toward L1 ahead of use:
 * the K/V rows of one head are 1/kv_heads of each cache row, too scattered for the hardware
 * prefetcher to run ahead (1.4x faster attention at 256 cached tokens, docs/results/2026-11-29-roof.md). */
static inline void prefetch_rows(const float *base, const int64_t *rows, int64_t n, int64_t width) {
    for (int64_t t = 0; t < n; t++)
        for (int64_t c = 0; c < width; c += 16)   /* a 64-byte line: 16 floats */
            _mm_prefetch((const char *)(base + rows[t] + c), _MM_HINT_T0);
}
#endif

#if defined(__AVX512F__)

/* e^x: x = n ln2 + r, |r| <= ln2/2, e^r by its degree-7 Taylor polynomial, times 2^n (scalef);
 * within 2 ulp of expf. Also decode_layers.c's SwiGLU's. */
__m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-104.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    static const float c[] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
    __m512 p = _mm512_set1_ps(c[0]);
    for (int i = 1; i < 8; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c[i]));
    return _mm512_scalef_ps(p, n);
}

static inline __mmask16 first(int64_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }


/* Lane L of sum16's result is the sum of v[SUM_ORDER[L]] (its own inverse): the order its
 * halving steps leave the sixteen sums in. */
static const int SUM_ORDER[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

/* Sixteen vectors' horizontal sums in one vector: 15 adds and 30 shuffles, where one sum each
 * took 4 adds and 4 shuffles in a dependent chain. */
static inline __m512 sum16(__m512 *v) {
    for (int i = 0; i < 8; i++)
        v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
    for (int i = 0; i < 4; i++)
        v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 4], 0x88), _mm512_shuffle_f32x4(v[i], v[i + 4], 0xDD));
    for (int i = 0; i < 2; i++)
        v[i] = _mm512_add_ps(_mm512_shuffle_ps(v[i], v[i + 2], 0x44), _mm512_shuffle_ps(v[i], v[i + 2], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
}

/* scores[0..n) = scale * q . k_t for the n <= 16 tokens at rows (row offsets into keys). Each
 * token's products go to the slot sum16 reads it from, in two chains of multiply-adds (one chain
 * of four a token ran at its latency). */
static void qk_tile(const float *q, const float *keys, const int64_t *rows, int64_t n, int64_t dim, float scale,
                 float *scores) {
    __m512 acc[16];
    for (int64_t j = 0; j < 16; j++) {
        const float *k = keys + rows[j < n ? j : 0];   /* a short tile's unused sums are not stored */
        __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();   /* two chains of multiply-adds */
        int64_t c = 0;
        for (; c + 32 <= dim; c += 32) {
            a = _mm512_fmadd_ps(_mm512_loadu_ps(q + c), _mm512_loadu_ps(k + c), a);
            b = _mm512_fmadd_ps(_mm512_loadu_ps(q + c + 16), _mm512_loadu_ps(k + c + 16), b);
        }
        for (; c < dim; c += 16) {
            const __mmask16 m = first(dim - c);
            a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + c), _mm512_maskz_loadu_ps(m, k + c), a);
        }
        acc[SUM_ORDER[j]] = _mm512_add_ps(a, b);
    }
    _mm512_mask_storeu_ps(scores, first(n), _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
}

/* s[0..len) = exp(s - max s) in place; returns their sum. */
static float softmax_exps(float *s, int64_t len) {
    __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t += 16) mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, first(len - t), s + t));
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    for (int64_t t = 0; t < len; t += 16) {
        const __mmask16 m = first(len - t);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), top));
        _mm512_mask_storeu_ps(s + t, m, e);
        sum = _mm512_mask_add_ps(sum, m, sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}

/* out[h][c .. c + 64) = sum_t p[h][t] * v_t[c ..] / sums[h] for hn <= 4 query heads, each V row
 * read once for all of them (p: [hn][len], out and sums by head, dim values apart). */
static void pv_tile(const float *p, int64_t len, int hn, const float *vals, const int64_t *rows, int64_t c,
                    int64_t dim, const float *sums, float *out) {
    __m512 acc[4][4];
    __mmask16 m[4];
    for (int j = 0; j < 4; j++) m[j] = c + 16 * j < dim ? first(dim - c - 16 * j) : 0;
    for (int h = 0; h < 4; h++)
        for (int j = 0; j < 4; j++) acc[h][j] = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t++) {
        __m512 v[4];
        if (t + 8 < len) prefetch_rows(vals + c, rows + t + 8, 1, dim - c < 64 ? dim - c : 64);
        for (int j = 0; j < 4; j++) v[j] = _mm512_maskz_loadu_ps(m[j], vals + rows[t] + c + 16 * j);
        for (int h = 0; h < 4; h++)
            if (h < hn) {
                const __m512 w = _mm512_set1_ps(p[h * len + t]);
                for (int j = 0; j < 4; j++) acc[h][j] = _mm512_fmadd_ps(w, v[j], acc[h][j]);
            }
    }
    for (int h = 0; h < hn; h++)
        for (int j = 0; j < 4; j++)
            _mm512_mask_storeu_ps(out + h * dim + c + 16 * j, m[j], _mm512_div_ps(acc[h][j], _mm512_set1_ps(sums[h])));
}

#define KEY_TILE 16   /* keys scored a tile (group_attention) */
#define PV_COLS 64    /* V columns pv_tile sums at once */
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 (8 floats a register): the AVX-512 path's plan at half its width. Eight tokens' scores come
 * out of one transposing reduction, V is summed for up to four query heads over 16 columns from
 * one read of each row. (The portable loops below ran 205 us a layer at 256 cached tokens on an
 * AVX2-only EPYC: 6 of a 40 ms smollm2-135m step, docs/results/2026-12-01-zen3.md.) */

/* e^x as exp512 computes it (the same reduction and polynomial); 2^n built in the exponent bits,
 * so x is held above -87.3 (2^-126, the smallest normal float): e^x below it is 1e-38, not less,
 * which a softmax's sum of at least 1 does not see. */
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3f)), _mm256_set1_ps(-87.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    static const float c[] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
    __m256 p = _mm256_set1_ps(c[0]);
    for (int i = 1; i < 8; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c[i]));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* The first n lanes (none for n <= 0), as maskload and maskstore take them. */
static inline __m256i lanes(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n > 8 ? 8 : (int)(n < 0 ? 0 : n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline float hsum8(__m256 v) {
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

/* Eight vectors' horizontal sums in one vector, in order: two rounds of pairwise adds within
 * 128-bit halves, then the halves added. */
static inline __m256 sum8(const __m256 *v) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* scores[0..n) = scale * q . k_t for the n <= 8 tokens at rows, two chains of multiply-adds a token. */
static void qk_tile(const float *q, const float *keys, const int64_t *rows, int64_t n, int64_t dim, float scale,
                float *scores) {
    __m256 acc[8];
    for (int64_t j = 0; j < 8; j++) {
        const float *k = keys + rows[j < n ? j : 0];   /* a short tile's unused sums are not stored */
        __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
        int64_t c = 0;
        for (; c + 16 <= dim; c += 16) {
            a = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(k + c), a);
            b = _mm256_fmadd_ps(_mm256_loadu_ps(q + c + 8), _mm256_loadu_ps(k + c + 8), b);
        }
        for (; c < dim; c += 8) {
            const __m256i m = lanes(dim - c);
            a = _mm256_fmadd_ps(_mm256_maskload_ps(q + c, m), _mm256_maskload_ps(k + c, m), a);
        }
        acc[j] = _mm256_add_ps(a, b);
    }
    _mm256_maskstore_ps(scores, lanes(n), _mm256_mul_ps(sum8(acc), _mm256_set1_ps(scale)));
}

/* s[0..len) = exp(s - max s) in place; returns their sum. */
static float softmax_exps(float *s, int64_t len) {
    __m256 mx = _mm256_set1_ps(-INFINITY), sum = _mm256_setzero_ps();
    for (int64_t t = 0; t < len; t += 8) {
        const __m256i m = lanes(len - t);
        mx = _mm256_max_ps(mx, _mm256_blendv_ps(mx, _mm256_maskload_ps(s + t, m), _mm256_castsi256_ps(m)));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const __m256 top = _mm256_set1_ps(_mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h))));
    for (int64_t t = 0; t < len; t += 8) {
        const __m256i m = lanes(len - t);
        const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_maskload_ps(s + t, m), top)), _mm256_castsi256_ps(m));
        _mm256_maskstore_ps(s + t, m, e);
        sum = _mm256_add_ps(sum, e);
    }
    return hsum8(sum);
}

/* out[h][c .. c + 16) = sum_t p[h][t] * v_t[c ..] / sums[h] for hn <= 4 query heads, each V row
 * read once for all of them (p: [hn][len], out and sums by head, dim values apart). */
static void pv_tile(const float *p, int64_t len, int hn, const float *vals, const int64_t *rows, int64_t c,
                    int64_t dim, const float *sums, float *out) {
    __m256 acc[4][2];
    const __m256i m[2] = {lanes(dim - c), lanes(dim - c - 8)};
    for (int h = 0; h < 4; h++) acc[h][0] = acc[h][1] = _mm256_setzero_ps();
    for (int64_t t = 0; t < len; t++) {
        if (t + 8 < len) prefetch_rows(vals + c, rows + t + 8, 1, dim - c < 16 ? dim - c : 16);
        const __m256 v0 = _mm256_maskload_ps(vals + rows[t] + c, m[0]), v1 = _mm256_maskload_ps(vals + rows[t] + c + 8, m[1]);
        for (int h = 0; h < 4; h++)
            if (h < hn) {
                const __m256 w = _mm256_set1_ps(p[h * len + t]);
                acc[h][0] = _mm256_fmadd_ps(w, v0, acc[h][0]);
                acc[h][1] = _mm256_fmadd_ps(w, v1, acc[h][1]);
            }
    }
    for (int h = 0; h < hn; h++)
        for (int j = 0; j < 2; j++)
            _mm256_maskstore_ps(out + h * dim + c + 8 * j, m[j], _mm256_div_ps(acc[h][j], _mm256_set1_ps(sums[h])));
}

#define KEY_TILE 8
#define PV_COLS 16
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
/* One KV head's query group (group heads: q and out [group, dim]) over len tokens at rows: each
 * tile of KEY_TILE keys scored against every head of the group while it is in L1. */
static void group_attention(const float *q, const float *keys, const float *vals, const int64_t *rows, int64_t len,
                            int64_t group, int64_t dim, float scale, float *scores, float *out) {
    float sums[group];
    for (int64_t t = 0; t < len; t += KEY_TILE) {
        const int64_t n = len - t < KEY_TILE ? len - t : KEY_TILE,
                      next = len - t - n < KEY_TILE ? len - t - n : KEY_TILE;
        if (next > 0) prefetch_rows(keys, rows + t + n, next, dim);   /* the next tile's keys */
        else prefetch_rows(vals, rows, len < 8 ? len : 8, dim);        /* the first values pv_tile reads */
        for (int64_t h = 0; h < group; h++) qk_tile(q + h * dim, keys, rows + t, n, dim, scale, scores + h * len + t);
    }
    for (int64_t h = 0; h < group; h++) sums[h] = softmax_exps(scores + h * len, len);
    for (int64_t h = 0; h < group; h += 4)
        for (int64_t c = 0; c < dim; c += PV_COLS)
            pv_tile(scores + h * len, len, group - h < 4 ? (int)(group - h) : 4, vals, rows, c, dim, sums + h,
                    out + h * dim);
}
#else
/* The portable loops: each score a reduction of its own, each output row updated per token. */
static void group_attention(const float *q, const float *keys, const float *vals, const int64_t *rows, int64_t len,
                            int64_t group, int64_t dim, float scale, float *scores, float *out) {
    for (int64_t t = 0; t < len; t++)
        for (int64_t h = 0; h < group; h++) {
            float s = 0.0f;
            #pragma omp simd reduction(+:s)
            for (int64_t d = 0; d < dim; d++) s += q[h * dim + d] * keys[rows[t] + d];
            scores[h * len + t] = s * scale;
        }
    float sums[group];
    for (int64_t h = 0; h < group; h++) {
        float *sc = scores + h * len, mx = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < len; t++) mx = fmaxf(mx, sc[t]);
        for (int64_t t = 0; t < len; t++) { sc[t] = expf(sc[t] - mx); sum += sc[t]; }
        sums[h] = sum;
        memset(out + h * dim, 0, (size_t)dim * sizeof(float));
    }
    for (int64_t t = 0; t < len; t++)
        for (int64_t h = 0; h < group; h++) {
            const float p = scores[h * len + t];
            #pragma omp simd
            for (int64_t d = 0; d < dim; d++) out[h * dim + d] += p * vals[rows[t] + d];
        }
    for (int64_t h = 0; h < group; h++)
        for (int64_t d = 0; d < dim; d++) out[h * dim + d] /= sums[h];
}
#endif

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
            /* the scores, then each token's row offset in the caches (the block table read once) */
            float *scores = malloc((size_t)(group * len + 1) * sizeof(float) + (size_t)len * sizeof(int64_t));
            if (scores == NULL) { status = -1; continue; }
            int64_t *rows = (int64_t *)(scores + group * len + (group * len) % 2);
            for (int64_t i = 0, t = 0; t < len; i++)   /* block by block: no division per token */
                for (int64_t o = 0; o < block_size && t < len; o++, t++)
                    rows[t] = (block_tables[b * max_blocks + i] * block_size + o) * row;
            group_attention(q + (b * heads + g * group) * dim, k_cache + g * dim, v_cache + g * dim, rows, len,
                            group, dim, scale, scores, out + (b * heads + g * group) * dim);
            free(scores);
        }
    }
    return status;
}
