/* x @ W^T with W in GGUF block formats (Q4_0, Q4_1, Q8_0), each row held row-planar: the same
 * bytes as the file's blocks, regrouped within the row as all its blocks' scales d (float16),
 * then (Q4_1) all their minimums m (float16), then all their quants (16 bytes of nibble pairs, or
 * 32 int8), so a vector load reads several blocks' scales or quants at once (quant_matmul_i8.c).
 *
 * Each block is dequantized in registers into 32 float32 values equal to gguf.quants' (the same
 * operations and roundings: Q4_1 is (q*d) + m, two roundings, never fused), then multiplied into
 * the activations with fused multiply-adds. The torch reference is
 * kernels/quant_linear.py:quant_linear_ref. Built by kernels/quant_build.py.
 */
#include <stdint.h>
#include <string.h>


#if defined(__AVX2__)
#include <immintrin.h>
/* A block's 16 quant bytes: SSE2 operations, the same with AVX-512 or AVX2. */
typedef __m128i bytes16;
static inline bytes16 load_bytes(const uint8_t *p) { return _mm_loadu_si128((const __m128i *)p); }
static inline bytes16 low_nibbles(bytes16 q) { return _mm_and_si128(q, _mm_set1_epi8(15)); }
static inline bytes16 high_nibbles(bytes16 q) { return _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(15)); }
static inline bytes16 minus8(bytes16 q) { return _mm_sub_epi8(q, _mm_set1_epi8(8)); }
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
typedef __m512 v16f;
static inline v16f vzero(void) { return _mm512_setzero_ps(); }
static inline v16f vbroadcast(float f) { return _mm512_set1_ps(f); }
static inline v16f load16(const float *p) { return _mm512_loadu_ps(p); }
static inline void store16(float *p, v16f v) { _mm512_storeu_ps(p, v); }
static inline float hsum(v16f v) { return _mm512_reduce_add_ps(v); }
static inline v16f fmadd(v16f a, v16f b, v16f c) { return _mm512_fmadd_ps(a, b, c); }
static inline v16f vmul(v16f a, v16f b) { return _mm512_mul_ps(a, b); }
static inline v16f vadd(v16f a, v16f b) { return _mm512_add_ps(a, b); }
static inline v16f u8_to_f(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)); }
static inline v16f i8_to_f(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)); }
/* An optimisation barrier: the product is rounded on its own, as gguf.quants computes it, and
 * not contracted with the following add into one fused multiply-add. */
static inline v16f rounded(v16f v) { __asm__("" : "+v"(v)); return v; }
#elif defined(__AVX2__) && defined(__FMA__)
/* 16 floats as two AVX2 registers. (A 64-byte GCC vector here compiled to stack round trips and
 * a scalar convert per value: a batch-1 product ran at a seventeenth of its memory read on an
 * AVX2-only EPYC, docs/results/2026-12-01-zen3.md.) */
