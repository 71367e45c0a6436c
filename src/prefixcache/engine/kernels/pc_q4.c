/* Quantized weights read in place, computed as the own GEMM computes their float values.
 *
 * Q4_1 (pc_q4_linear): W [N, K] stored per output row n as K/32 groups of 16 bytes of nibbles
 * (byte j holds element j in its low nibble and element j + 16 in its high nibble, the GGUF's own
 * order) and a float16 scale d and min m per group. Q8_0 (pc_q8_linear): K/32 groups of 32 int8
 * and a float16 scale d. The embedded SmolLM2 stores its projections as the first and its tied
 * embedding / lm_head as the second.
 *
 * The runner's float weights are those groups dequantized: w = q * d + m (a float32 product, then
 * a float32 sum; Q8_0: w = q * d) and, for bfloat16, rounded once to nearest even. These kernels
 * compute exactly those values in registers (a group's 16 possible Q4_1 values once, looked up by
 * nibble) and then run pc_gemm.c's arithmetic for the GEMM ISA asked for, so a row's outputs are
 * bitwise the own GEMM's on the dense weights (tests/engine/test_q4_kernel.py compares them):
 * - float32, or bfloat16 without a bf16 dot product (`isa` avx512/avx2/generic): 16 lanes, lane l
 *   accumulating k = l, l + 16, ... ascending with one FMA each (bfloat16 rows and weights
 *   widened to float32), then the fixed tree (l + l+8, +4, +2, +1) and, for bfloat16, one
 *   rounding to nearest even. Their AVX512, AVX2 and scalar paths give the same bits.
 * - bfloat16 with `isa` avx512bf16 (or amx, whose decode rows the dot product stands in for):
 *   VDPBF16PS, lane l accumulating the pairs k = 32 c + 2 l, 2 l + 1 in ascending chunks c, then
 *   the same tree and rounding: pc_gemm's dot-product path.
 * A row's bits depend only on the row and K (never on the row count, its place in the batch or
 * the thread count: OpenMP splits the output columns only). No fast-math, no compiler FMA
 * contraction (build flags); the FMAs are written out. The bytes a decode row reads are the
 * stored ones: 0.625 a weight for Q4_1 (nibbles, float16 d and m), 1.06 for Q8_0.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define PC_Q4_VERSION 5
#define Q4_TILE 8 /* rows a tile at most (8 rows x 2 columns, or 4 x 4) */
#define Q4_INLINE static inline __attribute__((always_inline))

enum { G_GENERIC = 0, G_AVX2 = 1, G_AVX512 = 2, G_AVX512BF16 = 3, G_AMX = 4 };
enum { M_F32 = 0, M_W16 = 1, M_DP = 2 }; /* float32; bf16 widened; bf16 dot product */

int pc_q4_version(void) { return PC_Q4_VERSION; }

/* float16 -> float32, exactly (normals, subnormals, zeros, inf, NaN). */
static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            int e = -1;
            do {
                man <<= 1;
                e++;
            } while (!(man & 1024));
            bits = sign | (uint32_t)(127 - 15 - e) << 23 | (man & 1023) << 13;
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | man << 13;
    } else {
        bits = sign | (exp + 127 - 15) << 23 | man << 13;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float bf2f(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f2bf(float f) { /* round to nearest even, as torch and pc_gemm (NaN -> 0x7fc0) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float round_bf16(float f) { return bf2f(f2bf(f)); }

/* pc_gemm's tree over 16 lanes. */
static inline float tree16(const float *a) {
    float s8[8], s4[4], s2[2];
    for (int i = 0; i < 8; i++) s8[i] = a[i] + a[i + 8];
    for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
    for (int i = 0; i < 2; i++) s2[i] = s4[i] + s4[i + 2];
    return s2[0] + s2[1];
}

static inline void put(int dt, void *y, int64_t at, float s) {
    if (dt == 1)
        ((uint16_t *)y)[at] = f2bf(s);
    else
        ((float *)y)[at] = s;
}

static inline float xat(int dt, const void *x, int64_t i) {
    return dt == 1 ? bf2f(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

/* A group's 32 weights as the runner's float weights hold them (w16: rounded to bf16). */
static inline void q4_group_values(const uint8_t *b, float d, float m, int w16, float *w) {
    for (int i = 0; i < 16; i++) {
        float lo = (float)(b[i] & 15) * d + m, hi = (float)(b[i] >> 4) * d + m;
        w[i] = w16 ? round_bf16(lo) : lo;
        w[16 + i] = w16 ? round_bf16(hi) : hi;
    }
}

/* ---------------------------------------------------------------- scalar (the reference order) */
static void q4_col_scalar(int dt, int w16, const uint8_t *qs, const uint16_t *d, const uint16_t *m, int64_t gk,
                          const void *x, int64_t ldx, int64_t nr, void *y, int64_t ldy) {
    for (int64_t r = 0; r < nr; r++) {
        float acc[16] = {0}, w[32];
        for (int64_t g = 0; g < gk; g++) {
            q4_group_values(qs + g * 16, half_to_float(d[g]), half_to_float(m[g]), w16, w);
            for (int i = 0; i < 32; i++)
                acc[i % 16] = __builtin_fmaf(xat(dt, x, r * ldx + g * 32 + i), w[i], acc[i % 16]);
        }
        put(dt, y, r * ldy, tree16(acc));
    }
}

static void q8_col_scalar(int dt, int w16, const int8_t *wq, const uint16_t *d, int64_t gk, const void *x,
                          int64_t ldx, int64_t nr, void *y, int64_t ldy) {
    for (int64_t r = 0; r < nr; r++) {
        float acc[16] = {0};
        for (int64_t g = 0; g < gk; g++) {
            float dg = half_to_float(d[g]);
            for (int i = 0; i < 32; i++) {
                float w = (float)wq[g * 32 + i] * dg;
                if (w16) w = round_bf16(w);
                acc[i % 16] = __builtin_fmaf(xat(dt, x, r * ldx + g * 32 + i), w, acc[i % 16]);
            }
        }
        put(dt, y, r * ldy, tree16(acc));
    }
}

/* ---------------------------------------------------------------- AVX2 (float32 lanes, two ymm) */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define Q4_HAVE_AVX2 1
static inline float tree256x2(__m256 lo, __m256 hi) {
    __m256 s8 = _mm256_add_ps(lo, hi);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

static inline __m256 round_bf16_256(__m256 v) { /* to nearest even, kept as float32 (no NaN here) */
    __m256i u = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u)));
}

static inline __m256 ld8x(int dt, const void *x, int64_t i) {
    if (dt == 1)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + i))), 16));
    return _mm256_loadu_ps((const float *)x + i);
}

