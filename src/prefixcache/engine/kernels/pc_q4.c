/* 4-bit weights (Q4_1 groups of 32): y = x @ W^T, rows invariant by construction.
 *
 * W [N, K] is stored per output row n as K/32 groups: 16 bytes of nibbles (byte j holds element j
 * in its low nibble and element j + 16 in its high nibble, the GGUF's own order) and a float16
 * scale d and min m per group (the GGUF's own values), so w = d * q + m.
 *
 * The rows are quantized first, per group of 32 and per row alone (the scalar code below, shared
 * by every path): amax = max |x|, s = amax / 127, xq = nearest-even(x * (127 / amax)) in int8
 * (0 where amax is 0), and S = the group's float32 sum of x, left to right. Then for each
 * (row, output n), with groups taken four at a time (a "chunk": 64 bytes of nibbles, 16 lanes of
 * 4 bytes, lane l belonging to group 4c + l / 4):
 *   isum[l] = sum over the lane's 4 bytes of lo * xq_lo + hi * xq_hi   (an exact int32: 8 products)
 *   acc[l]  = fma(float(isum[l]), d_g * s_g, acc[l])                     (chunks ascending)
 *   accm[i] = fma(m_g, S_g, accm[i]) for g = 16 t + i                    (t ascending)
 *   y = the 16 lanes of acc + accm folded in halves (lanes_sum)
 * Past the last group every term is zero (zero-padded rows, masked weight loads). The integer
 * sums are exact, so AVX512-VNNI (VPDPBUSD), AVX512BW and AVX2 (VPMADDUBSW + VPMADDWD, no
 * saturation: |15 * 127 * 2| < 2^15) and the scalar path compute the same bits; each float lane
 * runs the same operations in every path. A row's arithmetic does not depend on its tile, the row
 * count, its position or the thread count (OpenMP splits the output columns only). No fast-math,
 * no compiler FMA contraction (build flags); the FMAs are written out.
 *
 * The Q8_0 product (pc_q8_linear: the GGUF's 8-bit groups, w = d * q with an int8 q, as the
 * embedded model stores its tied embedding and lm_head) uses the same quantized rows in their
 * natural order, two groups a chunk (64 bytes, lane l belonging to group 2c + l / 8):
 *   isum[l] = sum over the lane's 4 bytes of q * xq                      (exact: |q| <= 128)
 *   acc[l]  = fma(float(isum[l]), d_g * s_g, acc[l]); y = acc folded in halves
 * (AVX512 multiplies |q| by xq with q's sign moved onto xq, AVX2 the same with VPSIGNB.)
 *
 * This is the arithmetic llama.cpp's Q4_1 x Q8_1 dot product uses (8-bit activations): another
 * model numerically than the float weights, which is why the 4-bit format has its own namespace
 * and its quality is measured (benchmarks/bench_quality.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define PC_Q4_VERSION 4
#define Q4_TILE 4

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

static float bf16_to_float(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint16_t float_to_bf16(float f) { /* round to nearest even (NaN kept quiet) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 64);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

/* One row, quantized: q holds chunks of 128 bytes (the 64 low-nibble partners, then the 64
 * high-nibble partners, group-major), s4 the chunk's 16 lane scales (s of the lane's group), S the
 * group sums padded to a multiple of 16. */
typedef struct {
    int8_t *q;
    float *s4;
    float *S;
} q8row;

static void quantize_row(const float *x, int64_t gk, int64_t chunks, int64_t sums, q8row r) {
    memset(r.q, 0, (size_t)(chunks * 128));
    memset(r.s4, 0, (size_t)(chunks * 16) * sizeof(float));
    memset(r.S, 0, (size_t)sums * sizeof(float));
    for (int64_t g = 0; g < gk; g++) {
        const float *xg = x + g * 32;
        float amax = 0.0f, sum = 0.0f;
        for (int i = 0; i < 32; i++) {
            float a = fabsf(xg[i]);
            amax = a > amax ? a : amax;
            sum += xg[i];
        }
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f, s = amax / 127.0f;
        int8_t *lo = r.q + (g / 4) * 128 + (g % 4) * 16, *hi = lo + 64;
        for (int i = 0; i < 16; i++) {
            lo[i] = (int8_t)nearbyintf(xg[i] * inv);
            hi[i] = (int8_t)nearbyintf(xg[16 + i] * inv);
        }
        for (int l = 0; l < 4; l++) r.s4[(g / 4) * 16 + (g % 4) * 4 + l] = s;
        r.S[g] = sum;
    }
}

