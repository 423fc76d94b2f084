/* x @ W^T with W in GGUF block formats (Q4_0, Q4_1, Q8_0) and x in integers per block of 32: the
 * few-rows product (a decode batch) with VNNI integer dot products (32 multiply-adds an
 * instruction), where quant_matmul.c's float path spends a conversion and a multiply-add per 16
 * weights and runs bound by that work, not by memory.
 *
 * x's block j is held as two int8 parts: q = round(x / dx), dx = max|x| / 127, as llama.cpp's
 * q8 activations, and the remainder's r = round((x - q*dx) * 256 / dx), so x ~ (256q + r) * dx/256
 * (15 bits a value against the block's largest; one int8 part alone moved greedy tokens of the
 * default model where its top two logits were within 0.03: its head's logits moved by 0.3). Then
 *   Q4_0: sum_j d_j * dx_j/256 * (q4_j . (256q + r)_j - 8 * sum(256q + r)_j)  (q4 in 0..15 is q4 - 8)
 *   Q4_1: the same + (m_j + 8*d_j) * sum(x_j)           (d*q4 + m taken as d*(q4 - 8) + (m + 8d))
 *   Q8_0: sum_j d_j * dx_j/256 * ((q8_j ^ 0x80) . (256q + r)_j - 128 * sum(256q + r)_j)
 * with u8 x s8 products (q8 ^ 0x80 is q8 + 128, unsigned). Centring Q4_1's weights on zero keeps
 * x's rounding error from meeting all-positive d*q4. The integer parts are exact, so the only
 * error is x's rounding (bounded: tests/kernels/test_quant_linear.py); every x row is computed by
 * the same operations in the same order whatever the batch, so a sequence's tokens do not depend
 * on what it is batched with.
 *
 * W is row-planar (quant_matmul.c): a 64-byte load reads four Q4 blocks' quants (two Q8_0), one
 * 8-byte load their scales.
 *
 * The work a decode layer does around its products rides along, each a dispatched operator in
 * torch: x's row may first be RMS-normalised (norm_w: rms_norm.c's own row function), and a
 * residual may be added to each output (out = x @ W^T + residual, the sum torch's add_ forms).
 * (SwiGLU stays torch's: C's expf is not its exp, and an ulp moved the int8 rounding of x enough
 * to move logits by 2e-3.)
 *
 * Built only where the CPU has AVX-512 with VNNI; elsewhere quant_matmul_i8 answers -2 and the
 * float path runs (kernels/quant_linear.py).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };   /* GGMLQuantizationType values */

void rms_norm_row(const float *x, const float *w, float *out, int64_t dim, float eps);   /* rms_norm.c */


#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define HAVE_I8 1

/* One x row's quantized blocks for one step of the row loop: four blocks (Q4) or two (Q8_0), laid
 * out as that step's 64-byte load of W's quants needs them. Q4: xa = the blocks' elements 0..15,
 * xb = 16..31 (low and high nibbles); Q8_0: xa = the two blocks in order. bias: int32 lanes, the
 * first of each block's lanes holding -offset * sum(xq) (Q4: 8, Q8_0: 128), where the
 * integer dot products start. */
typedef struct {
    int8_t xa[64], xb[64], ra[64], rb[64];   /* x's quants (xa, xb) and its remainder's (ra, rb) */
    int32_t bias[16];
    float dx[4], xsum[4];   /* dx: the remainder's step, dx_j / 256 */
    uint8_t pad[32];
} xgroup;

static inline int per_group(int qtype) { return qtype == Q8_0 ? 2 : 4; }

/* The scalar loop this replaced (fmaxf and fminf calls per value) was a tenth of a batch-1 step's
 * C time on smollm2-135m; the vector one rounds the same way (round half to even, one fused
 * multiply-add for the remainder), so q and r are unchanged and only x's float sum is added in
 * another order. */
static void quantize_row(int qtype, const float *x, int64_t nblk, xgroup *out) {
    const int g = per_group(qtype), offset = qtype == Q8_0 ? 128 : 8;
    const int rounding = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    memset(out, 0, (size_t)((nblk + g - 1) / g) * sizeof(xgroup));   /* a ragged last group: zeros */
    for (int64_t j = 0; j < nblk; j++) {
        const __m512 v[2] = {_mm512_loadu_ps(x + j * 32), _mm512_loadu_ps(x + j * 32 + 16)};
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        xgroup *o = out + j / g;
        const int b = (int)(j % g);
        __m512i sum = _mm512_setzero_si512();   /* of 256 * q + r: the offset's multiplier */
        for (int h = 0; h < 2; h++) {
            const __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(v[h], _mm512_set1_ps(id)), rounding);
            __m512 r = _mm512_mul_ps(_mm512_fnmadd_ps(q, _mm512_set1_ps(d), v[h]), _mm512_set1_ps(id * 256.0f));
            r = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(r, rounding), _mm512_set1_ps(-127.0f)),
                              _mm512_set1_ps(127.0f));   /* |x - q*d| <= d/2: r in [-128, 128] */
            const __m512i qi = _mm512_cvtps_epi32(q), ri = _mm512_cvtps_epi32(r);
            sum = _mm512_add_epi32(sum, _mm512_add_epi32(_mm512_slli_epi32(qi, 8), ri));
            const int at = qtype == Q8_0 ? 32 * b + 16 * h : 16 * b;   /* Q4: elements 16..31 in xb, rb */
            int8_t *qd = qtype == Q8_0 || h == 0 ? o->xa : o->xb, *rd = qtype == Q8_0 || h == 0 ? o->ra : o->rb;
            _mm_storeu_si128((__m128i *)(qd + at), _mm512_cvtepi32_epi8(qi));
            _mm_storeu_si128((__m128i *)(rd + at), _mm512_cvtepi32_epi8(ri));
        }
        o->bias[(16 / g) * b] = -offset * _mm512_reduce_add_epi32(sum);
        o->dx[b] = d / 256.0f, o->xsum[b] = _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1]));
    }
}