/* 8 weights from 8 bytes of nibbles (hi: the high nibbles), as the runner's float weights. One
 * FMA gives q * d + m's bits: d is a float16 value (at most 11 significant bits) and q < 16, so
 * the product q * d is exact in float32 and the product-then-sum rounds once, as the FMA does. */
static inline __m256 q4_w8(const uint8_t *b, int hi, __m256 dg, __m256 mg, int w16) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)b));
    v = hi ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(15));
    __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), dg, mg);
    return w16 ? round_bf16_256(w) : w;
}

#define Q4_SCALES 32 /* groups whose scales and mins are widened to float32 at once */
#ifndef Q4_AHEAD
#define Q4_AHEAD 2 /* quads of columns ahead the weights are prefetched (a lone row outruns the prefetcher) */
#endif

/* n (<= Q4_SCALES) float16 values to float32, 8 at a time. */
static inline void widen_halves(const uint16_t *h, int64_t n, float *f) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < n; i++) f[i] = _cvtsh_ss(h[i]);
}

/* C output columns (1, 2 or 4; column c's groups at qs + c * gk * 16, its output at y + c) for T
 * rows. Each (row, column) has its own two accumulators, so one row's C columns are 2 C chains of
 * FMAs side by side: a lone row would otherwise wait on one column's chain (two FMAs a group). */
Q4_INLINE void q4_col_avx2_t(int dt, int w16, const uint8_t *qs, const uint16_t *d, const uint16_t *m, int64_t gk,
                             const void *x, int64_t ldx, const int T, const int C, void *y, int64_t ldy) {
    __m256 acc[Q4_TILE][4][2];
    float df[4][Q4_SCALES], mf[4][Q4_SCALES]; /* a run of groups' d and m as float32, broadcast from memory */
    for (int j = 0; j < T; j++)
        for (int c = 0; c < C; c++) acc[j][c][0] = acc[j][c][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < gk; g++) {
        if (g % Q4_SCALES == 0) {
            const int64_t n = gk - g < Q4_SCALES ? gk - g : Q4_SCALES;
            for (int c = 0; c < C; c++) widen_halves(d + c * gk + g, n, df[c]), widen_halves(m + c * gk + g, n, mf[c]);
        }
        for (int c = 0; c < C; c++) {
            const uint8_t *b = qs + (c * gk + g) * 16;
            if (g % 4 == 0) _mm_prefetch((const char *)(b + Q4_AHEAD * 4 * gk * 16), _MM_HINT_T0);
            __m256 dg = _mm256_broadcast_ss(df[c] + g % Q4_SCALES), mg = _mm256_broadcast_ss(mf[c] + g % Q4_SCALES);
            /* elements 0-7, 8-15 (low nibbles of bytes 0-15), 16-23, 24-31 (high nibbles) */
            __m256 w[4] = {q4_w8(b, 0, dg, mg, w16), q4_w8(b + 8, 0, dg, mg, w16), q4_w8(b, 1, dg, mg, w16),
                           q4_w8(b + 8, 1, dg, mg, w16)};
            for (int j = 0; j < T; j++)
                for (int h = 0; h < 4; h++)
                    acc[j][c][h & 1] = _mm256_fmadd_ps(ld8x(dt, x, j * ldx + g * 32 + 8 * h), w[h], acc[j][c][h & 1]);
        }
    }
    for (int j = 0; j < T; j++)
        for (int c = 0; c < C; c++) put(dt, y, j * ldy + c, tree256x2(acc[j][c][0], acc[j][c][1]));
}

Q4_INLINE void q8_col_avx2_t(int dt, int w16, const int8_t *wq, const uint16_t *d, int64_t gk, const void *x,
                             int64_t ldx, const int T, const int C, void *y, int64_t ldy) {
    __m256 acc[Q4_TILE][4][2];
    for (int j = 0; j < T; j++)
        for (int c = 0; c < C; c++) acc[j][c][0] = acc[j][c][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < gk; g++) {
        for (int c = 0; c < C; c++) {
            const int8_t *b = wq + (c * gk + g) * 32;
            if (g % 2 == 0) _mm_prefetch((const char *)(b + Q4_AHEAD * 4 * gk * 32), _MM_HINT_T0);
            __m256 dg = _mm256_set1_ps(_cvtsh_ss(d[c * gk + g])), w[4];
            for (int h = 0; h < 4; h++) {
                __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 8 * h)));
                w[h] = _mm256_mul_ps(_mm256_cvtepi32_ps(v), dg);
                if (w16) w[h] = round_bf16_256(w[h]);
            }
            for (int j = 0; j < T; j++)
                for (int h = 0; h < 4; h++)
                    acc[j][c][h & 1] = _mm256_fmadd_ps(ld8x(dt, x, j * ldx + g * 32 + 8 * h), w[h], acc[j][c][h & 1]);
        }
    }
    for (int j = 0; j < T; j++)
        for (int c = 0; c < C; c++) put(dt, y, j * ldy + c, tree256x2(acc[j][c][0], acc[j][c][1]));
}
#endif

/* ---------------------------------------------------------------- AVX512 (float32 lanes; bf16 dot) */
#if defined(Q4_HAVE_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define Q4_HAVE_AVX512 1
static inline float tree512(__m512 a) {
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    return tree256x2(_mm512_castps512_ps256(a), hi);
}

static inline __m512 round_bf16_512(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)));
}

static inline __m512 ld16x(int dt, const void *x, int64_t i) {
    if (dt == 1)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i))), 16));
    return _mm512_loadu_ps((const float *)x + i);
}

/* A group's 32 weights (lo: elements 0-15, hi: 16-31): its 16 possible values computed once (a
 * float32 product, then a sum, as the dequantized weights were), looked up by nibble. */
Q4_INLINE void q4_w32(const uint8_t *b, __m512 dg, __m512 mg, int w16, __m512 *lo, __m512 *hi) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 table = _mm512_add_ps(_mm512_mul_ps(iota, dg), mg);
    if (w16) table = round_bf16_512(table);
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
    *lo = _mm512_permutexvar_ps(v, table); /* the index's low 4 bits: the low nibble */
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
}

/* d[g] (or m[g]) for 16 groups at once, float32; tail zero. */
static inline __m512 halves16(const uint16_t *p, int64_t n) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)(n >= 16 ? 0xffff : (1u << n) - 1), p));
}

/* C output columns (1 or 4) for T rows: each (row, column) its own lanes, so the C columns' chains
 * run side by side (one column's lanes are one dependent chain of FMAs). */