/* The final sum, in the fixed order of the header: the 16 lanes t folded in halves
 * (t[i] + t[i + 8], then + 4, + 2, + 1), as a vector path reduces its register. */
static float fold16(float *t) {
    for (int w = 8; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) t[i] = t[i] + t[i + w];
    return t[0];
}

static float lanes_sum(const float *acc, const float *accm) {
    float t[16];
    for (int l = 0; l < 16; l++) t[l] = acc[l] + accm[l];
    return fold16(t);
}

/* One row for the Q8_0 product: the same quantized values in their natural order, groups padded
 * to an even count; s8 holds each two-group chunk's 16 lane scales (s of the lane's group). */
typedef struct {
    int8_t *q;
    float *s8;
} q8nat;

static void quantize_row_nat(const float *x, int64_t gk, int64_t pairs, q8nat r) {
    memset(r.q, 0, (size_t)(pairs * 64));
    memset(r.s8, 0, (size_t)(pairs * 16) * sizeof(float));
    for (int64_t g = 0; g < gk; g++) {
        const float *xg = x + g * 32;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) {
            float a = fabsf(xg[i]);
            amax = a > amax ? a : amax;
        }
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f, s = amax / 127.0f;
        for (int i = 0; i < 32; i++) r.q[g * 32 + i] = (int8_t)nearbyintf(xg[i] * inv);
        for (int l = 0; l < 8; l++) r.s8[(g / 2) * 16 + (g % 2) * 8 + l] = s;
    }
}

static void q8_col_scalar(const int8_t *wq, const uint16_t *d, int64_t gk, const q8nat *rows, int64_t nr,
                          float *y, int64_t ldy) {
    int64_t pairs = (gk + 1) / 2;
    for (int64_t r = 0; r < nr; r++) {
        float acc[16] = {0};
        for (int64_t c = 0; c < pairs; c++)
            for (int l = 0; l < 16; l++) {
                int64_t g = 2 * c + l / 8;
                if (g >= gk) {
                    acc[l] = __builtin_fmaf(0.0f, 0.0f, acc[l]);
                    continue;
                }
                const int8_t *w = wq + g * 32 + (l % 8) * 4, *xq = rows[r].q + g * 32 + (l % 8) * 4;
                int32_t isum = 0;
                for (int t = 0; t < 4; t++) isum += w[t] * xq[t];
                float s = half_to_float(d[g]) * rows[r].s8[c * 16 + l];
                acc[l] = __builtin_fmaf((float)isum, s, acc[l]);
            }
        y[r * ldy] = fold16(acc);
    }
}

static void q4_col_scalar(const uint8_t *qs, const uint16_t *d, const uint16_t *m, int64_t gk,
                          const q8row *rows, int64_t nr, float *y, int64_t ldy) {
    int64_t chunks = (gk + 3) / 4;
    for (int64_t r = 0; r < nr; r++) {
        float acc[16] = {0}, accm[16] = {0};
        for (int64_t c = 0; c < chunks; c++) {
            for (int l = 0; l < 16; l++) {
                int64_t g = 4 * c + l / 4;
                if (g >= gk) {
                    acc[l] = __builtin_fmaf(0.0f, 0.0f, acc[l]);
                    continue;
                }
                const uint8_t *b = qs + g * 16 + (l % 4) * 4;
                const int8_t *xl = rows[r].q + c * 128 + l * 4, *xh = xl + 64;
                int32_t isum = 0;
                for (int t = 0; t < 4; t++) isum += (b[t] & 15) * xl[t] + (b[t] >> 4) * xh[t];
                float s = half_to_float(d[g]) * rows[r].s4[c * 16 + l];
                acc[l] = __builtin_fmaf((float)isum, s, acc[l]);
            }
        }
        for (int64_t t = 0; t < (gk + 15) / 16; t++)
            for (int i = 0; i < 16; i++) {
                int64_t g = 16 * t + i;
                float mg = g < gk ? half_to_float(m[g]) : 0.0f;
                accm[i] = __builtin_fmaf(mg, rows[r].S[g], accm[i]);
            }
        y[r * ldy] = lanes_sum(acc, accm);
    }
}

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
/* lanes_sum's folds from its second step on: u[i] + u[i + 4], + 2, + 1. */
static inline float fold8(__m256 u) {
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
    __m128 w = _mm_add_ps(v, _mm_movehl_ps(v, v));
    return _mm_cvtss_f32(_mm_add_ss(w, _mm_shuffle_ps(w, w, 1)));
}