typedef struct { __m256 lo, hi; } v16f;
static inline v16f pair(__m256 lo, __m256 hi) { v16f v = {lo, hi}; return v; }
static inline v16f vzero(void) { return pair(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static inline v16f vbroadcast(float f) { return pair(_mm256_set1_ps(f), _mm256_set1_ps(f)); }
static inline v16f load16(const float *p) { return pair(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
static inline void store16(float *p, v16f v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
static inline v16f fmadd(v16f a, v16f b, v16f c) {
    return pair(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
static inline v16f vmul(v16f a, v16f b) { return pair(_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)); }
static inline v16f vadd(v16f a, v16f b) { return pair(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)); }
static inline float hsum(v16f v) {
    __m256 s = _mm256_add_ps(v.lo, v.hi);
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
static inline v16f u8_to_f(bytes16 v) {
    return pair(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)),
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(v, v))));
}
static inline v16f i8_to_f(bytes16 v) {
    return pair(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)),
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v, v))));
}
static inline v16f rounded(v16f v) { __asm__("" : "+x"(v.lo), "+x"(v.hi)); return v; }
#else   /* portable: GCC vector types, which the compiler lowers to what the CPU has */
typedef float v16f __attribute__((vector_size(64)));
typedef int8_t s16 __attribute__((vector_size(16)));
static inline v16f vzero(void) { return (v16f){0}; }
static inline v16f vbroadcast(float f) { return (v16f){0} + f; }
static inline v16f load16(const float *p) { v16f v; memcpy(&v, p, 64); return v; }
static inline void store16(float *p, v16f v) { memcpy(p, &v, 64); }
static inline float hsum(v16f v) { float s = 0.0f; for (int i = 0; i < 16; i++) s += v[i]; return s; }
static inline v16f fmadd(v16f a, v16f b, v16f c) { return a * b + c; }
static inline v16f vmul(v16f a, v16f b) { return a * b; }
static inline v16f vadd(v16f a, v16f b) { return a + b; }
#if !defined(__AVX2__)
typedef uint8_t bytes16 __attribute__((vector_size(16)));
static inline bytes16 load_bytes(const uint8_t *p) { bytes16 v; memcpy(&v, p, 16); return v; }
static inline bytes16 low_nibbles(bytes16 q) { return q & 15; }
static inline bytes16 high_nibbles(bytes16 q) { return q >> 4; }
static inline bytes16 minus8(bytes16 q) { return (bytes16)((s16)q - 8); }
#endif
static inline v16f u8_to_f(bytes16 v) {
    v16f f; uint8_t b[16]; memcpy(b, &v, 16);
    for (int i = 0; i < 16; i++) f[i] = (float)b[i];
    return f;
}
static inline v16f i8_to_f(bytes16 v) {
    v16f f; int8_t b[16]; memcpy(b, &v, 16);
    for (int i = 0; i < 16; i++) f[i] = (float)b[i];
    return f;
}
/* (A 64-byte vector fits one register only with AVX-512; here the barrier goes through memory.) */
static inline v16f rounded(v16f v) { __asm__("" : "+m"(v)); return v; }
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };   /* GGMLQuantizationType values */
#if defined(__AVX512F__) && defined(__AVX512BW__) || !defined(__AVX2__)
#define MAX_TILE 8   /* x rows a product holds at once */
#define CHAINS 2     /* accumulators per (row, x row) pair: one per half of a block */
#else
/* AVX2 has 16 registers, not AVX-512's 32, and a vector here takes two: eight x rows with two
 * accumulators each spilled to the stack (a batch of 16 ran at 15% of the matmul peak). Four x
 * rows, one accumulator a pair: still eight independent chains of multiply-adds. */
#define MAX_TILE 4
#define CHAINS 1
#endif

static inline float half(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, 2);
    return (float)h;
}


static inline v16f scale(v16f v, float d) { return vmul(v, vbroadcast(d)); }

/* Block j of a row-planar row of nblk blocks: its scale, minimum and quants. */
static inline const uint8_t *scale_at(const uint8_t *row, int64_t j) { return row + 2 * j; }
static inline const uint8_t *min_at(const uint8_t *row, int64_t nblk, int64_t j) { return row + 2 * nblk + 2 * j; }
static inline const uint8_t *quants_at(int qtype, const uint8_t *row, int64_t nblk, int64_t j) {
    return qtype == Q8_0 ? row + 2 * nblk + 32 * j : row + (qtype == Q4_1 ? 4 : 2) * nblk + 16 * j;
}

/* The block's 32 values as two vectors: elements 0..15 and 16..31. */
static inline __attribute__((always_inline)) void dequant(int qtype, const uint8_t *row, int64_t nblk, int64_t j,
                                                          v16f *lo, v16f *hi) {
    float d = half(scale_at(row, j));
    const uint8_t *qs = quants_at(qtype, row, nblk, j);
    if (qtype == Q8_0) {
        *lo = scale(i8_to_f(load_bytes(qs)), d);
        *hi = scale(i8_to_f(load_bytes(qs + 16)), d);
        return;
    }
    /* byte j holds element j (low nibble) and element j+16 (high nibble) */
    bytes16 q = load_bytes(qs);
    if (qtype == Q4_0) {
        *lo = scale(i8_to_f(minus8(low_nibbles(q))), d);
        *hi = scale(i8_to_f(minus8(high_nibbles(q))), d);
    } else {
        float m = half(min_at(row, nblk, j));
        *lo = vadd(rounded(scale(u8_to_f(low_nibbles(q)), d)), vbroadcast(m));
        *hi = vadd(rounded(scale(u8_to_f(high_nibbles(q)), d)), vbroadcast(m));
    }
}