Q4_INLINE void q4_col512_t(int dt, int w16, const uint8_t *qs, const uint16_t *d, const uint16_t *m, int64_t gk,
                           const void *x, int64_t ldx, const int T, const int C, void *y, int64_t ldy) {
    __m512 acc[Q4_TILE][4];
    for (int j = 0; j < T; j++)
        for (int c = 0; c < C; c++) acc[j][c] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < gk; g0 += 16) {
        __m512 d16[4], m16[4];
        for (int c = 0; c < C; c++) d16[c] = halves16(d + c * gk + g0, gk - g0), m16[c] = halves16(m + c * gk + g0, gk - g0);
        __m512i idx = _mm512_setzero_si512();
        for (int64_t g = g0; g < gk && g < g0 + 16; g++) {
            __m512 lo[4], hi[4];
            for (int c = 0; c < C; c++)
                q4_w32(qs + (c * gk + g) * 16, _mm512_permutexvar_ps(idx, d16[c]), _mm512_permutexvar_ps(idx, m16[c]),
                       w16, &lo[c], &hi[c]);
            idx = _mm512_add_epi32(idx, _mm512_set1_epi32(1));
            for (int j = 0; j < T; j++) {
                __m512 xl = ld16x(dt, x, j * ldx + g * 32), xh = ld16x(dt, x, j * ldx + g * 32 + 16);
                for (int c = 0; c < C; c++) {
                    acc[j][c] = _mm512_fmadd_ps(xl, lo[c], acc[j][c]);
                    acc[j][c] = _mm512_fmadd_ps(xh, hi[c], acc[j][c]);
                }
            }
        }
    }
    for (int j = 0; j < T; j++)
        for (int c = 0; c < C; c++) put(dt, y, j * ldy + c, tree512(acc[j][c]));
}

Q4_INLINE void q8_w32(const int8_t *wq, __m512 dg, int w16, __m512 *lo, __m512 *hi) {
    *lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)wq))), dg);
    *hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wq + 16)))), dg);
    if (w16) *lo = round_bf16_512(*lo), *hi = round_bf16_512(*hi);
}

Q4_INLINE void q8_col512_t(int dt, int w16, const int8_t *wq, const uint16_t *d, int64_t gk, const void *x,
                           int64_t ldx, const int T, const int C, void *y, int64_t ldy) {
    __m512 acc[Q4_TILE][4];
    for (int j = 0; j < T; j++)
        for (int c = 0; c < C; c++) acc[j][c] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < gk; g0 += 16) {
        __m512 d16[4];
        for (int c = 0; c < C; c++) d16[c] = halves16(d + c * gk + g0, gk - g0);
        __m512i idx = _mm512_setzero_si512();
        for (int64_t g = g0; g < gk && g < g0 + 16; g++) {
            __m512 lo[4], hi[4];
            for (int c = 0; c < C; c++)
                q8_w32(wq + (c * gk + g) * 32, _mm512_permutexvar_ps(idx, d16[c]), w16, &lo[c], &hi[c]);
            idx = _mm512_add_epi32(idx, _mm512_set1_epi32(1));
            for (int j = 0; j < T; j++) {
                __m512 xl = ld16x(dt, x, j * ldx + g * 32), xh = ld16x(dt, x, j * ldx + g * 32 + 16);
                for (int c = 0; c < C; c++) {
                    acc[j][c] = _mm512_fmadd_ps(xl, lo[c], acc[j][c]);
                    acc[j][c] = _mm512_fmadd_ps(xh, hi[c], acc[j][c]);
                }
            }
        }
    }
    for (int j = 0; j < T; j++)
        for (int c = 0; c < C; c++) put(dt, y, j * ldy + c, tree512(acc[j][c]));
}

#if defined(__AVX512BF16__)
#define Q4_HAVE_DP 1
/* bfloat16 rows against C columns' group weights rounded to bf16 (lo | hi: k ascending), VDPBF16PS. */
Q4_INLINE void dp_group(const __m512 *lo, const __m512 *hi, const uint16_t *x, int64_t ldx, int64_t k, const int T,
                        const int C, __m512 (*acc)[4]) {
    __m512bh w[4];
    for (int c = 0; c < C; c++) w[c] = _mm512_cvtne2ps_pbh(hi[c], lo[c]); /* 0-15 from lo, 16-31 from hi */
    for (int j = 0; j < T; j++) {
        __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + j * ldx + k));
        for (int c = 0; c < C; c++) acc[j][c] = _mm512_dpbf16_ps(acc[j][c], xv, w[c]);
    }
}

Q4_INLINE void q4_col_dp_t(const uint8_t *qs, const uint16_t *d, const uint16_t *m, int64_t gk, const uint16_t *x,
                           int64_t ldx, const int T, const int C, uint16_t *y, int64_t ldy) {
    __m512 acc[Q4_TILE][4];
    for (int j = 0; j < T; j++)
        for (int c = 0; c < C; c++) acc[j][c] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < gk; g0 += 16) {
        __m512 d16[4], m16[4];
        for (int c = 0; c < C; c++) d16[c] = halves16(d + c * gk + g0, gk - g0), m16[c] = halves16(m + c * gk + g0, gk - g0);
        __m512i idx = _mm512_setzero_si512();
        for (int64_t g = g0; g < gk && g < g0 + 16; g++) {
            __m512 lo[4], hi[4];
            for (int c = 0; c < C; c++)
                q4_w32(qs + (c * gk + g) * 16, _mm512_permutexvar_ps(idx, d16[c]), _mm512_permutexvar_ps(idx, m16[c]),
                       0, &lo[c], &hi[c]);
            idx = _mm512_add_epi32(idx, _mm512_set1_epi32(1));
            dp_group(lo, hi, x, ldx, g * 32, T, C, acc);
        }
    }
    for (int j = 0; j < T; j++)
        for (int c = 0; c < C; c++) y[j * ldy + c] = f2bf(tree512(acc[j][c]));
}

Q4_INLINE void q8_col_dp_t(const int8_t *wq, const uint16_t *d, int64_t gk, const uint16_t *x, int64_t ldx,
                           const int T, const int C, uint16_t *y, int64_t ldy) {
    __m512 acc[Q4_TILE][4];
    for (int j = 0; j < T; j++)
        for (int c = 0; c < C; c++) acc[j][c] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < gk; g0 += 16) {
        __m512 d16[4];
        for (int c = 0; c < C; c++) d16[c] = halves16(d + c * gk + g0, gk - g0);
        __m512i idx = _mm512_setzero_si512();
        for (int64_t g = g0; g < gk && g < g0 + 16; g++) {
            __m512 lo[4], hi[4];
            for (int c = 0; c < C; c++)
                q8_w32(wq + (c * gk + g) * 32, _mm512_permutexvar_ps(idx, d16[c]), 0, &lo[c], &hi[c]);
            idx = _mm512_add_epi32(idx, _mm512_set1_epi32(1));
            dp_group(lo, hi, x, ldx, g * 32, T, C, acc);
        }
    }
    for (int j = 0; j < T; j++)
        for (int c = 0; c < C; c++) y[j * ldy + c] = f2bf(tree512(acc[j][c]));
}
#endif
#endif