/* 8 float16 (n of them, the rest 0) -> 8 floats. */
static __m256 load_half8(const uint16_t *p, int n) {
    uint16_t t[8] = {0};
    if (n >= 8) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    memcpy(t, p, (size_t)n * 2);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t));
}

#define Q4_INLINE static inline __attribute__((always_inline))

/* One half chunk (two groups, 32 bytes of nibbles in b, their scales in dv) into T rows' lanes. */
Q4_INLINE void half_avx2(__m256i b, __m256 dv, const q8row *rw, int64_t c, int h, const int T, __m256 *acc) {
    const __m256i m15 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256i lo = _mm256_and_si256(b, m15), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m15);
    for (int j = 0; j < T; j++) {
        const int8_t *xq = rw[j].q + c * 128 + h * 32;
        __m256i pl = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xq));
        __m256i ph = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xq + 64)));
        __m256i t = _mm256_add_epi32(_mm256_madd_epi16(pl, ones), _mm256_madd_epi16(ph, ones));
        __m256 s = _mm256_mul_ps(dv, _mm256_loadu_ps(rw[j].s4 + c * 16 + h * 8));
        acc[2 * j + h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), s, acc[2 * j + h]);
    }
}

/* One output column for T (1-4) rows; T a constant after inlining, so the lanes stay in registers. */
Q4_INLINE void col_avx2(const uint8_t *qs, const uint16_t *d, const uint16_t *m, int64_t gk, const q8row *rw,
                        const int T, float *y, int64_t ldy) {
    /* lanes 0-3 take the first group of the half's pair, 4-7 the second */
    const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    __m256 acc[2 * Q4_TILE], accm[2 * Q4_TILE];
    for (int j = 0; j < 2 * T; j++) acc[j] = accm[j] = _mm256_setzero_ps();
    int64_t pairs = gk / 2, p = 0;
    for (; p < pairs; p++) { /* groups 2p, 2p + 1: chunk p / 2, half p % 2 */
        __m256i b = _mm256_loadu_si256((const __m256i *)(qs + p * 32));
        __m128i dh = _mm_cvtsi32_si128(*(const int32_t *)(d + 2 * p)); /* two float16 */
        __m256 dv = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_cvtph_ps(dh)), spread);
        half_avx2(b, dv, rw, p / 2, (int)(p % 2), T, acc);
    }
    if (gk % 2) { /* the last group alone: the other half of its pair is zero */
        __m256i b = _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(qs + p * 32)));
        __m128i dh = _mm_cvtsi32_si128(d[2 * p]);
        __m256 dv = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_cvtph_ps(dh)), spread);
        half_avx2(b, dv, rw, p / 2, (int)(p % 2), T, acc);
        p++;
    }
    for (; p % 2; p++) /* the chunk's missing half: the padding lanes' zero terms */
        half_avx2(_mm256_setzero_si256(), _mm256_setzero_ps(), rw, p / 2, 1, T, acc);
    for (int64_t g = 0; g < gk; g += 8) {
        __m256 mv = load_half8(m + g, gk - g >= 8 ? 8 : (int)(gk - g));
        int h = (int)((g / 8) % 2);
        for (int j = 0; j < T; j++)
            accm[2 * j + h] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(rw[j].S + g), accm[2 * j + h]);
    }
    if ((gk + 7) / 8 % 2) /* the last set's upper half: zero terms */
        for (int j = 0; j < T; j++)
            accm[2 * j + 1] = _mm256_fmadd_ps(_mm256_setzero_ps(), _mm256_setzero_ps(), accm[2 * j + 1]);
    for (int j = 0; j < T; j++)
        y[j * ldy] = fold8(_mm256_add_ps(_mm256_add_ps(acc[2 * j], accm[2 * j]),
                                         _mm256_add_ps(acc[2 * j + 1], accm[2 * j + 1])));
}