/* ``rw`` row-planar rows of W (nblk blocks each, row_bytes apart) against ``rx`` quantized x rows
 * (xg, xg + stride, ...): each W row's quants are unpacked once for all x rows and each x group
 * is loaded once for all W rows; every (W row, x row) pair goes through the same operations in
 * the same order whatever rw and rx are, so a row's result does not depend on its batch. */
static inline __attribute__((always_inline)) void row_dot(int qtype, const uint8_t *row, int64_t row_bytes, int rw,
                                                          int64_t nblk, const xgroup *xg, int64_t stride, int rx,
                                                          float *out, const float *res, int64_t out_stride) {
    const int g = per_group(qtype);
    const int64_t qoff = (qtype == Q4_1 ? 4 : 2) * nblk;
    /* each block's scale repeated over its lanes: 4 lanes a block (Q4) or 8 (Q8_0) */
    const __m512i spread = qtype == Q8_0 ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
                                         : _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i nibble = _mm512_set1_epi8(15), flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[2][4];
    __m128 macc[2][4];
    for (int w = 0; w < rw; w++)
        for (int r = 0; r < rx; r++) acc[w][r] = _mm512_setzero_ps(), macc[w][r] = _mm_setzero_ps();
    for (int64_t j = 0, grp = 0; j < nblk; j += g, grp++) {
        int nb = nblk - j < g ? (int)(nblk - j) : g;
        __mmask64 qmask = nb == g ? ~(__mmask64)0 : ((__mmask64)1 << (nb * (64 / g))) - 1;
        __mmask8 smask = (__mmask8)((1u << nb) - 1);
        __m512i lo[2], hi[2];
        __m128 d[2], m[2];
        for (int w = 0; w < rw; w++) {
            const uint8_t *wr = row + w * row_bytes;
            const uint16_t *ds = (const uint16_t *)wr;
            __m512i q = _mm512_maskz_loadu_epi8(qmask, wr + qoff + j * (64 / g));
            if (qtype == Q8_0) lo[w] = hi[w] = _mm512_xor_si512(q, flip);
            else lo[w] = _mm512_and_si512(q, nibble), hi[w] = _mm512_and_si512(_mm512_srli_epi16(q, 4), nibble);
            d[w] = _mm_cvtph_ps(_mm_maskz_loadu_epi16(smask, ds + j)), m[w] = _mm_setzero_ps();
            if (qtype == Q4_1)   /* m + 8d, against sum(x) */
                m[w] = _mm_fmadd_ps(d[w], _mm_set1_ps(8.0f), _mm_cvtph_ps(_mm_maskz_loadu_epi16(smask, ds + nblk + j)));
        }
        for (int r = 0; r < rx; r++) {
            const xgroup *x = xg + r * stride + grp;
            const __m512i xa = _mm512_load_si512(x->xa), ra = _mm512_load_si512(x->ra), bias = _mm512_load_si512(x->bias);
            const __m512i xb = qtype != Q8_0 ? _mm512_load_si512(x->xb) : xa, rb = qtype != Q8_0 ? _mm512_load_si512(x->rb) : ra;
            const __m128 dx = _mm_load_ps(x->dx);
            for (int w = 0; w < rw; w++) {
                __m512i dq = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[w], xa);
                __m512i dot = _mm512_dpbusd_epi32(bias, lo[w], ra);
                if (qtype != Q8_0) {
                    dq = _mm512_dpbusd_epi32(dq, hi[w], xb);
                    dot = _mm512_dpbusd_epi32(dot, hi[w], rb);
                }
                dot = _mm512_add_epi32(_mm512_slli_epi32(dq, 8), dot);   /* 256 * (w . q) + w . r */
                __m128 s = _mm_mul_ps(d[w], dx);
                acc[w][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                            _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(s)), acc[w][r]);
                if (qtype == Q4_1) macc[w][r] = _mm_fmadd_ps(m[w], _mm_load_ps(x->xsum), macc[w][r]);
            }
        }
    }
    for (int w = 0; w < rw; w++)
        for (int r = 0; r < rx; r++) {
            __m128 t = _mm_add_ps(macc[w][r], _mm_movehl_ps(macc[w][r], macc[w][r]));
            float sum = _mm512_reduce_add_ps(acc[w][r]) + _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
            out[r * out_stride + w] = res != NULL ? sum + res[r * out_stride + w] : sum;
        }
}