/* ---------------------------------------------------------------- dispatch */
/* Rows in tiles of a constant count (so the lanes stay in registers): a quad of columns takes 8
 * rows x 2 columns while 8 rows remain (each group's weights decoded once for 8 rows), then
 * 4 x 4, then the rest; a lone column 4 x 1. CALL(r, rows, columns, first column offset). */
#define TILES(CALL, QUAD)                                                                                          \
    do {                                                                                                           \
        int64_t r = 0;                                                                                             \
        if (QUAD) {                                                                                                \
            for (; r + 8 <= nr; r += 8) {                                                                          \
                CALL(r, 8, 2, 0);                                                                                  \
                CALL(r, 8, 2, 2);                                                                                  \
            }                                                                                                      \
            for (; r + 4 <= nr; r += 4) CALL(r, 4, 4, 0);                                                          \
            switch (nr - r) {                                                                                      \
            case 3: CALL(r, 3, 4, 0); break;                                                                       \
            case 2: CALL(r, 2, 4, 0); break;                                                                       \
            case 1: CALL(r, 1, 4, 0); break;                                                                       \
            default: break;                                                                                        \
            }                                                                                                      \
        } else {                                                                                                   \
            for (; r + 4 <= nr; r += 4) CALL(r, 4, 1, 0);                                                          \
            switch (nr - r) {                                                                                      \
            case 3: CALL(r, 3, 1, 0); break;                                                                       \
            case 2: CALL(r, 2, 1, 0); break;                                                                       \
            case 1: CALL(r, 1, 1, 0); break;                                                                       \
            default: break;                                                                                        \
            }                                                                                                      \
        }                                                                                                          \
    } while (0)

/* AVX2 (16 registers): 4 rows x 1 column while 4 rows remain, then the rest of the rows a column
 * at a time, except a lone row of a quad: 1 x 4, so it runs four columns' chains side by side
 * (Zen 3, 2 threads, 3,072 x 576 float32: 20 -> 25 Gweights/s; two rows are faster one column at
 * a time, 16 against 14-15). CALL(r, rows, columns, first column offset). */
#define TILES_AVX2(CALL, QUAD)                                                                                     \
    do {                                                                                                           \
        int64_t r = 0;                                                                                             \
        const int cols_ = (QUAD) ? 4 : 1;                                                                          \
        for (; r + 4 <= nr; r += 4)                                                                                \
            for (int o_ = 0; o_ < cols_; o_++) CALL(r, 4, 1, o_);                                                  \
        switch (nr - r) {                                                                                          \
        case 3: for (int o_ = 0; o_ < cols_; o_++) CALL(r, 3, 1, o_); break;                                       \
        case 2: for (int o_ = 0; o_ < cols_; o_++) CALL(r, 2, 1, o_); break;                                       \
        case 1: if (QUAD) CALL(r, 1, 4, 0); else CALL(r, 1, 1, 0); break;                                          \
        default: break;                                                                                            \
        }                                                                                                          \
    } while (0)

/* The lanes path a call takes: 0 the best compiled here, 1 AVX2, 2 scalar (the same bits). */
const char *pc_q4_path(int path) {
#ifdef Q4_HAVE_AVX512
    if (path == 0) return "avx512";
#endif
#ifdef Q4_HAVE_AVX2
    if (path <= 1) return "avx2";
#endif
    (void)path;
    return "scalar";
}

static int mode_of(int dt, int isa) {
    if (dt != 1) return M_F32;
    return (isa == G_AVX512BF16 || isa == G_AMX) ? M_DP : M_W16;
}

static int lanes_kind(int path) {
    const char *p = pc_q4_path(path);
    return p[0] == 's' ? 2 : (strncmp(p, "avx512", 6) == 0 ? 0 : 1);
}

/* y[nr, n] (row stride ldy) = x[nr, k] (row stride ldx) @ W^T, x and y float32 (dt 0) or bfloat16
 * (dt 1), as pc_gemm computes it with GEMM ISA `isa` (G_*) on the dequantized weights. qs: uint8
 * [n, k/32, 16]; d, m: float16 [n, k/32]; k a multiple of 32. path: the lanes path (see
 * pc_q4_path). Returns 0, or -1 when the bf16 dot product is asked for and not compiled here. */
int pc_q4_linear(int dt, int isa, int64_t nr, int64_t n, int64_t k, const void *x, int64_t ldx, const uint8_t *qs,
                 const uint16_t *d, const uint16_t *m, void *y, int64_t ldy, int threads, int path) {
    const int mode = mode_of(dt, isa), kind = lanes_kind(path), w16 = mode == M_W16;
#ifndef Q4_HAVE_DP
    if (mode == M_DP) return -1;
#endif
    if (nr <= 0 || n <= 0) return 0;
    const int64_t gk = k / 32, es = dt == 1 ? 2 : 4, quads = (n + 3) / 4;
    /* AVX512 takes four columns a call (their chains side by side), AVX2 four for a lone row and
     * one otherwise (TILES_AVX2), the scalar path one. On AVX2 lanes a bfloat16 row (dt 1) always
     * has bf16-rounded weights (the dot-product mode took its own branch), so the AVX2 tiles are
     * instantiated with dt and w16 as one constant, 0 or 1. */
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t cq = 0; cq < quads; cq++) {
        const int64_t c0 = cq * 4;
        const int cw = n - c0 >= 4 ? 4 : (int)(n - c0);
        for (int64_t c = c0; c < c0 + cw; c++) {
            const uint8_t *qc = qs + c * gk * 16;
            const uint16_t *dc = d + c * gk, *mc = m + c * gk;
            char *yc = (char *)y + c * es;
            const int C4 = c == c0 && cw == 4; /* this call covers columns c0 .. c0 + 3 */
#ifdef Q4_HAVE_DP
            if (mode == M_DP) {
#define DP(r, t, cc, o)                                                                                              \
    q4_col_dp_t(qc + (o) * gk * 16, dc + (o) * gk, mc + (o) * gk, gk, (const uint16_t *)x + (r) * ldx, ldx, t, cc,   \
                (uint16_t *)yc + (r) * ldy + (o), ldy)
                TILES(DP, C4);
#undef DP
                if (C4) break;
                continue;
            }
#endif
#ifdef Q4_HAVE_AVX512
            if (kind == 0) {
#define L512(r, t, cc, o)                                                                                            \
    q4_col512_t(dt, w16, qc + (o) * gk * 16, dc + (o) * gk, mc + (o) * gk, gk, (const char *)x + (r) * ldx * es, ldx, \
                t, cc, yc + ((r) * ldy + (o)) * es, ldy)
                TILES(L512, C4);
#undef L512
                if (C4) break;
                continue;
            }
#endif
#ifdef Q4_HAVE_AVX2
            if (kind == 1) {
#define L256_(r, t, cc, o, DT)                                                                                       \
    q4_col_avx2_t(DT, DT, qc + (o) * gk * 16, dc + (o) * gk, mc + (o) * gk, gk, (const char *)x + (r) * ldx * es, ldx, \
                  t, cc, yc + ((r) * ldy + (o)) * es, ldy)
#define L256(r, t, cc, o) (dt == 1 ? L256_(r, t, cc, o, 1) : L256_(r, t, cc, o, 0))
                TILES_AVX2(L256, C4);
#undef L256
#undef L256_
                if (C4) break;
                continue;
            }
#endif
            (void)kind, (void)C4;
            q4_col_scalar(dt, w16, qc, dc, mc, gk, x, ldx, nr, yc, ldy);
        }
    }
    return 0;
}