static void q4_col_avx2(const uint8_t *qs, const uint16_t *d, const uint16_t *m, int64_t gk,
                        const q8row *rows, int64_t nr, float *y, int64_t ldy) {
    int64_t r = 0;
    for (; r + 4 <= nr; r += 4) col_avx2(qs, d, m, gk, rows + r, 4, y + r * ldy, ldy);
    switch (nr - r) {
    case 3: col_avx2(qs, d, m, gk, rows + r, 3, y + r * ldy, ldy); break;
    case 2: col_avx2(qs, d, m, gk, rows + r, 2, y + r * ldy, ldy); break;
    case 1: col_avx2(qs, d, m, gk, rows + r, 1, y + r * ldy, ldy); break;
    default: break;
    }
}
/* Q8_0: one group (32 int8 weights in w, its scale broadcast in dv) into T rows' lane half h. */
Q4_INLINE void q8_group_avx2(__m256i w, __m256 dv, const q8nat *rw, int64_t g, const int T, __m256 *acc) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i aw = _mm256_abs_epi8(w);
    int h = (int)(g % 2);
    for (int j = 0; j < T; j++) {
        __m256i xs = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(rw[j].q + g * 32)), w);
        __m256i t = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xs), ones);
        __m256 s = _mm256_mul_ps(dv, _mm256_loadu_ps(rw[j].s8 + (g / 2) * 16 + h * 8));
        acc[2 * j + h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), s, acc[2 * j + h]);
    }
}

Q4_INLINE void q8_col_avx2_t(const int8_t *wq, const uint16_t *d, int64_t gk, const q8nat *rw, const int T,
                             float *y, int64_t ldy) {
    __m256 acc[2 * Q4_TILE];
    for (int j = 0; j < 2 * T; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < gk; g++) {
        __m256 dv = _mm256_set1_ps(_cvtsh_ss(d[g]));
        q8_group_avx2(_mm256_loadu_si256((const __m256i *)(wq + g * 32)), dv, rw, g, T, acc);
    }
    if (gk % 2) /* the last chunk's missing group: the padding lanes' zero terms */
        for (int j = 0; j < T; j++)
            acc[2 * j + 1] = _mm256_fmadd_ps(_mm256_setzero_ps(), _mm256_setzero_ps(), acc[2 * j + 1]);
    for (int j = 0; j < T; j++) y[j * ldy] = fold8(_mm256_add_ps(acc[2 * j], acc[2 * j + 1]));
}

static void q8_col_avx2(const int8_t *wq, const uint16_t *d, int64_t gk, const q8nat *rows, int64_t nr, float *y,
                        int64_t ldy) {
    int64_t r = 0;
    for (; r + 4 <= nr; r += 4) q8_col_avx2_t(wq, d, gk, rows + r, 4, y + r * ldy, ldy);
    switch (nr - r) {
    case 3: q8_col_avx2_t(wq, d, gk, rows + r, 3, y + r * ldy, ldy); break;
    case 2: q8_col_avx2_t(wq, d, gk, rows + r, 2, y + r * ldy, ldy); break;
    case 1: q8_col_avx2_t(wq, d, gk, rows + r, 1, y + r * ldy, ldy); break;
    default: break;
    }
}
#define Q4_HAVE_AVX2 1
#endif

#if defined(Q4_HAVE_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
static inline __m512i dot_chunk(__m512i lo, __m512i hi, const int8_t *xq) {
    __m512i xl = _mm512_loadu_si512((const void *)xq), xh = _mm512_loadu_si512((const void *)(xq + 64));
#ifdef __AVX512VNNI__
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xl), hi, xh);
#else
    const __m512i ones = _mm512_set1_epi16(1);
    return _mm512_add_epi32(_mm512_madd_epi16(_mm512_maddubs_epi16(lo, xl), ones),
                            _mm512_madd_epi16(_mm512_maddubs_epi16(hi, xh), ones));
#endif
}