/* The block's quants as floats (Q4_0's already less 8), unscaled: lo = elements 0..15. */
static inline __attribute__((always_inline)) void block_quants(int qtype, const uint8_t *qs, v16f *lo, v16f *hi) {
    if (qtype == Q8_0) {
        *lo = i8_to_f(load_bytes(qs));
        *hi = i8_to_f(load_bytes(qs + 16));
        return;
    }
    bytes16 q = load_bytes(qs);
    if (qtype == Q4_0) {
        *lo = i8_to_f(minus8(low_nibbles(q)));
        *hi = i8_to_f(minus8(high_nibbles(q)));
    } else {
        *lo = u8_to_f(low_nibbles(q));
        *hi = u8_to_f(high_nibbles(q));
    }
}

/* One x row against rows [n, n+rows) of W as sum_j d_j * (q_j . x_j) + m_j * sum(x_j): the scale
 * and minimum multiply once per block instead of once per value, which at one row (no reuse of a
 * dequantized block) is most of the work. ``xsum`` holds sum(x_j) of each block of this x row. */
static inline __attribute__((always_inline)) void row_product(
        int qtype, const uint8_t *w, int64_t row_bytes, int64_t nblk, const float *x,
        const float *xsum, int64_t n, int rows, float *out) {
    v16f acc[4];
    float msum[4] = {0};
    for (int r = 0; r < rows; r++) acc[r] = vzero();
    for (int64_t j = 0; j < nblk; j++) {
        v16f xl = load16(x + j * 32), xh = load16(x + j * 32 + 16);
        for (int r = 0; r < rows; r++) {
            const uint8_t *row = w + (n + r) * row_bytes;
            v16f lo, hi;
            block_quants(qtype, quants_at(qtype, row, nblk, j), &lo, &hi);
            acc[r] = fmadd(fmadd(hi, xh, vmul(lo, xl)), vbroadcast(half(scale_at(row, j))), acc[r]);
            if (qtype == Q4_1) msum[r] += half(min_at(row, nblk, j)) * xsum[j];
        }
    }
    for (int r = 0; r < rows; r++) out[n + r] = hsum(acc[r]) + msum[r];
}

/* Rows [b0, b0+tile) of x against rows [n, n+rows) of W. Each (row, x row) pair has two
 * accumulators (the block's halves), so at least 8 independent multiply-add chains run at once
 * when tile * rows >= 4: one chain per block would wait on the FMA latency. */