/* The same for Q8_0 weights: wq int8 [n, k/32, 32], d float16 [n, k/32] (w = q * d). */
int pc_q8_linear(int dt, int isa, int64_t nr, int64_t n, int64_t k, const void *x, int64_t ldx, const int8_t *wq,
                 const uint16_t *d, void *y, int64_t ldy, int threads, int path) {
    const int mode = mode_of(dt, isa), kind = lanes_kind(path), w16 = mode == M_W16;
#ifndef Q4_HAVE_DP
    if (mode == M_DP) return -1;
#endif
    if (nr <= 0 || n <= 0) return 0;
    const int64_t gk = k / 32, es = dt == 1 ? 2 : 4, quads = (n + 3) / 4;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t cq = 0; cq < quads; cq++) {
        const int64_t c0 = cq * 4;
        const int cw = n - c0 >= 4 ? 4 : (int)(n - c0);
        for (int64_t c = c0; c < c0 + cw; c++) {
            const int8_t *wc = wq + c * gk * 32;
            const uint16_t *dc = d + c * gk;
            char *yc = (char *)y + c * es;
            const int C4 = c == c0 && cw == 4;
#ifdef Q4_HAVE_DP
            if (mode == M_DP) {
#define DP(r, t, cc, o)                                                                                              \
    q8_col_dp_t(wc + (o) * gk * 32, dc + (o) * gk, gk, (const uint16_t *)x + (r) * ldx, ldx, t, cc,                  \
                (uint16_t *)yc + (r) * ldy + (o), ldy)
                TILES(DP, C4);
#undef DP
                if (C4) break;
                continue;
            }
#endif
#ifdef Q4_HAVE_AVX512
            if (kind == 0) {
#define L512(r, t, cc, o)                                                                                            \
    q8_col512_t(dt, w16, wc + (o) * gk * 32, dc + (o) * gk, gk, (const char *)x + (r) * ldx * es, ldx, t, cc,        \
                yc + ((r) * ldy + (o)) * es, ldy)
                TILES(L512, C4);
#undef L512
                if (C4) break;
                continue;
            }
#endif
#ifdef Q4_HAVE_AVX2
            if (kind == 1) {
#define L256_(r, t, cc, o, DT)                                                                                       \
    q8_col_avx2_t(DT, DT, wc + (o) * gk * 32, dc + (o) * gk, gk, (const char *)x + (r) * ldx * es, ldx, t, cc,        \
                  yc + ((r) * ldy + (o)) * es, ldy)
#define L256(r, t, cc, o) (dt == 1 ? L256_(r, t, cc, o, 1) : L256_(r, t, cc, o, 0))
                TILES_AVX2(L256, C4);
#undef L256
#undef L256_
                if (C4) break;
                continue;
            }
#endif
            (void)kind, (void)C4;
            q8_col_scalar(dt, w16, wc, dc, gk, x, ldx, nr, yc, ldy);
        }
    }
    return 0;
}

/* ================================================================ 8-bit activations (--weights q4a8)
 *
 * pc_q4a8_linear and pc_q8a8_linear compute another model than the functions above: each row is
 * first quantized to 8 bits per group of 32 (as llama.cpp's Q8_1 rows: amax = max |x|, a = amax /
 * 127, x_i -> nearbyint(x_i * (1 / a)), clamped to +-127; s = a * the sum of the group's
 * integers), then each group's dot product is exact integer arithmetic. The float arithmetic is
 * fixed per (row, column), so a row's bits depend only on the row and K:
 *   lane l (0-7) holds the integer sum of elements 4l .. 4l+3 of q * x_int (exact: |sum| < 2^15),
 *   acc_l = fma(d_g * a_g, (float)sum_l, acc_l) over the groups g ascending, from +0;
 *   Q4_1 only: mv_l = fma(m_g, s_g, mv_l) over the groups g = l, l + 8, ... ascending, from +0;
 *   y = tree8(acc) (+ tree8(mv)), tree8(v) = ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)),
 *   rounded once to the output dtype.
 * The AVX2 path (maddubs and madd, also on AVX512 machines), the same tiles with AVX512-VNNI's
 * dot product (vpdpbusd on 256 bits: the best path where the CPU has it) and the scalar path give
 * the same bits (no saturation can occur: |q4 * x| <= 15 * 127, |q8 * x| <= 128 * 127, a pair's
 * sum fits 16 bits, so maddubs's pairs are exact and every lane sum is the integer one).
 *
 * Q4_1 weights come in their own layout here, two groups a 32-byte record: byte i holds element i
 * of group 2p in its low nibble and element i of group 2p + 1 in its high nibble (an odd last
 * group: high nibbles 0), so one load and three instructions give two groups' 64 values. A row
 * reads 0.625 bytes a weight, as with the GGUF's layout.
 *
 * Both formats keep the columns in quads, as the kernels read them: the 32-byte records (Q4_1's
 * pairs, Q8_0's groups) of each whole quad of columns interleaved, record r of column 4j + c at
 * quad j's start + (4 r + c) * 32, and the last n mod 4 columns one after the other as they are.
 * A tile of four columns then reads one sequential stream instead of four at a column's stride,
 * and the hardware prefetcher keeps up: the Q8_0 head (49,152 x 576) from DRAM, 2 threads, in 0.99
 * against 1.57 ms, the time of a plain read of its bytes. */
#define PC_Q4A8_VERSION 1 /* the arithmetic's version (the layout of the weights is not in it: the same bits) */
int pc_q4a8_version(void) { return PC_Q4A8_VERSION; }