/* One chunk (four groups: 64 bytes of nibbles in b, their scales in dv) into T rows' lanes. */
Q4_INLINE void chunk512(__m512i b, __m512 dv, const q8row *rw, int64_t c, const int T, __m512 *acc) {
    const __m512i m15 = _mm512_set1_epi8(15);
    __m512i lo = _mm512_and_si512(b, m15), hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), m15);
    for (int j = 0; j < T; j++) {
        __m512i t = dot_chunk(lo, hi, rw[j].q + c * 128);
        __m512 s = _mm512_mul_ps(dv, _mm512_loadu_ps(rw[j].s4 + c * 16));
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), s, acc[j]);
    }
}

Q4_INLINE __m512 spread_scales(__m128i dh) {
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    return _mm512_permutexvar_ps(spread, _mm512_castps256_ps512(_mm256_castps128_ps256(_mm_cvtph_ps(dh))));
}

Q4_INLINE void col512(const uint8_t *qs, const uint16_t *d, const uint16_t *m, int64_t gk, const q8row *rw,
                      const int T, float *y, int64_t ldy) {
    __m512 acc[Q4_TILE], accm[Q4_TILE];
    for (int j = 0; j < T; j++) acc[j] = accm[j] = _mm512_setzero_ps();
    int64_t full = gk / 4, c = 0;
    for (; c < full; c++)
        chunk512(_mm512_loadu_si512((const void *)(qs + c * 64)), spread_scales(_mm_loadl_epi64((const __m128i *)(d + 4 * c))),
                 rw, c, T, acc);
    if (gk % 4) {
        int64_t ng = gk % 4;
        __m512i b = _mm512_maskz_loadu_epi8(((__mmask64)1 << (16 * ng)) - 1, qs + c * 64);
        chunk512(b, spread_scales(_mm_maskz_loadu_epi16((__mmask8)((1u << ng) - 1), d + 4 * c)), rw, c, T, acc);
    }
    for (int64_t g = 0; g < gk; g += 16) {
        int64_t n = gk - g < 16 ? gk - g : 16;
        __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), m + g));
        for (int j = 0; j < T; j++) accm[j] = _mm512_fmadd_ps(mv, _mm512_loadu_ps(rw[j].S + g), accm[j]);
    }
    for (int j = 0; j < T; j++) {
        __m512 t = _mm512_add_ps(acc[j], accm[j]);
        __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t), 1));
        y[j * ldy] = fold8(_mm256_add_ps(_mm512_castps512_ps256(t), hi));
    }
}

static void q4_col_avx512(const uint8_t *qs, const uint16_t *d, const uint16_t *m, int64_t gk,
                          const q8row *rows, int64_t nr, float *y, int64_t ldy) {
    int64_t r = 0;
    for (; r + 4 <= nr; r += 4) col512(qs, d, m, gk, rows + r, 4, y + r * ldy, ldy);
    switch (nr - r) {
    case 3: col512(qs, d, m, gk, rows + r, 3, y + r * ldy, ldy); break;
    case 2: col512(qs, d, m, gk, rows + r, 2, y + r * ldy, ldy); break;
    case 1: col512(qs, d, m, gk, rows + r, 1, y + r * ldy, ldy); break;
    default: break;
    }
}
/* Q8_0: one chunk (two groups, 64 int8 weights in w, their scales spread in dv) into T rows. */
Q4_INLINE void q8_chunk512(__m512i w, __m512 dv, const q8nat *rw, int64_t c, const int T, __m512 *acc) {
    __mmask64 neg = _mm512_movepi8_mask(w);
    __m512i aw = _mm512_abs_epi8(w);
    for (int j = 0; j < T; j++) {
        __m512i x = _mm512_loadu_si512((const void *)(rw[j].q + c * 64));
        __m512i xs = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
#ifdef __AVX512VNNI__
        __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, xs);
#else
        __m512i t = _mm512_madd_epi16(_mm512_maddubs_epi16(aw, xs), _mm512_set1_epi16(1));
#endif
        __m512 s = _mm512_mul_ps(dv, _mm512_loadu_ps(rw[j].s8 + c * 16));
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), s, acc[j]);
    }
}