/* Rows [n0, n1) of W against every x row, two W rows and four x rows at a time: the W rows stay
 * in L1 while the batch reads them. */
static inline __attribute__((always_inline)) void rows_dot(int qtype, const uint8_t *w, int64_t row_bytes,
        int64_t nblk, const xgroup *xg, int64_t groups, int64_t batch, int64_t n0, int64_t n1, float *out,
        const float *res, int64_t n_rows) {
    for (int64_t n = n0; n < n1; n += 2) {
        const uint8_t *row = w + n * row_bytes;
        const int rw = n + 1 < n1 ? 2 : 1;
        /* every line of the rows 8 rows on: the hardware prefetcher alone kept a batch-1 step's
         * products at ~5 GB/s from memory; this made them 1.36x faster (docs/results/2026-11-29-decode-layers.md) */
        if (n + 8 + rw <= n_rows)   /* no pointer formed past W's end (undefined in C, even unread) */
            for (int64_t off = 0; off < rw * row_bytes; off += 64)
                _mm_prefetch((const char *)row + 8 * row_bytes + off, _MM_HINT_T0);
        for (int64_t b = 0; b < batch; b += 4) {
            const xgroup *xb = xg + b * groups;
            float *o = out + b * n_rows + n;
            const float *r = res ? res + b * n_rows + n : NULL;
            /* constant row counts, so the loops over them unroll */
            #define ROWS(RW) switch (batch - b) { \
                case 1: row_dot(qtype, row, row_bytes, RW, nblk, xb, groups, 1, o, r, n_rows); break; \
                case 2: row_dot(qtype, row, row_bytes, RW, nblk, xb, groups, 2, o, r, n_rows); break; \
                case 3: row_dot(qtype, row, row_bytes, RW, nblk, xb, groups, 3, o, r, n_rows); break; \
                default: row_dot(qtype, row, row_bytes, RW, nblk, xb, groups, 4, o, r, n_rows); break; }
            if (rw == 2) { ROWS(2) } else { ROWS(1) }
            #undef ROWS
        }
    }
}
#endif

/* out[B, N] = x[B, K] @ W[N, K]^T (+ residual[B, N]) with x quantized per block as above, x's rows
 * x_stride values apart, each first RMS-normalised where norm_w (K weights) is given. Returns 0;
 * -1 for a type it does not know or K not a multiple of 32; -2 where this build has no int8 path. */
int quant_matmul_i8(int qtype, const uint8_t *w, int64_t n_rows, int64_t k, const float *x, int64_t x_stride,
                    int64_t batch, float *out, int threads, const float *norm_w, float eps, const float *residual) {
#ifdef HAVE_I8
    if ((qtype != Q4_0 && qtype != Q4_1 && qtype != Q8_0) || k % 32) return -1;
    int64_t nblk = k / 32, groups = (nblk + per_group(qtype) - 1) / per_group(qtype);
    int64_t row_bytes = nblk * (qtype == Q4_0 ? 18 : qtype == Q4_1 ? 20 : 34);
    xgroup *xg = aligned_alloc(64, (size_t)(batch * groups) * sizeof(xgroup));
    float *tmp = aligned_alloc(64, (size_t)(k + 15) / 16 * 64);
    if (xg == NULL || tmp == NULL) { free(xg), free(tmp); return -1; }
    for (int64_t b = 0; b < batch; b++) {
        const float *row = x + b * x_stride;
        if (norm_w != NULL) rms_norm_row(row, norm_w, tmp, k, eps);
        quantize_row(qtype, norm_w != NULL ? tmp : row, nblk, xg + b * groups);
    }
    free(tmp);
    int64_t chunks = (n_rows + 15) / 16;
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t n0 = c * 16, n1 = n0 + 16 < n_rows ? n0 + 16 : n_rows;
        switch (qtype) {   /* a constant type, so the block loop does not branch on it */
            case Q4_0: rows_dot(Q4_0, w, row_bytes, nblk, xg, groups, batch, n0, n1, out, residual,
                                      n_rows); break;
            case Q4_1: rows_dot(Q4_1, w, row_bytes, nblk, xg, groups, batch, n0, n1, out, residual,
                                      n_rows); break;
            default: rows_dot(Q8_0, w, row_bytes, nblk, xg, groups, batch, n0, n1, out, residual,
                                      n_rows); break;
        }
    }
    free(xg);
    return 0;
#else
    (void)qtype, (void)w, (void)n_rows, (void)k, (void)x, (void)x_stride, (void)batch, (void)out, (void)threads;
    (void)norm_w, (void)eps, (void)residual;
    return -2;
#endif
}