/* One row of k floats (x float32 or bfloat16) -> k int8, and per group its scale a and a * sum. */
static void quantize_row8(int dt, const void *x, int64_t k, int8_t *q, float *a, float *s) {
    const int64_t gk = k / 32;
    for (int64_t g = 0; g < gk; g++) {
        float v[32], amax = 0.0f;
        for (int i = 0; i < 32; i++) {
            v[i] = xat(dt, x, g * 32 + i);
            const float av = v[i] < 0 ? -v[i] : v[i];
            amax = av > amax ? av : amax; /* a NaN never wins */
        }
        const float d = amax / 127.0f, id = d > 0.0f && d <= 3.4e38f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int i = 0; i < 32; i++) {
            float t = __builtin_nearbyintf(v[i] * id);
            t = t > 127.0f ? 127.0f : (t < -127.0f ? -127.0f : t);
            if (t != t) t = 0.0f; /* a row with an infinity: inf * 0 */
            q[g * 32 + i] = (int8_t)t;
            sum += (int8_t)t;
        }
        a[g] = d;
        s[g] = d * (float)sum;
    }
}

static inline float tree8(const float *l) {
    const float s4[4] = {l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]};
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* A quantized row as the kernels read it. */
typedef struct {
    const int8_t *q;
    const float *a, *s;
} row8;

static inline int q4pair_at(const uint8_t *qs, int64_t step, int64_t g, int i) { /* element i of group g */
    const uint8_t b = qs[(g / 2) * step + i];
    return g % 2 ? b >> 4 : b & 15;
}

/* One (row, column); step: bytes from one of the column's records to the next (128 in a whole
 * quad, 32 in the last columns). */
static void q4a8_col_scalar(const uint8_t *qs, int64_t step, const uint16_t *d, const uint16_t *m, int64_t gk,
                            row8 x, int dt, void *y) {
    float acc[8] = {0}, mv[8] = {0};
    for (int64_t g = 0; g < gk; g++) {
        const int8_t *xq = x.q + g * 32;
        const float dd = half_to_float(d[g]) * x.a[g];
        for (int l = 0; l < 8; l++) {
            int sum = 0;
            for (int i = 4 * l; i < 4 * l + 4; i++) sum += q4pair_at(qs, step, g, i) * xq[i];
            acc[l] = __builtin_fmaf(dd, (float)sum, acc[l]);
        }
    }
    for (int64_t g = 0; g < gk; g++) mv[g % 8] = __builtin_fmaf(half_to_float(m[g]), x.s[g], mv[g % 8]);
    put(dt, y, 0, tree8(acc) + tree8(mv));
}

static void q8a8_col_scalar(const int8_t *wq, int64_t step, const uint16_t *d, int64_t gk, row8 x, int dt,
                            void *y) {
    float acc[8] = {0};
    for (int64_t g = 0; g < gk; g++) {
        const int8_t *b = wq + g * step, *xq = x.q + g * 32;
        const float dd = half_to_float(d[g]) * x.a[g];
        for (int l = 0; l < 8; l++) {
            int sum = 0;
            for (int i = 4 * l; i < 4 * l + 4; i++) sum += b[i] * xq[i];
            acc[l] = __builtin_fmaf(dd, (float)sum, acc[l]);
        }
    }
    put(dt, y, 0, tree8(acc));
}

#ifdef Q4_HAVE_AVX2
static inline float tree8_256(__m256 v) { /* tree8's order: lanes l + l+4, then (0 + 2) + (1 + 3) */
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

/* Groups (k / 32) the AVX2 tiles take: K <= 32,768, at most 32 KB of scale products on the stack
 * (a tile's own size: T x C x gk rounded up to eight); longer rows take the scalar path. */
#define A8_MAXG 1024

/* dd[(j C + c) gs + g] = d_g * a_g for every group of the tile (before the loop over the weights,
 * so the loop broadcasts each from memory, and a lane of eight is one multiply as the scalar one). */
Q4_INLINE void a8_scales(const uint16_t *d, int64_t gk, const row8 *x, const int T, const int C, float *dd,
                         int64_t gs) {
    const int64_t g8 = gk / 8 * 8;
    for (int c = 0; c < C; c++) {
        for (int64_t g = 0; g < g8; g += 8) {
            const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + c * gk + g)));
            for (int j = 0; j < T; j++)
                _mm256_storeu_ps(dd + (j * C + c) * gs + g, _mm256_mul_ps(d8, _mm256_loadu_ps(x[j].a + g)));
        }
        for (int64_t g = g8; g < gk; g++)
            for (int j = 0; j < T; j++) dd[(j * C + c) * gs + g] = _cvtsh_ss(d[c * gk + g]) * x[j].a[g];
    }
}

/* The Q4_1 mins' term of one (row, column): tree8 of the lanes mv_l (see the block comment). */
static inline float a8_mins(const uint16_t *m, int64_t gk, const row8 *x) {
    const int64_t g8 = gk / 8 * 8;
    __m256 mv = _mm256_setzero_ps();
    for (int64_t g = 0; g < g8; g += 8)
        mv = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + g))), _mm256_loadu_ps(x->s + g), mv);
    if (g8 == gk) return tree8_256(mv);
    float l[8];
    _mm256_storeu_ps(l, mv);
    for (int64_t g = g8; g < gk; g++) l[g % 8] = __builtin_fmaf(_cvtsh_ss(m[g]), x->s[g], l[g % 8]);
    return tree8(l);
}

/* The same term for T rows (1 or 2) x a whole quad's four columns (m: the quad's first column's
 * mins, the others gk apart), a vector over the four columns: four groups' mins of the four
 * columns transposed, then each lane's fma chain and tree8 as a8_mins's. out[4 j + c]. */
Q4_INLINE void a8_mins4(const uint16_t *m, int64_t gk, const row8 *x, const int T, float *out) {
    __m128 mv[2][8];
    for (int j = 0; j < T; j++)
        for (int l = 0; l < 8; l++) mv[j][l] = _mm_setzero_ps();
#define M4_LOAD(g)                                                                                                 \
    __m128 s0 = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(m + (g))));                                         \
    __m128 s1 = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(m + gk + (g))));                                    \
    __m128 s2 = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(m + 2 * gk + (g))));                                \
    __m128 s3 = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(m + 3 * gk + (g))));                                \
    _MM_TRANSPOSE4_PS(s0, s1, s2, s3)
#define M4_FMA(L, g)                                                                                               \
    for (int j = 0; j < T; j++) {                                                                                  \
        mv[j][L] = _mm_fmadd_ps(s0, _mm_set1_ps(x[j].s[(g)]), mv[j][L]);                                           \
        mv[j][L + 1] = _mm_fmadd_ps(s1, _mm_set1_ps(x[j].s[(g) + 1]), mv[j][L + 1]);                               \
        mv[j][L + 2] = _mm_fmadd_ps(s2, _mm_set1_ps(x[j].s[(g) + 2]), mv[j][L + 2]);                               \
        mv[j][L + 3] = _mm_fmadd_ps(s3, _mm_set1_ps(x[j].s[(g) + 3]), mv[j][L + 3]);                               \
    }
    const int64_t g8 = gk / 8 * 8;
    for (int64_t g = 0; g < g8; g += 8) {
        {
            M4_LOAD(g);
            M4_FMA(0, g);
        }
        {
            M4_LOAD(g + 4);
            M4_FMA(4, g + 4);
        }
    }
    int64_t g = g8;
    if (gk - g >= 4) {
        M4_LOAD(g);
        M4_FMA(0, g);
        g += 4;
    }