Q4_INLINE void q8_col512_t(const int8_t *wq, const uint16_t *d, int64_t gk, const q8nat *rw, const int T,
                           float *y, int64_t ldy) {
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    __m512 acc[Q4_TILE];
    for (int j = 0; j < T; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < (gk + 1) / 2; c++) {
        int ng = gk - 2 * c >= 2 ? 2 : 1;
        __m512i w = ng == 2 ? _mm512_loadu_si512((const void *)(wq + c * 64))
                            : _mm512_maskz_loadu_epi8(((__mmask64)1 << 32) - 1, wq + c * 64);
        __m128i dh = _mm_maskz_loadu_epi16((__mmask8)((1u << ng) - 1), d + 2 * c);
        __m512 dv = _mm512_permutexvar_ps(spread, _mm512_castps256_ps512(_mm256_castps128_ps256(_mm_cvtph_ps(dh))));
        q8_chunk512(w, dv, rw, c, T, acc);
    }
    for (int j = 0; j < T; j++) {
        __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[j]), 1));
        y[j * ldy] = fold8(_mm256_add_ps(_mm512_castps512_ps256(acc[j]), hi));
    }
}

static void q8_col_avx512(const int8_t *wq, const uint16_t *d, int64_t gk, const q8nat *rows, int64_t nr,
                          float *y, int64_t ldy) {
    int64_t r = 0;
    for (; r + 4 <= nr; r += 4) q8_col512_t(wq, d, gk, rows + r, 4, y + r * ldy, ldy);
    switch (nr - r) {
    case 3: q8_col512_t(wq, d, gk, rows + r, 3, y + r * ldy, ldy); break;
    case 2: q8_col512_t(wq, d, gk, rows + r, 2, y + r * ldy, ldy); break;
    case 1: q8_col512_t(wq, d, gk, rows + r, 1, y + r * ldy, ldy); break;
    default: break;
    }
}
#define Q4_HAVE_AVX512 1
#endif

/* The path a call takes: 0 the best compiled here, 1 AVX2, 2 scalar (all give the same bits). */
const char *pc_q4_path(int path) {
#ifdef Q4_HAVE_AVX512
#ifdef __AVX512VNNI__
    if (path == 0) return "avx512vnni";
#else
    if (path == 0) return "avx512bw";
#endif
#endif
#ifdef Q4_HAVE_AVX2
    if (path <= 1) return "avx2";
#endif
    (void)path;
    return "scalar";
}

/* y[nr, n] (row stride ldy) = x[nr, k] (row stride ldx) @ W^T; x and y float32 (dt 0) or
 * bfloat16 (dt 1). qs: uint8 [n, k/32, 16]; d, m: float16 [n, k/32]; k a multiple of 32.
 * threads: the OpenMP team. Returns 0, or -2 when the row buffers cannot be allocated. */
int pc_q4_linear(int dt, int64_t nr, int64_t n, int64_t k, const void *x, int64_t ldx, const uint8_t *qs,
                 const uint16_t *d, const uint16_t *m, void *y, int64_t ldy, int threads, int path) {
    if (nr <= 0 || n <= 0) return 0;
    const char *p = pc_q4_path(path);
    int kind = p[0] == 's' ? 2 : (strncmp(p, "avx512", 6) == 0 ? 0 : 1);
    int64_t gk = k / 32, chunks = (gk + 3) / 4, sums = (gk + 15) / 16 * 16;
    size_t per_row = (size_t)(chunks * 128 + (chunks * 16 + sums) * 4);
    char *mem = malloc(per_row * (size_t)nr + 64);
    q8row *rows = malloc(sizeof(q8row) * (size_t)nr);
    float *yf = dt == 1 ? malloc(sizeof(float) * (size_t)(nr * n)) : NULL;
    float *xf = dt == 1 ? malloc(sizeof(float) * (size_t)k) : NULL;
    if (!mem || !rows || (dt == 1 && (!yf || !xf))) {
        free(mem), free(rows), free(yf), free(xf);
        return -2;
    }
    for (int64_t r = 0; r < nr; r++) {
        char *base = mem + per_row * (size_t)r;
        rows[r].q = (int8_t *)base;
        rows[r].s4 = (float *)(base + chunks * 128);
        rows[r].S = rows[r].s4 + chunks * 16;
        const float *xr = (const float *)x + r * ldx;
        if (dt == 1) {
            const uint16_t *xb = (const uint16_t *)x + r * ldx;
            for (int64_t i = 0; i < k; i++) xf[i] = bf16_to_float(xb[i]);
            xr = xf;
        }
        quantize_row(xr, gk, chunks, sums, rows[r]);
    }
    float *out = dt == 1 ? yf : (float *)y;
    int64_t ldo = dt == 1 ? n : ldy;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t c = 0; c < n; c++) {
        const uint8_t *qc = qs + c * gk * 16;
        const uint16_t *dc = d + c * gk, *mc = m + c * gk;
#ifdef Q4_HAVE_AVX512
        if (kind == 0) {
            q4_col_avx512(qc, dc, mc, gk, rows, nr, out + c, ldo);
            continue;
        }
#endif
#ifdef Q4_HAVE_AVX2
        if (kind == 1) {
            q4_col_avx2(qc, dc, mc, gk, rows, nr, out + c, ldo);
            continue;
        }
#endif
        q4_col_scalar(qc, dc, mc, gk, rows, nr, out + c, ldo);
    }
    if (dt == 1)
        for (int64_t r = 0; r < nr; r++)
            for (int64_t c = 0; c < n; c++) ((uint16_t *)y)[r * ldy + c] = float_to_bf16(yf[r * n + c]);
    free(mem), free(rows), free(yf), free(xf);
    return 0;
}