static inline __attribute__((always_inline)) void tile_product(
        int qtype, const uint8_t *w, int64_t row_bytes, int64_t nblk, const float *x,
        int64_t k, int64_t b0, int tile, int64_t n, int rows, float *out, int64_t n_out) {
    v16f acc[4][MAX_TILE][CHAINS];
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < tile; b++)
            for (int c = 0; c < CHAINS; c++) acc[r][b][c] = vzero();
    for (int64_t j = 0; j < nblk; j++) {
        for (int r = 0; r < rows; r++) {
            v16f lo, hi;
            dequant(qtype, w + (n + r) * row_bytes, nblk, j, &lo, &hi);
            for (int b = 0; b < tile; b++) {
                const float *xb = x + (b0 + b) * k + j * 32;
                acc[r][b][0] = fmadd(lo, load16(xb), acc[r][b][0]);
                acc[r][b][CHAINS - 1] = fmadd(hi, load16(xb + 16), acc[r][b][CHAINS - 1]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < tile; b++) out[(b0 + b) * n_out + n + r] = hsum(CHAINS == 2 ? vadd(acc[r][b][0], acc[r][b][CHAINS - 1]) : acc[r][b][0]);
}

#define PRODUCT(T, R) tile_product(qtype, w, row_bytes, nblk, x, k, b0, T, n, R, out, n_rows)

/* x rows [b0, b0+tile) against W rows [n, n+4) (or fewer at the end): constant shapes, so each
 * unrolls with its accumulators in registers. */
static inline __attribute__((always_inline)) void group_product(
        int qtype, const uint8_t *w, int64_t row_bytes, int64_t nblk, const float *x,
        const float *xsum, int64_t k, int64_t b0, int64_t tile, int64_t n, int64_t rows, float *out,
        int64_t n_rows) {
    if (tile == 1) {
        const float *xb = x + b0 * k, *sb = xsum + b0 * nblk;
        if (rows == 4) row_product(qtype, w, row_bytes, nblk, xb, sb, n, 4, out + b0 * n_rows);
        else for (int64_t r = 0; r < rows; r++)
            row_product(qtype, w, row_bytes, nblk, xb, sb, n + r, 1, out + b0 * n_rows);
        return;
    }
    if (rows == 4) {
        switch (tile) {   /* at most 8 accumulators (AVX2: at most 12 registers) */
#if MAX_TILE > 4
            case 2: PRODUCT(2, 4); return;
#else
            case 2: PRODUCT(2, 2); n += 2; PRODUCT(2, 2); return;
#endif
            case 3: PRODUCT(3, 2); n += 2; PRODUCT(3, 2); return;
#if MAX_TILE > 4
            case 4: PRODUCT(4, 2); n += 2; PRODUCT(4, 2); return;
#endif
            default: break;
        }
    }
    for (int64_t r = 0; r < rows; r++, n++) {
        switch (tile) {
            case 2: PRODUCT(2, 1); break;
            case 3: PRODUCT(3, 1); break;
#if MAX_TILE > 4
            case 4: PRODUCT(4, 1); break;
            case 5: PRODUCT(5, 1); break;
            case 6: PRODUCT(6, 1); break;
            case 7: PRODUCT(7, 1); break;
#endif
            default: PRODUCT(MAX_TILE, 1); break;
        }
    }
}

static int64_t block_bytes(int qtype) {
    return qtype == Q4_0 ? 18 : qtype == Q4_1 ? 20 : qtype == Q8_0 ? 34 : 0;
}

/* out[B, N] = x[B, K] @ W[N, K]^T, W being N rows of K/32 blocks of ``qtype``. ``xsum`` is scratch
 * for B * K/32 floats. Returns 0, or -1 for a type it does not know or K not a multiple of 32. */
int quant_matmul(int qtype, const uint8_t *w, int64_t n_rows, int64_t k, const float *x,
                 int64_t batch, float *out, float *xsum, int threads) {
    int64_t bsize = block_bytes(qtype);
    if (bsize == 0 || k % 32) return -1;
    int64_t nblk = k / 32, row_bytes = nblk * bsize, groups = (n_rows + 3) / 4;
    for (int64_t i = 0; i < batch * nblk; i++) {
        float s = 0.0f;
        for (int e = 0; e < 32; e++) s += x[i * 32 + e];
        xsum[i] = s;
    }
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t g = 0; g < groups; g++) {
        int64_t n = g * 4, rows = n_rows - n < 4 ? n_rows - n : 4;
        for (int64_t b0 = 0; b0 < batch; b0 += MAX_TILE) {
            int64_t tile = batch - b0 < MAX_TILE ? batch - b0 : MAX_TILE;
            switch (qtype) {   /* a constant type, so the block loop does not branch on it */
                case Q4_0: group_product(Q4_0, w, row_bytes, nblk, x, xsum, k, b0, tile, n, rows, out, n_rows); break;
                case Q4_1: group_product(Q4_1, w, row_bytes, nblk, x, xsum, k, b0, tile, n, rows, out, n_rows); break;
                default: group_product(Q8_0, w, row_bytes, nblk, x, xsum, k, b0, tile, n, rows, out, n_rows); break;
            }
        }
    }
    return 0;
}

/* out[N, K] = W dequantized: gguf.quants' values, for products with many rows (a prefill), which
 * run faster as one float32 matmul on this copy than block by block. */
int quant_dequantize(int qtype, const uint8_t *w, int64_t n_rows, int64_t k, float *out, int threads) {
    int64_t bsize = block_bytes(qtype);
    if (bsize == 0 || k % 32) return -1;
    int64_t nblk = k / 32, total = n_rows * nblk;
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t i = 0; i < total; i++) {
        v16f lo, hi;
        const uint8_t *row = w + i / nblk * nblk * bsize;
        switch (qtype) {
            case Q4_0: dequant(Q4_0, row, nblk, i % nblk, &lo, &hi); break;
            case Q4_1: dequant(Q4_1, row, nblk, i % nblk, &lo, &hi); break;
            default: dequant(Q8_0, row, nblk, i % nblk, &lo, &hi); break;
        }
        store16(out + i * 32, lo);
        store16(out + i * 32 + 16, hi);
    }
    return 0;
}