#undef M4_FMA
#undef M4_LOAD
    for (int j = 0; j < T; j++) {
        float l[8][4];
        for (int i = 0; i < 8; i++) _mm_storeu_ps(l[i], mv[j][i]);
        for (int64_t h = g; h < gk; h++) /* the last groups (at most three), lane h mod 8 */
            for (int c = 0; c < 4; c++) l[h % 8][c] = __builtin_fmaf(_cvtsh_ss(m[c * gk + h]), x[j].s[h], l[h % 8][c]);
        const __m128 v0 = _mm_loadu_ps(l[0]), v1 = _mm_loadu_ps(l[1]), v2 = _mm_loadu_ps(l[2]), v3 = _mm_loadu_ps(l[3]);
        const __m128 v4 = _mm_loadu_ps(l[4]), v5 = _mm_loadu_ps(l[5]), v6 = _mm_loadu_ps(l[6]), v7 = _mm_loadu_ps(l[7]);
        _mm_storeu_ps(out + 4 * j, _mm_add_ps(_mm_add_ps(_mm_add_ps(v0, v4), _mm_add_ps(v2, v6)),
                                              _mm_add_ps(_mm_add_ps(v1, v5), _mm_add_ps(v3, v7))));
    }
}

/* A group's eight lane sums (unsigned W times signed X, four products a lane): AVX2's maddubs and
 * madd, or with V one AVX512-VNNI dot product (the same integers: no pair saturates, see above). */
#ifdef __AVX512VNNI__
#define A8_DOT(W, X) (V ? _mm256_dpbusd_epi32(_mm256_setzero_si256(), W, X) : _mm256_madd_epi16(_mm256_maddubs_epi16(W, X), ones))
#else
#define A8_DOT(W, X) _mm256_madd_epi16(_mm256_maddubs_epi16(W, X), ones)
#endif
#define A8_FMA(j, c, W, X, g)                                                                                      \
    acc[j][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(dd + ((j) * C + (c)) * gs + (g)), _mm256_cvtepi32_ps(A8_DOT(W, X)), \
                                acc[j][c])

/* T rows (1 or 2) x C columns: a whole quad (C = 4, its records interleaved: record r of column c
 * at qs + (4 r + c) * 32) or one of the last columns (C = 1, its records one after the other);
 * output at y + c. */
Q4_INLINE void q4a8_avx2_t(const uint8_t *qs, const uint16_t *d, const uint16_t *m, int64_t gk, const row8 *x,
                           const int T, const int C, const int V, int dt, void *y, int64_t ldy) {
    (void)V; /* read only where the build has AVX512-VNNI (A8_DOT) */
    const __m256i lo4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const int64_t gp = gk / 2; /* whole records (an odd last group after the loop) */
    const int64_t gs = (gk + 7) / 8 * 8;
    float dd[T * C * gs];
    a8_scales(d, gk, x, T, C, dd, gs);
    float mins[8];
    if (C == 4) a8_mins4(m, gk, x, T, mins);
    __m256 acc[2][4];
    for (int j = 0; j < T; j++)
        for (int c = 0; c < C; c++) acc[j][c] = _mm256_setzero_ps();
    for (int64_t p = 0; p < gp; p++) {
        __m256i xa[2], xb[2];
        for (int j = 0; j < T; j++) {
            xa[j] = _mm256_loadu_si256((const __m256i *)(x[j].q + p * 64));
            xb[j] = _mm256_loadu_si256((const __m256i *)(x[j].q + p * 64 + 32));
        }
        for (int c = 0; c < C; c++) {
            const uint8_t *b = qs + (p * C + c) * 32; /* C = 1: qs + p * 32 */
            if (c % 2 == 0 && (C == 4 || p % 2 == 0))
                _mm_prefetch((const char *)(b + Q4_AHEAD * 4 * ((gk + 1) / 2) * 32), _MM_HINT_T0);
            const __m256i v = _mm256_loadu_si256((const __m256i *)b);
            const __m256i wl = _mm256_and_si256(v, lo4), wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
            for (int j = 0; j < T; j++) {
                A8_FMA(j, c, wl, xa[j], 2 * p);
                A8_FMA(j, c, wh, xb[j], 2 * p + 1);
            }
        }
    }
    if (gk % 2)
        for (int c = 0; c < C; c++) {
            const __m256i wl = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(qs + (gp * C + c) * 32)), lo4);
            for (int j = 0; j < T; j++) A8_FMA(j, c, wl, _mm256_loadu_si256((const __m256i *)(x[j].q + gp * 64)), gk - 1);
        }
    for (int j = 0; j < T; j++)
        for (int c = 0; c < C; c++) put(dt, y, j * ldy + c, tree8_256(acc[j][c]) + (C == 4 ? mins[4 * j + c] : a8_mins(m + c * gk, gk, x + j)));
}

Q4_INLINE void q8a8_avx2_t(const int8_t *wq, const uint16_t *d, int64_t gk, const row8 *x, const int T, const int C,
                           const int V, int dt, void *y, int64_t ldy) {
    (void)V; /* read only where the build has AVX512-VNNI (A8_DOT) */
    const __m256i ones = _mm256_set1_epi16(1);
    const int64_t gs = (gk + 7) / 8 * 8;
    float dd[T * C * gs];
    a8_scales(d, gk, x, T, C, dd, gs);
    __m256 acc[2][4];
    for (int j = 0; j < T; j++)
        for (int c = 0; c < C; c++) acc[j][c] = _mm256_setzero_ps();
    for (int64_t g = 0; g < gk; g++) {
        __m256i xv[2];
        for (int j = 0; j < T; j++) xv[j] = _mm256_loadu_si256((const __m256i *)(x[j].q + g * 32));
        for (int c = 0; c < C; c++) {
            const int8_t *b = wq + (g * C + c) * 32; /* as q4a8_avx2_t's records */
            if (c % 2 == 0 && (C == 4 || g % 2 == 0)) _mm_prefetch((const char *)(b + Q4_AHEAD * 4 * gk * 32), _MM_HINT_T0);
            const __m256i w = _mm256_loadu_si256((const __m256i *)b), aw = _mm256_sign_epi8(w, w);
            for (int j = 0; j < T; j++) A8_FMA(j, c, aw, _mm256_sign_epi8(xv[j], w), g);
        }
    }
    for (int j = 0; j < T; j++)
        for (int c = 0; c < C; c++) put(dt, y, j * ldy + c, tree8_256(acc[j][c]));
}
#undef A8_FMA
#undef A8_DOT