/* y[nr, n] = x[nr, k] @ W^T for Q8_0 weights: wq int8 [n, k/32, 32], d float16 [n, k/32]; the
 * rest as pc_q4_linear. */
int pc_q8_linear(int dt, int64_t nr, int64_t n, int64_t k, const void *x, int64_t ldx, const int8_t *wq,
                 const uint16_t *d, void *y, int64_t ldy, int threads, int path) {
    if (nr <= 0 || n <= 0) return 0;
    const char *p = pc_q4_path(path);
    int kind = p[0] == 's' ? 2 : (strncmp(p, "avx512", 6) == 0 ? 0 : 1);
    int64_t gk = k / 32, pairs = (gk + 1) / 2;
    size_t per_row = (size_t)(pairs * 64 + pairs * 16 * 4);
    char *mem = malloc(per_row * (size_t)nr + 64);
    q8nat *rows = malloc(sizeof(q8nat) * (size_t)nr);
    float *yf = dt == 1 ? malloc(sizeof(float) * (size_t)(nr * n)) : NULL;
    float *xf = dt == 1 ? malloc(sizeof(float) * (size_t)k) : NULL;
    if (!mem || !rows || (dt == 1 && (!yf || !xf))) {
        free(mem), free(rows), free(yf), free(xf);
        return -2;
    }
    for (int64_t r = 0; r < nr; r++) {
        char *base = mem + per_row * (size_t)r;
        rows[r].q = (int8_t *)base;
        rows[r].s8 = (float *)(base + pairs * 64);
        const float *xr = (const float *)x + r * ldx;
        if (dt == 1) {
            const uint16_t *xb = (const uint16_t *)x + r * ldx;
            for (int64_t i = 0; i < k; i++) xf[i] = bf16_to_float(xb[i]);
            xr = xf;
        }
        quantize_row_nat(xr, gk, pairs, rows[r]);
    }
    float *out = dt == 1 ? yf : (float *)y;
    int64_t ldo = dt == 1 ? n : ldy;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t c = 0; c < n; c++) {
        const int8_t *wc = wq + c * gk * 32;
        const uint16_t *dc = d + c * gk;
#ifdef Q4_HAVE_AVX512
        if (kind == 0) {
            q8_col_avx512(wc, dc, gk, rows, nr, out + c, ldo);
            continue;
        }
#endif
#ifdef Q4_HAVE_AVX2
        if (kind == 1) {
            q8_col_avx2(wc, dc, gk, rows, nr, out + c, ldo);
            continue;
        }
#endif
        q8_col_scalar(wc, dc, gk, rows, nr, out + c, ldo);
    }
    if (dt == 1)
        for (int64_t r = 0; r < nr; r++)
            for (int64_t c = 0; c < n; c++) ((uint16_t *)y)[r * ldy + c] = float_to_bf16(yf[r * n + c]);
    free(mem), free(rows), free(yf), free(xf);
    return 0;
}