#endif

/* Whether the best path's AVX512-VNNI dot product is compiled here and this CPU runs it. */
static int a8_vnni(void) {
#if defined(Q4_HAVE_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return __builtin_cpu_supports("avx512vnni");
#else
    return 0;
#endif
}

/* The tiles a q4a8/q8a8 call with lanes path `path` runs (0 the best here, 1 AVX2, 2 scalar). */
const char *pc_q4a8_path(int path) {
    const int kind = lanes_kind(path);
    return kind == 2 ? "scalar" : (kind == 0 && a8_vnni() ? "avx512vnni" : "avx2");
}

/* Rows quantized once a call (one allocation). */
static row8 *quantize_rows(int dt, const void *x, int64_t ldx, int64_t nr, int64_t k, void **mem) {
    const int64_t gk = k / 32, es = dt == 1 ? 2 : 4;
    char *p = malloc((size_t)(nr * ((int64_t)sizeof(row8) + 8 * gk + k) + 64));
    *mem = p;
    if (!p) return NULL;
    row8 *rows = (row8 *)p;
    float *f = (float *)(p + nr * sizeof(row8));
    int8_t *q = (int8_t *)(f + 2 * nr * gk);
    for (int64_t r = 0; r < nr; r++) {
        float *a = f + 2 * r * gk, *s = a + gk;
        rows[r] = (row8){q + r * k, a, s};
        quantize_row8(dt, (const char *)x + r * ldx * es, k, q + r * k, a, s);
    }
    return rows;
}

/* The two entry points' one driver: wq is Q4_1's two-group records (m its mins) or, where m is
 * NULL, Q8_0's int8 groups. Rows quantized once (one allocation), then the columns split across
 * threads in quads. */
static int a8_linear(int dt, int64_t nr, int64_t n, int64_t k, const void *x, int64_t ldx, const void *wq,
                     const uint16_t *d, const uint16_t *m, void *y, int64_t ldy, int threads, int path) {
    if (nr <= 0 || n <= 0) return 0;
    void *mem;
    const row8 *rows = quantize_rows(dt, x, ldx, nr, k, &mem);
    if (!rows) return -3;
    const int64_t gk = k / 32, es = dt == 1 ? 2 : 4, quads = (n + 3) / 4;
    const int64_t stride = m ? (gk + 1) / 2 * 32 : gk * 32; /* a column's bytes of weights */
    const uint8_t *w = (const uint8_t *)wq;
    const int kind = lanes_kind(path);
    const int vnni = kind == 0 && a8_vnni(); /* the best path: AVX512-VNNI's dot product where it runs */
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t cq = 0; cq < quads; cq++) {
        const int64_t c0 = cq * 4, cw = n - c0 >= 4 ? 4 : n - c0;
#ifdef Q4_HAVE_AVX2
        if (kind != 2 && gk <= A8_MAXG) {
            /* a quad's rows two at a time (its weights stay in L1 between the passes), a lone one;
             * a quad's columns in one call, the last columns of a ragged n one a call */
            for (int64_t r = 0; r < nr; r += 2) {
                const int t = nr - r >= 2 ? 2 : 1;
                for (int64_t c = c0; c < c0 + cw; c += cw == 4 ? 4 : 1) {
                    const int C = cw == 4 ? 4 : 1;
                    char *yc = (char *)y + (r * ldy + c) * es;
#define A8_CALL(T, CC, V)                                                                                            \
    (m ? q4a8_avx2_t(w + c * stride, d + c * gk, m + c * gk, gk, rows + r, T, CC, V, dt, yc, ldy)                    \
       : q8a8_avx2_t((const int8_t *)w + c * stride, d + c * gk, gk, rows + r, T, CC, V, dt, yc, ldy))
#define A8_CALLS(V)                                                                                                  \
    do {                                                                                                             \
        if (t == 2 && C == 4) A8_CALL(2, 4, V);                                                                      \
        else if (t == 2) A8_CALL(2, 1, V);                                                                           \
        else if (C == 4) A8_CALL(1, 4, V);                                                                           \
        else A8_CALL(1, 1, V);                                                                                       \
    } while (0)
#ifdef __AVX512VNNI__
                    if (vnni) A8_CALLS(1);
                    else
#endif
                        A8_CALLS(0);
#undef A8_CALLS
#undef A8_CALL
                }
            }
            continue;
        }
#endif
        (void)kind, (void)vnni;
        for (int64_t r = 0; r < nr; r++)
            for (int64_t c = c0; c < c0 + cw; c++) {
                char *yc = (char *)y + (r * ldy + c) * es;
                /* a whole quad's column: its records every 128 bytes from the quad's start + c mod 4 */
                const uint8_t *wc = cw == 4 ? w + c0 * stride + (c - c0) * 32 : w + c * stride;
                const int64_t step = cw == 4 ? 128 : 32;
                if (m)
                    q4a8_col_scalar(wc, step, d + c * gk, m + c * gk, gk, rows[r], dt, yc);
                else
                    q8a8_col_scalar((const int8_t *)wc, step, d + c * gk, gk, rows[r], dt, yc);
            }
    }
    free(mem);
    return 0;
}

/* y[nr, n] = x[nr, k] @ W^T with 8-bit rows (see above). qs: uint8 [n, (k/32 + 1) / 2, 32] in
 * the two-group records, the columns in quads (see above); d, m: float16 [n, k/32]; x, y: float32
 * (dt 0) or bfloat16 (dt 1); path: the lanes path as pc_q4_linear's (2: scalar). Returns 0, -2
 * without mins, or -3 when out of memory. */
int pc_q4a8_linear(int dt, int64_t nr, int64_t n, int64_t k, const void *x, int64_t ldx, const uint8_t *qs,
                   const uint16_t *d, const uint16_t *m, void *y, int64_t ldy, int threads, int path) {
    if (!m) return -2; /* Q4_1 has mins (a NULL would read the records as Q8_0 groups) */
    return a8_linear(dt, nr, n, k, x, ldx, qs, d, m, y, ldy, threads, path);
}

/* The same for Q8_0 weights (wq int8 [n, k/32, 32], columns in quads; d float16 [n, k/32]; no mins). */
int pc_q8a8_linear(int dt, int64_t nr, int64_t n, int64_t k, const void *x, int64_t ldx, const int8_t *wq,
                   const uint16_t *d, void *y, int64_t ldy, int threads, int path) {
    return a8_linear(dt, nr, n, k, x, ldx, wq, d, NULL, y, ldy, threads, path);
}
