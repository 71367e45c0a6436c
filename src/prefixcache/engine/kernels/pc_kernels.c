/* prefixcache's own CPU kernels: paged attention, RMSNorm + residual, RoPE + KV write, SwiGLU.
 *
 * Built on the user's machine (see kernels/build.py): cc -O3 -march=native -fopenmp
 * -ffp-contract=off -fno-fast-math. Called through ctypes with tensor data pointers.
 *
 * Invariance rules (docs/engine.md, "Own kernels"): every output row is computed by the same
 * sequence of IEEE operations whatever the batch, the row count, the chunk or the thread count:
 * - a row's reductions never split across threads; a work item owns whole rows;
 * - reductions run in a fixed order written in this file (16 partial lanes over a fixed index
 *   pattern, then a fixed tree; attention keys in ascending position order, tiles of 16 keys at
 *   absolute multiples of 16), so how the compiler vectorises changes nothing;
 * - FMA only where written as fmaf() (exact, the same bits in hardware or software), no
 *   contraction (-ffp-contract=off), no fast-math;
 * - one exp (vexp) for softmax, its rescaling and SiLU;
 * - no special case for one row, for short contexts or for decode against prefill.
 * A query row's attention reads only keys at positions <= its own; fully masked tiles are never
 * read for it and masked keys inside its last tile are never touched.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define PC_VERSION 2
#define LANES 16 /* partial sums of a reduction; also the attention key tile */
#define PC_ARGS(...) __VA_ARGS__

enum { DT_F32 = 0, DT_BF16 = 1 };

#if defined(__AVX512BF16__)
#define PC_ISA "avx512bf16"
#elif defined(__AVX512F__)
#define PC_ISA "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#define PC_ISA "avx2"
#elif defined(__aarch64__)
#define PC_ISA "neon"
#else
#define PC_ISA "generic"
#endif

/* 16-lane vectors (GCC vector extensions): lane-wise IEEE arithmetic, lowered to one zmm
 * (AVX512), two ymm (AVX2) or scalars. FMA and rounding go through the helpers below so that
 * every ISA computes the same operations. */
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

static inline v16 vsplat(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
static inline v16 vload(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float *p, v16 v) { memcpy(p, &v, sizeof v); }
static inline v16 vsel(v16i mask, v16 a, v16 b) { /* mask ? a : b */
#if defined(__AVX512F__)
    const __mmask16 k = _mm512_test_epi32_mask((__m512i)mask, (__m512i)mask); /* lanes all-ones */
    return (v16)_mm512_mask_blend_ps(k, (__m512)b, (__m512)a);
#else
    return (v16)(((v16i)a & mask) | ((v16i)b & ~mask));
#endif
}
/* a > b ? a : b and a < b ? a : b: what MAXPS / MINPS compute (the second operand when the
 * comparison is false, NaNs included), so the instructions give the same bits as the select. */
static inline v16 vmax(v16 a, v16 b) {
#if defined(__AVX512F__)
    return (v16)_mm512_max_ps((__m512)a, (__m512)b);
#else
    return vsel(a > b, a, b);
#endif
}
static inline v16 vmin(v16 a, v16 b) {
#if defined(__AVX512F__)
    return (v16)_mm512_min_ps((__m512)a, (__m512)b);
#else
    return vsel(a < b, a, b);
#endif
}

static inline v16 vfma(v16 a, v16 b, v16 c) { /* a * b + c, one rounding */
#if defined(__AVX512F__)
    return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX2__) && defined(__FMA__)
    union { v16 v; __m256 h[2]; } x = {a}, y = {b}, z = {c}, r;
    r.h[0] = _mm256_fmadd_ps(x.h[0], y.h[0], z.h[0]);
    r.h[1] = _mm256_fmadd_ps(x.h[1], y.h[1], z.h[1]);
    return r.v;
#else
    v16 r;
    for (int l = 0; l < 16; l++) r[l] = fmaf(a[l], b[l], c[l]);
    return r;
#endif
}

/* exp, lane-wise: the one exp of this file (softmax, its rescaling, SiLU). Cody-Waite reduction
 * by ln 2 (round to nearest by the 1.5 * 2^23 trick), a degree-6 polynomial, 2^k by the exponent
 * field. Below -87.33 (and -inf) exactly +0; above 88.72 saturated. */
static inline v16 vexp(v16 x) {
    const v16i zero = x < -87.33654f;
    x = vmin(vmax(x, vsplat(-87.33654f)), vsplat(88.72283f));
    const v16 k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    v16 t = vfma(k, vsplat(-0.693359375f), x);
    t = vfma(k, vsplat(2.12194440e-4f), t);
    v16 p = vsplat(1.9875691500e-4f);
    p = vfma(p, t, vsplat(1.3981999507e-3f));
    p = vfma(p, t, vsplat(8.3334519073e-3f));
    p = vfma(p, t, vsplat(4.1665795894e-2f));
    p = vfma(p, t, vsplat(1.6666665459e-1f));
    p = vfma(p, t, vsplat(5.0000001201e-1f));
    p = vfma(p, t * t, t) + 1.0f;
    const v16u e = (v16u)((__builtin_convertvector(k, v16i) + 126) << 23); /* 2^(k-1) */
    const v16 r = (p * (v16)e) * 2.0f;
    return (v16)((v16i)r & ~zero);
}

/* Lane sums in one fixed tree: lane l + lane l+8, then +4, +2, +1. */
static inline float vhsum(v16 v) {
    v = v + __builtin_shuffle(v, (v16i){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v = v + __builtin_shuffle(v, (v16i){4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3});
    v = v + __builtin_shuffle(v, (v16i){2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1});
    v = v + __builtin_shuffle(v, (v16i){1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0});
    return v[0];
}

/* Lane maximum (exact in any order). */
static inline float vhmax(v16 v) {
    v = vmax(v, __builtin_shuffle(v, (v16i){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
    v = vmax(v, __builtin_shuffle(v, (v16i){4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3}));
    v = vmax(v, __builtin_shuffle(v, (v16i){2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1}));
    v = vmax(v, __builtin_shuffle(v, (v16i){1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0}));
    return v[0];
}

/* out lane j = vhsum(p[j]) for 16 vectors (the same tree, four levels of pairwise merges). */
static inline __attribute__((always_inline)) v16 vhsum16(const v16 *p) {
    v16 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = __builtin_shuffle(p[2 * i], p[2 * i + 1], (v16i){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
               __builtin_shuffle(p[2 * i], p[2 * i + 1], (v16i){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
    for (int i = 0; i < 4; i++)
        b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], (v16i){0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}) +
               __builtin_shuffle(a[2 * i], a[2 * i + 1], (v16i){4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31});
    for (int i = 0; i < 2; i++)
        c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], (v16i){0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29}) +
               __builtin_shuffle(b[2 * i], b[2 * i + 1], (v16i){2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31});
    return __builtin_shuffle(c[0], c[1], (v16i){0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}) +
           __builtin_shuffle(c[0], c[1], (v16i){1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31});
}

const char *pc_isa(void) { return PC_ISA; }
int pc_version(void) { return PC_VERSION; }
int pc_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* ------------------------------------------------------------------ conversions */
static inline v16 bf16x16_to_f32(const uint16_t *p) {
    v16h h;
    memcpy(&h, p, sizeof h);
    return (v16)(__builtin_convertvector(h, v16u) << 16);
}

static inline void f32x16_to_bf16(uint16_t *p, v16 x) { /* round to nearest even; NaN stays NaN */
    const v16u u = (v16u)x;
    const v16i nan = (v16i)((u & 0x7fffffffu) > 0x7f800000u);
    const v16u r = (v16u)vsel(nan, (v16)((u >> 16) | 0x40u), (v16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16));
    const v16h h = __builtin_convertvector(r, v16h);
    memcpy(p, &h, sizeof h);
}

/* n values (n % 16 == 0) of dtype dt at src + off -> float32 dst */
static inline void load_row(int dt, const void *src, int64_t off, float *dst, int64_t n) {
    if (dt == DT_F32) {
        memcpy(dst, (const float *)src + off, (size_t)n * sizeof(float));
    } else {
        const uint16_t *p = (const uint16_t *)src + off;
        for (int64_t i = 0; i < n; i += LANES) vstore(dst + i, bf16x16_to_f32(p + i));
    }
}

static inline void store_row(int dt, void *dst, int64_t off, const float *src, int64_t n) {
    if (dt == DT_F32) {
        memcpy((float *)dst + off, src, (size_t)n * sizeof(float));
    } else {
        uint16_t *p = (uint16_t *)dst + off;
        for (int64_t i = 0; i < n; i += LANES) f32x16_to_bf16(p + i, vload(src + i));
    }
}

/* Round float32 values to what dtype dt holds (identity for float32). */
static inline void round_to(int dt, float *x, int64_t n) {
    if (dt != DT_BF16) return;
    for (int64_t i = 0; i < n; i += LANES) {
        uint16_t h[LANES];
        f32x16_to_bf16(h, vload(x + i));
        vstore(x + i, bf16x16_to_f32(h));
    }
}

static int threads_or(int nt) { return nt > 0 ? nt : 1; }

static float *falloc(int64_t n) { /* 64-byte aligned, n rounded up to whole vectors */
    return (float *)aligned_alloc(64, (size_t)((n + LANES - 1) / LANES * LANES) * sizeof(float));
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define PC_NATIVE_AVX2 1
/* AVX2 without AVX512: GCC keeps 64-byte vector-extension values in memory there (no register
 * holds one), so the prompt path's inner loops get a 16-lane type of two ymm registers, with
 * each lane's IEEE operations exactly those of the v16 code above (vfma, vexp, vhmax, vhsum's
 * tree): the same bits as the AVX512 build's prompt path. */
typedef struct { __m256 lo, hi; } w16;
static inline w16 wload(const float *p) { return (w16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void wstore(float *p, w16 v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
static inline w16 wsplat(float x) { const __m256 s = _mm256_set1_ps(x); return (w16){s, s}; }
static inline w16 wfma(w16 a, w16 b, w16 c) {
    return (w16){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline w16 wmul(w16 a, w16 b) { return (w16){_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline w16 wadd(w16 a, w16 b) { return (w16){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline w16 wsub(w16 a, w16 b) { return (w16){_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
static inline w16 wmax(w16 a, w16 b) { return (w16){_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
static inline w16 wmin(w16 a, w16 b) { return (w16){_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }

/* vexp, operation for operation. */
static inline w16 wexp(w16 x) {
    const __m256 lim = _mm256_set1_ps(-87.33654f);
    const __m256 zlo = _mm256_cmp_ps(x.lo, lim, _CMP_LT_OQ), zhi = _mm256_cmp_ps(x.hi, lim, _CMP_LT_OQ);
    x = wmin(wmax(x, wsplat(-87.33654f)), wsplat(88.72283f));
    const w16 k = wsub(wadd(wmul(x, wsplat(1.44269504088896341f)), wsplat(12582912.0f)), wsplat(12582912.0f));
    w16 t = wfma(k, wsplat(-0.693359375f), x);
    t = wfma(k, wsplat(2.12194440e-4f), t);
    w16 p = wsplat(1.9875691500e-4f);
    p = wfma(p, t, wsplat(1.3981999507e-3f));
    p = wfma(p, t, wsplat(8.3334519073e-3f));
    p = wfma(p, t, wsplat(4.1665795894e-2f));
    p = wfma(p, t, wsplat(1.6666665459e-1f));
    p = wfma(p, t, wsplat(5.0000001201e-1f));
    p = wadd(wfma(p, wmul(t, t), t), wsplat(1.0f));
    const __m256i b = _mm256_set1_epi32(126);
    const __m256 elo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(k.lo), b), 23));
    const __m256 ehi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(k.hi), b), 23));
    const w16 r = wmul(wmul(p, (w16){elo, ehi}), wsplat(2.0f));
    return (w16){_mm256_andnot_ps(zlo, r.lo), _mm256_andnot_ps(zhi, r.hi)};
}

static inline float whmax(w16 v) { /* exact in any order */
    __m256 a = _mm256_max_ps(v.lo, v.hi);
    __m128 b = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_max_ps(b, _mm_movehl_ps(b, b));
    b = _mm_max_ss(b, _mm_shuffle_ps(b, b, 1));
    return _mm_cvtss_f32(b);
}

/* vhsum's tree: lane l + lane l+8, then +4, +2, +1. */
static inline float whsum(w16 v) {
    const __m256 a = _mm256_add_ps(v.lo, v.hi);
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_shuffle_ps(b, b, 1));
    return _mm_cvtss_f32(b);
}
static inline w16 wdiv(w16 a, w16 b) { return (w16){_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
static inline w16 wneg(w16 a) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    return (w16){_mm256_xor_ps(a.lo, sign), _mm256_xor_ps(a.hi, sign)};
}
#endif

/* ------------------------------------------------------------------ RMSNorm + residual */
/* For each of `rows` rows of `hidden` values (dtype dt; hidden % 16 == 0):
 *   delta != NULL: x = round(x + delta)  (in place; the residual stream)
 *   out = round(w * round(x * (1 / sqrt(mean(x^2) + eps))))   (w NULL: no weight)
 * mean(x^2): 16 lanes (lane = i mod 16, fmaf chains in ascending i), then vhsum's tree. */
void pc_rms_residual(int dt, int64_t rows, int64_t hidden, void *x, const void *delta, const void *w,
                     float eps, void *out, int nthreads) {
#if defined(PC_NATIVE_AVX2)
    if (dt == DT_F32) { /* the same operations as below, on two ymm registers a vector */
        #pragma omp parallel for schedule(static) num_threads(threads_or(nthreads))
        for (int64_t r = 0; r < rows; r++) {
            float *xr = (float *)x + r * hidden, *o = (float *)out + r * hidden;
            if (delta != NULL) {
                const float *dr = (const float *)delta + r * hidden;
                for (int64_t i = 0; i < hidden; i += LANES) wstore(xr + i, wadd(wload(xr + i), wload(dr + i)));
            }
            w16 part = wsplat(0.0f);
            for (int64_t i = 0; i < hidden; i += LANES) part = wfma(wload(xr + i), wload(xr + i), part);
            const w16 inv = wsplat(1.0f / sqrtf(whsum(part) / (float)hidden + eps));
            for (int64_t i = 0; i < hidden; i += LANES) {
                w16 y = wmul(wload(xr + i), inv);
                if (w != NULL) y = wmul(wload((const float *)w + i), y);
                wstore(o + i, y);
            }
        }
        return;
    }
#endif
    #pragma omp parallel num_threads(threads_or(nthreads))
    {
        float *xr = falloc(hidden), *dr = falloc(hidden), *wr = falloc(hidden);
        if (w != NULL) load_row(dt, w, 0, wr, hidden);
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            load_row(dt, x, r * hidden, xr, hidden);
            if (delta != NULL) {
                load_row(dt, delta, r * hidden, dr, hidden);
                for (int64_t i = 0; i < hidden; i += LANES) vstore(xr + i, vload(xr + i) + vload(dr + i));
                round_to(dt, xr, hidden);
                store_row(dt, x, r * hidden, xr, hidden);
            }
            v16 part = vsplat(0.0f);
            for (int64_t i = 0; i < hidden; i += LANES) part = vfma(vload(xr + i), vload(xr + i), part);
            const float inv = 1.0f / sqrtf(vhsum(part) / (float)hidden + eps);
            for (int64_t i = 0; i < hidden; i += LANES) vstore(xr + i, vload(xr + i) * inv);
            round_to(dt, xr, hidden);
            if (w != NULL)
                for (int64_t i = 0; i < hidden; i += LANES) vstore(xr + i, vload(wr + i) * vload(xr + i));
            store_row(dt, out, r * hidden, xr, hidden);
        }
        free(xr);
        free(dr);
        free(wr);
    }
}

/* ------------------------------------------------------------------ RoPE + KV write */
/* qkv: [rows, (H + 2 KV) * D] (dtype dt). Row r has position pos[r] and KV slot slots[r]
 * (block * B + offset). cos/sin: [context, D] (dt). Writes:
 *   q_out [rows, H, D] float32 = rope(q) * scaling
 *   keys[kvh * head_stride + slot * D + d] = round(rope(k)),  values likewise = v
 * rope(x)[d] = x[d] * cos[d] + rot(x)[d] * sin[d], rot(x) = (-x[D/2:], x[:D/2]). */
void pc_rope_kv(int dt, int64_t rows, int64_t H, int64_t KV, int64_t D, const void *qkv,
                const int64_t *pos, const int64_t *slots, const void *cos_t, const void *sin_t,
                float scaling, float *q_out, void *keys, void *values, int64_t head_stride,
                int nthreads) {
    const int64_t width = (H + 2 * KV) * D, half = D / 2;
    #pragma omp parallel num_threads(threads_or(nthreads))
    {
        float *xr = falloc(width), *c = falloc(D), *s = falloc(D), *o = falloc(D);
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            load_row(dt, qkv, r * width, xr, width);
            load_row(dt, cos_t, pos[r] * D, c, D);
            load_row(dt, sin_t, pos[r] * D, s, D);
            for (int64_t h = 0; h < H + KV; h++) {
                const float *x = xr + h * D;
                for (int64_t d = 0; d < half; d++) o[d] = x[d] * c[d] - x[d + half] * s[d];
                for (int64_t d = half; d < D; d++) o[d] = x[d] * c[d] + x[d - half] * s[d];
                if (h < H) {
                    float *q = q_out + (r * H + h) * D;
                    for (int64_t d = 0; d < D; d++) q[d] = o[d] * scaling;
                } else {
                    store_row(dt, keys, (h - H) * head_stride + slots[r] * D, o, D);
                }
            }
            for (int64_t h = 0; h < KV; h++)
                store_row(dt, values, h * head_stride + slots[r] * D, xr + (H + KV + h) * D, D);
        }
        free(xr);
        free(c);
        free(s);
        free(o);
    }
}

/* ------------------------------------------------------------------ SwiGLU */
/* gu: [rows, 2 I] (gate | up; I % 16 == 0), out: [rows, I] = round(silu(gate) * up),
 * silu(g) = g / (1 + exp(-g)). */
void pc_swiglu(int dt, int64_t rows, int64_t I, const void *gu, void *out, int nthreads) {
#if defined(PC_NATIVE_AVX2)
    if (dt == DT_F32) {
        #pragma omp parallel for schedule(static) num_threads(threads_or(nthreads))
        for (int64_t r = 0; r < rows; r++) {
            const float *g = (const float *)gu + r * 2 * I, *u = g + I;
            float *o = (float *)out + r * I;
            for (int64_t i = 0; i < I; i += LANES) {
                const w16 xg = wload(g + i);
                wstore(o + i, wmul(wdiv(xg, wadd(wexp(wneg(xg)), wsplat(1.0f))), wload(u + i)));
            }
        }
        return;
    }
#endif
    #pragma omp parallel num_threads(threads_or(nthreads))
    {
        float *g = falloc(2 * I);
        const float *u = g + I;
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            load_row(dt, gu, r * 2 * I, g, 2 * I);
            for (int64_t i = 0; i < I; i += LANES) {
                const v16 x = vload(g + i);
                vstore(g + i, (x / (vexp(-x) + 1.0f)) * vload(u + i));
            }
            store_row(dt, out, r * I, g, I);
        }
        free(g);
    }
}

/* ------------------------------------------------------------------ paged attention */
/* One call for every row of a step. Segment i: rows [seg[5i], seg[5i] + seg[5i+1]) of q/out at
 * positions seg[5i+2], seg[5i+2] + 1, ...; its block table is tables[seg[5i+3] ...] (pool block
 * indices of positions 0, B, 2B, ...); seg[5i+4]: 1 for a decode row (a generated token), 0 for
 * prompt rows. keys/values: one layer of the pool, [KV, blocks, B, D] (head_stride = blocks * B *
 * D elements). q: [rows, H, D] float32, scaled. out: [rows, H, D] dt. D % 16 == 0.
 *
 * Two kinds of rows, two arithmetics, each the same for a row whatever its chunk, its batch mates
 * or the thread count. Prompt rows are what the cache stores (a hit reads them, a miss recomputes
 * them: both through the prompt path); a decode row's KV is never cached, and a generated token
 * that comes back in the next turn's prompt is prefilled again as a prompt row. So the two paths
 * never have to agree with each other, only each with itself.
 *
 * Work item: (segment, KV head, block of up to QB rows); its G * rows query heads share one
 * pass over the keys (each 16-key tile converted to float32 once). Per query, tiles ascending:
 *   m' = max(m, max_j s_j);  a = exp(m - m');  p_j = exp(s_j - m')
 *   acc = acc a + sum_j p_j v_j   (fmaf, j ascending, only j <= the row's position)
 * out = acc / l. Tiles past the row's position are never read for it.
 * Decode rows: s_j = q . k_j (16 lanes over d, fmaf chains in ascending d, then vhsum's tree),
 *   l = l a + sum_j p_j (vhsum's tree; lanes past the row's position are exact zeros).
 * Prompt rows: s_j = q . k_j with the keys in the lanes (one fmaf chain over d ascending per key;
 *   the tile transposed once for all the item's queries), l kept per lane, lane = position mod 16:
 *   l_lane = l_lane a + p_lane, and l = vhsum(l_lanes) at the end. */
/* ng queries (the query heads of one row that share a KV head) against one 16-key tile (kt,
 * vt: [16][D] float32; nv of the keys visible to the row): the online-softmax update of each
 * query's (m, l, acc) described above. dv = D / 16. Each key's and value's vectors are loaded
 * once for all ng queries; every query's arithmetic is the same as if it were alone. */
static inline __attribute__((always_inline)) void query_tile(const int64_t dv, const int64_t ng, const float *qq,
                                                             int64_t qstride, const float *kt, const float *vt,
                                                             const int64_t nv, float *m, float *l, float *acc,
                                                             v16 *part) {
    v16 qr[ng][dv], ar[ng][dv];
    for (int64_t g = 0; g < ng; g++)
        for (int64_t c = 0; c < dv; c++) qr[g][c] = vload(qq + g * qstride + c * LANES);
    for (int j = 0; j < LANES; j++) {
        const float *kj = kt + j * dv * LANES;
        v16 a[ng];
        for (int64_t g = 0; g < ng; g++) a[g] = vsplat(0.0f);
        for (int64_t c = 0; c < dv; c++) {
            const v16 kc = vload(kj + c * LANES);
            for (int64_t g = 0; g < ng; g++) a[g] = vfma(qr[g][c], kc, a[g]);
        }
        for (int64_t g = 0; g < ng; g++) part[g * LANES + j] = a[g];
    }
    const v16i visible = (v16i){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} < (int32_t)nv;
    float e[ng][LANES];
    v16 sc[ng];
    v16 shift = vsplat(0.0f); /* lane g: m - m' of query g (the exp below is lane-wise: one for all) */
    float mts[ng];
    for (int64_t g = 0; g < ng; g++) {
        sc[g] = vsel(visible, vhsum16(part + g * LANES), vsplat(-INFINITY));
        const float mx = vhmax(sc[g]);
        mts[g] = mx > m[g] ? mx : m[g];
        shift[g] = m[g] - mts[g];
    }
    const v16 alphas = vexp(shift); /* 0 on the first tile (m = -inf) */
    for (int64_t g = 0; g < ng; g++) {
        const float mt = mts[g], alpha = alphas[g];
        const v16 eg = vexp(sc[g] - mt);
        l[g] = l[g] * alpha + vhsum(eg);
        m[g] = mt;
        vstore(e[g], eg);
        const v16 va = vsplat(alpha);
        for (int64_t c = 0; c < dv; c++) ar[g][c] = vload(acc + g * dv * LANES + c * LANES) * va;
    }
    for (int64_t j = 0; j < nv; j++) {
        const float *vj = vt + j * dv * LANES;
        for (int64_t c = 0; c < dv; c++) {
            const v16 vc = vload(vj + c * LANES);
            for (int64_t g = 0; g < ng; g++) ar[g][c] = vfma(vsplat(e[g][j]), vc, ar[g][c]);
        }
    }
    for (int64_t g = 0; g < ng; g++)
        for (int64_t c = 0; c < dv; c++) vstore(acc + g * dv * LANES + c * LANES, ar[g][c]);
}

#define QB 16
#define SEG 5 /* int64 fields per segment */
#define PQ 8  /* prompt queries sharing one pass over a tile's transposed keys */

/* Lane-wise 16x16 transpose (t[d] lane j = r[j] lane d): four levels of two-row shuffles. */
#define PC_T_LEVEL(h, lo, hi)                                                 \
    for (int i = 0; i < 16; i++)                                             \
        if (!(i & (h))) {                                                    \
            const v16 a_ = r[i], b_ = r[i + (h)];                            \
            r[i] = __builtin_shuffle(a_, b_, (v16i)lo);                      \
            r[i + (h)] = __builtin_shuffle(a_, b_, (v16i)hi);                \
        }
static inline void transpose16(v16 *r) {
    PC_T_LEVEL(8, PC_ARGS({0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}),
               PC_ARGS({8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}))
    PC_T_LEVEL(4, PC_ARGS({0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}),
               PC_ARGS({4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31}))
    PC_T_LEVEL(2, PC_ARGS({0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}),
               PC_ARGS({2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31}))
    PC_T_LEVEL(1, PC_ARGS({0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}),
               PC_ARGS({1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}))
}

/* nq prompt queries (q: nq rows of D float32, contiguous) against one tile: kt [D] vectors
 * (lane j: key j's dimension d), vt [16][D], nv keys visible to every one of them. */
static inline __attribute__((always_inline)) void prompt_tile(const int64_t D, const int64_t dv, const int64_t nq,
                                                              const float *q, const v16 *kt, const float *vt,
                                                              const int64_t nv, float *m, v16 *lv, float *acc) {
    v16 sc[nq];
    for (int64_t g = 0; g < nq; g++) sc[g] = vsplat(0.0f);
    for (int64_t d = 0; d < D; d++) {
        const v16 kd = kt[d];
        for (int64_t g = 0; g < nq; g++) sc[g] = vfma(vsplat(q[g * D + d]), kd, sc[g]);
    }
    const v16i visible = (v16i){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} < (int32_t)nv;
    v16 shift = vsplat(0.0f); /* lane g: m - m' of query g */
    float mts[nq];
    for (int64_t g = 0; g < nq; g++) {
        if (nv < LANES) sc[g] = vsel(visible, sc[g], vsplat(-INFINITY));
        const float mx = vhmax(sc[g]);
        mts[g] = mx > m[g] ? mx : m[g];
        shift[g] = m[g] - mts[g];
    }
    const v16 alphas = vexp(shift); /* 0 on the first tile (m = -inf) */
    float e[nq][LANES];
    for (int64_t g = 0; g < nq; g++) {
        const v16 eg = vexp(sc[g] - mts[g]);
        lv[g] = lv[g] * alphas[g] + eg;
        m[g] = mts[g];
        vstore(e[g], eg);
    }
    for (int64_t g0 = 0; g0 < nq; g0 += 4) { /* four queries' accumulators in registers */
        const int64_t ng = nq - g0 < 4 ? nq - g0 : 4;
        v16 ar[ng][dv];
        for (int64_t g = 0; g < ng; g++) {
            const v16 va = vsplat(alphas[g0 + g]);
            for (int64_t c = 0; c < dv; c++) ar[g][c] = vload(acc + (g0 + g) * D + c * LANES) * va;
        }
        for (int64_t j = 0; j < nv; j++) {
            const float *vj = vt + j * D;
            for (int64_t c = 0; c < dv; c++) {
                const v16 vc = vload(vj + c * LANES);
                for (int64_t g = 0; g < ng; g++) ar[g][c] = vfma(vsplat(e[g0 + g][j]), vc, ar[g][c]);
            }
        }
        for (int64_t g = 0; g < ng; g++)
            for (int64_t c = 0; c < dv; c++) vstore(acc + (g0 + g) * D + c * LANES, ar[g][c]);
    }
}

#if defined(PC_NATIVE_AVX2)
void pc_transpose8(const float *src, int64_t lds, float *dst, int64_t ldd); /* pc_gemm.c */

/* ktT[d * 16 + j] = k[j * D + d] for a 16 x D tile (D a multiple of 8), by 8 x 8 transposes. */
static inline void transpose_tile(const float *k, int64_t D, float *ktT) {
    for (int h = 0; h < 2; h++)
        for (int64_t d0 = 0; d0 < D; d0 += 8) pc_transpose8(k + (8 * h) * D + d0, D, ktT + d0 * LANES + 8 * h, LANES);
}

/* nq prompt queries against one tile: ktT [D][16] (lane j: key j), vt [16][D]; prompt_tile's
 * arithmetic. lv: nq rows of 16 floats. */
static inline __attribute__((always_inline)) void prompt_tile_w(const int64_t D, const int64_t dv, const int64_t nq,
                                                                const float *q, const float *ktT, const float *vt,
                                                                const int64_t nv, float *m, float *lv, float *acc) {
    w16 sc[nq];
    for (int64_t g = 0; g < nq; g++) sc[g] = wsplat(0.0f);
    for (int64_t d = 0; d < D; d++) {
        const w16 kd = wload(ktT + d * LANES);
        for (int64_t g = 0; g < nq; g++) sc[g] = wfma(wsplat(q[g * D + d]), kd, sc[g]);
    }
    const __m256i n8 = _mm256_set1_epi32((int)nv);
    const __m256 vlo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(n8, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    const __m256 vhi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(n8, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)));
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    float shift[LANES] = {0}, mts[nq], al[LANES];
    for (int64_t g = 0; g < nq; g++) {
        if (nv < LANES) sc[g] = (w16){_mm256_blendv_ps(ninf, sc[g].lo, vlo), _mm256_blendv_ps(ninf, sc[g].hi, vhi)};
        const float mx = whmax(sc[g]);
        mts[g] = mx > m[g] ? mx : m[g];
        shift[g] = m[g] - mts[g];
    }
    wstore(al, wexp(wload(shift)));
    float e[nq][LANES];
    for (int64_t g = 0; g < nq; g++) {
        const w16 eg = wexp(wsub(sc[g], wsplat(mts[g])));
        wstore(lv + g * LANES, wadd(wmul(wload(lv + g * LANES), wsplat(al[g])), eg));
        m[g] = mts[g];
        wstore(e[g], eg);
    }
    for (int64_t g = 0; g < nq; g++) { /* one query's accumulators in registers at a time */
        w16 ar[dv];
        const w16 va = wsplat(al[g]);
        for (int64_t c = 0; c < dv; c++) ar[c] = wmul(wload(acc + g * D + c * LANES), va);
        for (int64_t j = 0; j < nv; j++) {
            const w16 ej = wsplat(e[g][j]);
            for (int64_t c = 0; c < dv; c++) ar[c] = wfma(ej, wload(vt + j * D + c * LANES), ar[c]);
        }
        for (int64_t c = 0; c < dv; c++) wstore(acc + g * D + c * LANES, ar[c]);
    }
}

/* Queries a call: their scores are 2 PQ_W ymm accumulators, independent FMA chains over d (two
 * FMA pipes at 4 cycles' latency want 8 or more in flight). Six (12 chains, with the key vector 14
 * registers) ran the prompt rows of a cold 2,112-token prompt in 86-89 ms a layer against four's
 * 98-99; eight spill. */
#define PQ_W 6
static void prompt_tile_w_any(const int64_t D, const int64_t nq, const float *q, const float *ktT, const float *vt,
                              const int64_t nv, float *m, float *lv, float *acc) {
    for (int64_t i = 0; i < nq; i += PQ_W) {
        const int64_t n = nq - i < PQ_W ? nq - i : PQ_W;
#define PC_PW(nq_) prompt_tile_w(64, 4, nq_, q + i * D, ktT, vt, nv, m + i, lv + i * LANES, acc + i * D)
        if (D == 64) {
            switch (n) {
            case 6: PC_PW(6); continue;
            case 5: PC_PW(5); continue;
            case 4: PC_PW(4); continue;
            case 3: PC_PW(3); continue;
            case 2: PC_PW(2); continue;
            case 1: PC_PW(1); continue;
            }
        }
#undef PC_PW
        prompt_tile_w(D, D / LANES, n, q + i * D, ktT, vt, nv, m + i, lv + i * LANES, acc + i * D);
    }
}
#endif

/* Constant shapes keep the loops unrolled and the accumulators in registers. */
static void prompt_tile_any(const int64_t D, const int64_t nq, const float *q, const v16 *kt, const float *vt,
                            const int64_t nv, float *m, v16 *lv, float *acc) {
#define PC_PT(nq_) prompt_tile(64, 4, nq_, q, kt, vt, nv, m, lv, acc)
    if (D == 64) {
        switch (nq) {
        case 8: PC_PT(8); return;
        case 7: PC_PT(7); return;
        case 6: PC_PT(6); return;
        case 5: PC_PT(5); return;
        case 4: PC_PT(4); return;
        case 3: PC_PT(3); return;
        case 2: PC_PT(2); return;
        case 1: PC_PT(1); return;
        }
    }
#undef PC_PT
    prompt_tile(D, D / LANES, nq, q, kt, vt, nv, m, lv, acc);
}

/* Ask for the keys and values of positions [t0, t0 + n) of KV head kvh (the next tile) while this
 * one is computed: a tile's rows lie in pool blocks scattered by the block table, where the
 * hardware prefetcher restarts at every block. */
static inline void prefetch_tile(int dt, const void *keys, const void *values, int64_t kvh, int64_t head_stride,
                                 const int32_t *table, int64_t B, int64_t D, int64_t t0, int64_t n) {
    const int64_t es = dt == DT_BF16 ? 2 : 4, bytes = D * es;
    for (int64_t j = 0; j < n; j++) {
        const int64_t p = t0 + j;
        const int64_t off = (kvh * head_stride + ((int64_t)table[p / B] * B + p % B) * D) * es;
        for (int64_t b = 0; b < bytes; b += 64) {
            __builtin_prefetch((const char *)keys + off + b, 0, 3);
            __builtin_prefetch((const char *)values + off + b, 0, 3);
        }
    }
}

/* The tile after the one at t0, as far as position `upto` (the last one a row of the item needs). */
static inline void prefetch_next(int dt, const void *keys, const void *values, int64_t kvh, int64_t head_stride,
                                 const int32_t *table, int64_t B, int64_t D, int64_t t0, int64_t upto) {
    const int64_t next = t0 + LANES;
    if (next <= upto)
        prefetch_tile(dt, keys, values, kvh, head_stride, table, B, D, next,
                      upto - next + 1 < LANES ? upto - next + 1 : LANES);
}

/* Keys and values of positions [t0, t0 + nk) of KV head kvh, float32, into kt / vt [16][D]
 * (kt's rows past nk zeros), then the next tile asked for. */
static inline void load_tile_f32(int dt, const void *keys, const void *values, int64_t kvh, int64_t head_stride,
                                 const int32_t *table, int64_t B, int64_t D, int64_t t0, int64_t nk, int64_t upto,
                                 float *kt, float *vt) {
    for (int64_t j = 0; j < nk; j++) {
        const int64_t p = t0 + j;
        const int64_t off = kvh * head_stride + ((int64_t)table[p / B] * B + p % B) * D;
        load_row(dt, keys, off, kt + j * D, D);
        load_row(dt, values, off, vt + j * D, D);
    }
    if (nk < LANES) memset(kt + nk * D, 0, sizeof(float) * (size_t)((LANES - nk) * D));
    prefetch_next(dt, keys, values, kvh, head_stride, table, B, D, t0, upto);
}

#if defined(__AVX512BF16__)
/* bfloat16 pools on CPUs with AVX512-BF16: the prompt path's two products by VDPBF16PS (pairs of
 * bf16 products added to a float32 lane, in the instruction's fixed order): scores from the
 * query rounded to bf16 (round to nearest even) against the pool's keys, the values weighted by
 * the probabilities rounded to bf16; the running maximum, the exponentials, l and the rescaling
 * stay float32. kt2[dp] lane j: key j's dimensions (2dp, 2dp + 1); v2[k * dv + c] lane i: key
 * 2k's and key 2k + 1's dimension 16c + i. qh: nq rows of D / 2 pairs. A row whose visible keys
 * end inside a pair weights that pair with the second key's value zeroed, so it never touches a
 * key past its position. */
static inline __attribute__((always_inline)) void prompt_tile_bf16(const int64_t D, const int64_t dv,
                                                                   const int64_t nq, const uint32_t *qh,
                                                                   const __m512i *kt2, const __m512i *v2,
                                                                   const int64_t nv, float *m, v16 *lv,
                                                                   float *acc) {
    const int64_t dp2 = D / 2;
    __m512 sc[nq];
    for (int64_t g = 0; g < nq; g++) sc[g] = _mm512_setzero_ps();
    for (int64_t dp = 0; dp < dp2; dp++) {
        const __m512bh kd = (__m512bh)kt2[dp];
        for (int64_t g = 0; g < nq; g++)
            sc[g] = _mm512_dpbf16_ps(sc[g], kd, (__m512bh)_mm512_set1_epi32((int)qh[g * dp2 + dp]));
    }
    const v16i visible = (v16i){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} < (int32_t)nv;
    v16 shift = vsplat(0.0f);
    float mts[nq];
    v16 s[nq];
    for (int64_t g = 0; g < nq; g++) {
        s[g] = (v16)sc[g];
        if (nv < LANES) s[g] = vsel(visible, s[g], vsplat(-INFINITY));
        const float mx = vhmax(s[g]);
        mts[g] = mx > m[g] ? mx : m[g];
        shift[g] = m[g] - mts[g];
    }
    const v16 alphas = vexp(shift);
    uint32_t e[nq][LANES / 2];
    for (int64_t g = 0; g < nq; g++) {
        const v16 eg = vexp(s[g] - mts[g]);
        lv[g] = lv[g] * alphas[g] + eg;
        m[g] = mts[g];
        const __m256bh pb = _mm512_cvtneps_pbh((__m512)eg);
        memcpy(e[g], &pb, sizeof pb);
    }
    const int64_t pairs = (nv + 1) / 2;
    const __m512i first = _mm512_set1_epi32(0xffff); /* key 2k's half of a pair */
    for (int64_t g0 = 0; g0 < nq; g0 += 4) {
        const int64_t ng = nq - g0 < 4 ? nq - g0 : 4;
        __m512 ar[ng][dv];
        for (int64_t g = 0; g < ng; g++) {
            const __m512 va = _mm512_set1_ps(alphas[g0 + g]);
            for (int64_t c = 0; c < dv; c++) ar[g][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (g0 + g) * D + c * LANES), va);
        }
        for (int64_t k = 0; k < pairs; k++) {
            const int half = 2 * k + 1 == nv;
            for (int64_t c = 0; c < dv; c++) {
                __m512i vc = v2[k * dv + c];
                if (half) vc = _mm512_and_si512(vc, first);
                for (int64_t g = 0; g < ng; g++)
                    ar[g][c] = _mm512_dpbf16_ps(ar[g][c], (__m512bh)vc, (__m512bh)_mm512_set1_epi32((int)e[g0 + g][k]));
            }
        }
        for (int64_t g = 0; g < ng; g++)
            for (int64_t c = 0; c < dv; c++) _mm512_storeu_ps(acc + (g0 + g) * D + c * LANES, ar[g][c]);
    }
}

static void prompt_tile_bf16_any(const int64_t D, const int64_t nq, const uint32_t *qh, const __m512i *kt2,
                                 const __m512i *v2, const int64_t nv, float *m, v16 *lv, float *acc) {
#define PC_PT(nq_) prompt_tile_bf16(64, 4, nq_, qh, kt2, v2, nv, m, lv, acc)
    if (D == 64) {
        switch (nq) {
        case 8: PC_PT(8); return;
        case 7: PC_PT(7); return;
        case 6: PC_PT(6); return;
        case 5: PC_PT(5); return;
        case 4: PC_PT(4); return;
        case 3: PC_PT(3); return;
        case 2: PC_PT(2); return;
        case 1: PC_PT(1); return;
        }
    }
#undef PC_PT
    prompt_tile_bf16(D, D / LANES, nq, qh, kt2, v2, nv, m, lv, acc);
}

/* One tile of bf16 keys and values in the layouts above (keys past `last` are zeros). */
static void tile_bf16(const uint16_t *keys, const uint16_t *values, int64_t kvh, int64_t head_stride,
                      const int32_t *table, int64_t B, int64_t D, int64_t t0, int64_t nk, __m512i *kt2, __m512i *v2,
                      uint16_t *raw) {
    const int64_t dv = D / LANES;
    for (int64_t j = 0; j < LANES; j++) { /* raw: [16][D] keys, then [16][D] values */
        if (j < nk) {
            const int64_t p = t0 + j;
            const int64_t off = kvh * head_stride + ((int64_t)table[p / B] * B + p % B) * D;
            memcpy(raw + j * D, keys + off, sizeof(uint16_t) * (size_t)D);
            memcpy(raw + (LANES + j) * D, values + off, sizeof(uint16_t) * (size_t)D);
        } else {
            memset(raw + j * D, 0, sizeof(uint16_t) * (size_t)D);
            memset(raw + (LANES + j) * D, 0, sizeof(uint16_t) * (size_t)D);
        }
    }
    for (int64_t c = 0; c < D / 32; c++) { /* 16 pairs of dimensions at a time */
        v16 r[LANES];
        for (int j = 0; j < LANES; j++) memcpy(&r[j], raw + j * D + c * 32, sizeof r[j]);
        transpose16(r);
        for (int d = 0; d < LANES; d++) memcpy(&kt2[c * LANES + d], &r[d], sizeof r[d]);
    }
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                        37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    const uint16_t *vals = raw + LANES * D;
    for (int64_t k = 0; k < LANES / 2; k++) {
        const uint16_t *a = vals + 2 * k * D, *b = a + D;
        for (int64_t c = 0; c < dv; c++) {
            const __m512i A = _mm512_loadu_si512(a + (c / 2) * 32), Bv = _mm512_loadu_si512(b + (c / 2) * 32);
            v2[k * dv + c] = _mm512_permutex2var_epi16(A, c % 2 ? hi : lo, Bv);
        }
    }
}
#endif

/* Scratch of one thread. */
typedef struct {
    float *kt, *vt, *acc, *m, *l, *row, *qbuf;
    v16 *part, *ktv, *lv;
    uint32_t *qh;  /* bf16 prompt path: the queries' pairs */
    uint16_t *raw; /* bf16 prompt path: a tile's keys and values */
} attn_scratch;

/* Rows [r_in, r_in + nr) of prompt segment sg, KV head kvh. */
static void prompt_item(int dt, int64_t H, int64_t G, int64_t D, const float *q, const void *keys,
                        const void *values, int64_t head_stride, int64_t B, const int64_t *sg, const int32_t *table,
                        int64_t r_in, int64_t nr, int64_t kvh, void *out, attn_scratch *w) {
    const int64_t DV = D / LANES, row0 = sg[0] + r_in, pos0 = sg[2] + r_in, last = pos0 + nr - 1;
    const int64_t nq = nr * G;
    for (int64_t i = 0; i < nq; i++) {
        w->m[i] = -INFINITY;
        w->lv[i] = vsplat(0.0f);
    }
    memset(w->acc, 0, sizeof(float) * (size_t)(nq * D));
    for (int64_t ri = 0; ri < nr; ri++) /* the item's queries, contiguous: row-major (row, g) */
        memcpy(w->qbuf + ri * G * D, q + ((row0 + ri) * H + kvh * G) * D, sizeof(float) * (size_t)(G * D));
#if defined(__AVX512BF16__)
    if (dt == DT_BF16 && D % 32 == 0) {
        for (int64_t i = 0; i < nq; i++)
            for (int64_t c = 0; c < DV; c++) {
                const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(w->qbuf + i * D + c * LANES));
                memcpy(w->qh + i * (D / 2) + c * (LANES / 2), &h, sizeof h);
            }
        __m512i *kt2 = (__m512i *)w->ktv, *v2 = (__m512i *)w->vt;
        for (int64_t t0 = 0; t0 <= last; t0 += LANES) {
            const int64_t nk = last - t0 + 1 < LANES ? last - t0 + 1 : LANES;
            tile_bf16((const uint16_t *)keys, (const uint16_t *)values, kvh, head_stride, table, B, D, t0, nk, kt2,
                      v2, w->raw);
            prefetch_next(dt, keys, values, kvh, head_stride, table, B, D, t0, last);
            int64_t full = t0 + LANES - 1 - pos0;
            if (full < 0) full = 0;
            for (int64_t i = full * G; i < nq; i += PQ) {
                const int64_t n = nq - i < PQ ? nq - i : PQ;
                prompt_tile_bf16_any(D, n, w->qh + i * (D / 2), kt2, v2, LANES, w->m + i, w->lv + i, w->acc + i * D);
            }
            for (int64_t ri = 0; ri < nr && ri < full; ri++) {
                const int64_t p = pos0 + ri;
                if (t0 > p) continue;
                const int64_t i = ri * G;
                prompt_tile_bf16_any(D, G, w->qh + i * (D / 2), kt2, v2, p - t0 + 1, w->m + i, w->lv + i,
                                     w->acc + i * D);
            }
        }
    } else
#endif
#if defined(PC_NATIVE_AVX2)
    const int in_place = dt != DT_BF16 && B == LANES && D % 8 == 0; /* a tile is one pool block */
    for (int64_t t0 = 0; t0 <= last; t0 += LANES) {
        const int64_t nk = last - t0 + 1 < LANES ? last - t0 + 1 : LANES;
        float *ktT = (float *)w->ktv; /* [D][16] */
        const float *vt = w->vt;
        if (in_place) {
            /* keys and values read where they lie (one block of 16 positions: the tile); lanes
             * past nk are read but never used (their scores are replaced, their values not read) */
            const int64_t off = kvh * head_stride + (int64_t)table[t0 / B] * B * D;
            const float *kb = (const float *)keys + off;
            vt = (const float *)values + off;
            prefetch_next(dt, keys, values, kvh, head_stride, table, B, D, t0, last);
            transpose_tile(kb, D, ktT);
        } else {
            load_tile_f32(dt, keys, values, kvh, head_stride, table, B, D, t0, nk, last, w->kt, w->vt);
            for (int64_t j = 0; j < LANES; j++)
                for (int64_t d = 0; d < D; d++) ktT[d * LANES + j] = w->kt[j * D + d];
        }
        int64_t full = t0 + LANES - 1 - pos0;
        if (full < 0) full = 0;
        if (full * G < nq)
            prompt_tile_w_any(D, nq - full * G, w->qbuf + full * G * D, ktT, vt, LANES, w->m + full * G,
                              (float *)(w->lv + full * G), w->acc + full * G * D);
        for (int64_t ri = 0; ri < nr && ri < full; ri++) {
            const int64_t p = pos0 + ri;
            if (t0 > p) continue;
            const int64_t i = ri * G;
            prompt_tile_w_any(D, G, w->qbuf + i * D, ktT, vt, p - t0 + 1, w->m + i, (float *)(w->lv + i),
                              w->acc + i * D);
        }
    }
    if (0)
#endif
    for (int64_t t0 = 0; t0 <= last; t0 += LANES) {
        const int64_t nk = last - t0 + 1 < LANES ? last - t0 + 1 : LANES;
        load_tile_f32(dt, keys, values, kvh, head_stride, table, B, D, t0, nk, last, w->kt, w->vt);
        for (int64_t c = 0; c < DV; c++) { /* ktv[d] lane j = key j, dimension d */
            v16 *r = w->ktv + c * LANES;
            for (int j = 0; j < LANES; j++) r[j] = vload(w->kt + j * D + c * LANES);
            transpose16(r);
        }
        /* rows that see the whole tile: a contiguous run of queries, PQ at a time */
        int64_t full = t0 + LANES - 1 - pos0; /* the first row that sees key t0 + 15 */
        if (full < 0) full = 0;
        for (int64_t i = full * G; i < nq; i += PQ) {
            const int64_t n = nq - i < PQ ? nq - i : PQ;
            prompt_tile_any(D, n, w->qbuf + i * D, w->ktv, w->vt, LANES, w->m + i, w->lv + i, w->acc + i * D);
        }
        /* rows inside the tile: each row's G queries with its own visible count */
        for (int64_t ri = 0; ri < nr && ri < full; ri++) {
            const int64_t p = pos0 + ri;
            if (t0 > p) continue; /* fully masked for this row: never read */
            const int64_t i = ri * G;
            prompt_tile_any(D, G, w->qbuf + i * D, w->ktv, w->vt, p - t0 + 1, w->m + i, w->lv + i, w->acc + i * D);
        }
    }
    for (int64_t i = 0; i < nq; i++) {
        const v16 inv = vsplat(vhsum(w->lv[i]));
        for (int64_t c = 0; c < DV; c++) vstore(w->row + c * LANES, vload(w->acc + i * D + c * LANES) / inv);
        store_row(dt, out, ((row0 + i / G) * H + kvh * G + i % G) * D, w->row, D);
    }
}

/* One decode row's G queries against a tile (query_tile; constant shapes keep a row's vectors in
 * registers, other shapes one query at a time). */
static inline void decode_tile(int64_t DV, int64_t G, int64_t D, const float *qq, const float *kt, const float *vt,
                               int64_t nv, float *m, float *l, float *acc, v16 *part) {
#define PC_TILE(dv_, ng_) query_tile(dv_, ng_, qq, D, kt, vt, nv, m, l, acc, part)
    if (DV == 4 && G == 3) PC_TILE(4, 3);
    else if (DV == 4 && G == 2) PC_TILE(4, 2);
    else if (DV == 4 && G == 4) PC_TILE(4, 4);
    else if (DV == 8 && G == 2) PC_TILE(8, 2);
    else if (DV == 8 && G == 4) PC_TILE(8, 4);
    else if (DV == 1 && G == 2) PC_TILE(1, 2);
    else
        for (int64_t g = 0; g < G; g++) query_tile(DV, 1, qq + g * D, D, kt, vt, nv, m + g, l + g, acc + g * D, part);
#undef PC_TILE
}

/* Rows [r_in, r_in + nr) of decode segment sg, KV head kvh. */
static void decode_item(int dt, int64_t H, int64_t G, int64_t D, const float *q, const void *keys,
                        const void *values, int64_t head_stride, int64_t B, const int64_t *sg, const int32_t *table,
                        int64_t r_in, int64_t nr, int64_t kvh, void *out, attn_scratch *w) {
    const int64_t DV = D / LANES, row0 = sg[0] + r_in, pos0 = sg[2] + r_in, last = pos0 + nr - 1;
    float *kt = w->kt, *vt = w->vt, *acc = w->acc, *m = w->m, *l = w->l, *qbuf = w->qbuf;
    v16 *part = w->part;
    for (int64_t i = 0; i < nr * G; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)(nr * G * D));
    for (int64_t ri = 0; ri < nr; ri++)
        memcpy(qbuf + ri * G * D, q + ((row0 + ri) * H + kvh * G) * D, sizeof(float) * (size_t)(G * D));
    for (int64_t t0 = 0; t0 <= last; t0 += LANES) {
        const int64_t nk = last - t0 + 1 < LANES ? last - t0 + 1 : LANES;
        load_tile_f32(dt, keys, values, kvh, head_stride, table, B, D, t0, nk, last, kt, vt);
        for (int64_t ri = 0; ri < nr; ri++) {
            const int64_t p = pos0 + ri;
            if (t0 > p) continue; /* fully masked for this row: never read */
            const int64_t nv = p - t0 + 1 < LANES ? p - t0 + 1 : LANES;
            const int64_t qi = ri * G;
            const float *qq = qbuf + qi * D;
            if (nv == LANES && ri + 1 < nr && DV == 4 && G == 3) {
                /* two rows that see the whole tile: their 2G queries share each key's and
                 * value's loads (each query's arithmetic is the same as alone) */
                query_tile(4, 6, qq, D, kt, vt, LANES, m + qi, l + qi, acc + qi * D, part);
                ri++;
                continue;
            }
            decode_tile(DV, G, D, qq, kt, vt, nv, m + qi, l + qi, acc + qi * D, part);
        }
    }
    for (int64_t ri = 0; ri < nr; ri++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t qi = ri * G + g;
            const v16 inv = vsplat(l[qi]);
            for (int64_t c = 0; c < DV; c++) vstore(w->row + c * LANES, vload(acc + qi * D + c * LANES) / inv);
            store_row(dt, out, ((row0 + ri) * H + kvh * G + g) * D, w->row, D);
        }
}

/* Decode rows that share pool blocks (requests on one cached prefix) read each shared tile once:
 * a group of up to DG one-row decode segments, sorted by block table, runs as one item per KV head.
 * Each row's arithmetic is exactly decode_item's for that row alone (its tiles in ascending order,
 * its own m, l and acc; a score lane depends only on its own key, masked lanes are replaced and
 * values past the row's position never touched), so grouping changes which loads are shared,
 * never a bit. */
#define DG 4

/* Where decode rows take the prompt rows' arithmetic: bf16 pools on AVX512-BF16 (VDPBF16PS; the
 * float32 decode path would spend its time widening the pool's bf16 keys and values), and every
 * pool on AVX2 without AVX512, where only the prompt path has native 256-bit code (w16); there
 * decode rows are not grouped either (decode_group is the v16 decode arithmetic). */
#if defined(__AVX512BF16__)
#define DECODE_AS_PROMPT(dt, D) ((dt) == DT_BF16 && (D) % 32 == 0)
#elif defined(PC_NATIVE_AVX2)
#define DECODE_AS_PROMPT(dt, D) 1 /* AVX2: every row on the native prompt path (no grouping) */
#else
#define DECODE_AS_PROMPT(dt, D) 0
#endif
/* Whether one-row decode segments are grouped by block table (decode_group): everywhere but on
 * AVX2 pools that decode_group_w cannot read in place (bf16, or blocks other than 16 positions),
 * where each row is its own prompt_item. */
#if defined(PC_NATIVE_AVX2)
#define GROUP_DECODE(dt, B, D) ((dt) == DT_F32 && (B) == LANES && (D) % 8 == 0)
#else
#define GROUP_DECODE(dt, B, D) 1
#endif

/* Positions [t0, t0 + n) lie in the same pool blocks for tables a and b. */
static inline int same_blocks(const int32_t *a, const int32_t *b, int64_t B, int64_t t0, int64_t n) {
    for (int64_t blk = t0 / B; blk <= (t0 + n - 1) / B; blk++)
        if (a[blk] != b[blk]) return 0;
    return 1;
}

/* The group member (i or a later one) through whose table the tile at t0 is read for member i
 * (which sees nv of its keys): of the members sharing i's blocks there, the one that sees the most
 * keys (their count in *nk). */
static inline int64_t tile_anchor(const int64_t *pos, const int32_t *const *tab, int64_t n, int64_t i, int64_t B,
                                  int64_t t0, int64_t nv, int64_t *nk) {
    int64_t at = i;
    *nk = nv;
    for (int64_t j = i + 1; j < n; j++) {
        if (t0 > pos[j]) continue;
        const int64_t nvj = pos[j] - t0 + 1 < LANES ? pos[j] - t0 + 1 : LANES;
        if (nvj > *nk && same_blocks(tab[i], tab[j], B, t0, nv)) {
            at = j;
            *nk = nvj;
        }
    }
    return at;
}

/* Lexicographic order of two one-row segments' block tables (their used blocks). */
static int table_order(const int64_t *seg, const int32_t *tables, int64_t B, int64_t a, int64_t b) {
    const int64_t *sa = seg + SEG * a, *sb = seg + SEG * b;
    const int64_t na = sa[2] / B + 1, nb = sb[2] / B + 1, n = na < nb ? na : nb;
    const int32_t *ta = tables + sa[3], *tb = tables + sb[3];
    for (int64_t i = 0; i < n; i++)
        if (ta[i] != tb[i]) return ta[i] < tb[i] ? -1 : 1;
    return na < nb ? -1 : na > nb ? 1 : 0;
}

static void decode_group(int dt, int64_t H, int64_t G, int64_t D, const float *q, const void *keys,
                         const void *values, int64_t head_stride, int64_t B, const int64_t *seg,
                         const int32_t *tables, const int64_t *members, int64_t n, int64_t kvh, void *out,
                         attn_scratch *w) {
    const int64_t DV = D / LANES;
    float *kt = w->kt, *vt = w->vt, *acc = w->acc, *m = w->m, *l = w->l, *qbuf = w->qbuf;
    int64_t pos[DG], row0[DG], last = 0;
    const int32_t *tab[DG];
    for (int64_t i = 0; i < n; i++) {
        const int64_t *sg = seg + SEG * members[i];
        row0[i] = sg[0];
        pos[i] = sg[2];
        tab[i] = tables + sg[3];
        if (pos[i] > last) last = pos[i];
        memcpy(qbuf + i * G * D, q + (row0[i] * H + kvh * G) * D, sizeof(float) * (size_t)(G * D));
    }
    for (int64_t i = 0; i < n * G; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)(n * G * D));
    for (int64_t t0 = 0; t0 <= last; t0 += LANES) {
        const int32_t *loaded = NULL; /* the table the tile in kt / vt was read through */
        int64_t loaded_nk = 0;
        for (int64_t i = 0; i < n; i++) {
            if (t0 > pos[i]) continue; /* fully masked for this row: never read */
            const int64_t nv = pos[i] - t0 + 1 < LANES ? pos[i] - t0 + 1 : LANES;
            if (loaded == NULL || nv > loaded_nk || !same_blocks(tab[i], loaded, B, t0, nv)) {
                /* read the tile through the row of this and the later rows sharing its blocks that
                 * sees the most keys */
                int64_t nk;
                const int64_t at = tile_anchor(pos, tab, n, i, B, t0, nv, &nk);
                load_tile_f32(dt, keys, values, kvh, head_stride, tab[at], B, D, t0, nk, pos[at], kt, vt);
                loaded = tab[at];
                loaded_nk = nk;
            }
            const int64_t qi = i * G;
            const float *qq = qbuf + qi * D;
            decode_tile(DV, G, D, qq, kt, vt, nv, m + qi, l + qi, acc + qi * D, w->part);
        }
    }
    for (int64_t i = 0; i < n; i++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t qi = i * G + g;
            const v16 inv = vsplat(l[qi]);
            for (int64_t c = 0; c < DV; c++) vstore(w->row + c * LANES, vload(acc + qi * D + c * LANES) / inv);
            store_row(dt, out, ((row0[i]) * H + kvh * G + g) * D, w->row, D);
        }
}

#if defined(__AVX512BF16__)
/* decode_group on bf16 pools with AVX512-BF16: the prompt path's arithmetic (prompt_tile_bf16)
 * for every decode row there, grouped or not (pc_attention sends multi-row decode segments to
 * prompt_item), with the same tile sharing as decode_group. */
static void decode_group_bf16(int64_t H, int64_t G, int64_t D, const float *q, const void *keys, const void *values,
                              int64_t head_stride, int64_t B, const int64_t *seg, const int32_t *tables,
                              const int64_t *members, int64_t n, int64_t kvh, void *out, attn_scratch *w) {
    const int64_t DV = D / LANES, half = D / 2;
    __m512i *kt2 = (__m512i *)w->ktv, *v2 = (__m512i *)w->vt;
    int64_t pos[DG], row0[DG], last = 0;
    const int32_t *tab[DG];
    for (int64_t i = 0; i < n; i++) {
        const int64_t *sg = seg + SEG * members[i];
        row0[i] = sg[0];
        pos[i] = sg[2];
        tab[i] = tables + sg[3];
        if (pos[i] > last) last = pos[i];
        for (int64_t g = 0; g < G; g++)
            for (int64_t c = 0; c < DV; c++) {
                const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(q + (row0[i] * H + kvh * G + g) * D + c * LANES));
                memcpy(w->qh + (i * G + g) * half + c * (LANES / 2), &h, sizeof h);
            }
    }
    for (int64_t i = 0; i < n * G; i++) {
        w->m[i] = -INFINITY;
        w->lv[i] = vsplat(0.0f);
    }
    memset(w->acc, 0, sizeof(float) * (size_t)(n * G * D));
    for (int64_t t0 = 0; t0 <= last; t0 += LANES) {
        const int32_t *loaded = NULL;
        int64_t loaded_nk = 0;
        for (int64_t i = 0; i < n; i++) {
            if (t0 > pos[i]) continue;
            const int64_t nv = pos[i] - t0 + 1 < LANES ? pos[i] - t0 + 1 : LANES;
            if (loaded == NULL || nv > loaded_nk || !same_blocks(tab[i], loaded, B, t0, nv)) {
                int64_t nk;
                const int64_t at = tile_anchor(pos, tab, n, i, B, t0, nv, &nk);
                tile_bf16((const uint16_t *)keys, (const uint16_t *)values, kvh, head_stride, tab[at], B, D, t0, nk,
                          kt2, v2, w->raw);
                prefetch_next(DT_BF16, keys, values, kvh, head_stride, tab[at], B, D, t0, pos[at]);
                loaded = tab[at];
                loaded_nk = nk;
            }
            const int64_t qi = i * G;
            prompt_tile_bf16_any(D, G, w->qh + qi * half, kt2, v2, nv, w->m + qi, w->lv + qi, w->acc + qi * D);
        }
    }
    for (int64_t i = 0; i < n * G; i++) {
        const v16 inv = vsplat(vhsum(w->lv[i]));
        for (int64_t c = 0; c < DV; c++) vstore(w->row + c * LANES, vload(w->acc + i * D + c * LANES) / inv);
        store_row(DT_BF16, out, (row0[i / G] * H + kvh * G + i % G) * D, w->row, D);
    }
}
#endif

#if defined(PC_NATIVE_AVX2)
/* decode_group on AVX2 (float32 pools of 16-position blocks): each row's arithmetic is
 * prompt_item's for that row alone (prompt_tile_w against each tile in ascending order, its own
 * m, lv and acc, nv keys visible), and a tile is one pool block, transposed once for every member
 * that reads the same block there; consecutive members that see the whole tile share one call
 * (a query's arithmetic does not depend on the queries beside it). So grouping changes which
 * loads and transposes are shared, never a bit. */
static void decode_group_w(int64_t H, int64_t G, int64_t D, const float *q, const void *keys, const void *values,
                           int64_t head_stride, const int64_t *seg, const int32_t *tables, const int64_t *members,
                           int64_t n, int64_t kvh, void *out, attn_scratch *w) {
    const int64_t DV = D / LANES;
    float *ktT = (float *)w->ktv, *lv = (float *)w->lv;
    int64_t pos[DG], row0[DG], last = 0;
    const int32_t *tab[DG];
    for (int64_t i = 0; i < n; i++) {
        const int64_t *sg = seg + SEG * members[i];
        row0[i] = sg[0];
        pos[i] = sg[2];
        tab[i] = tables + sg[3];
        if (pos[i] > last) last = pos[i];
        memcpy(w->qbuf + i * G * D, q + (row0[i] * H + kvh * G) * D, sizeof(float) * (size_t)(G * D));
    }
    for (int64_t i = 0; i < n * G; i++) w->m[i] = -INFINITY;
    memset(lv, 0, sizeof(float) * (size_t)(n * G * LANES));
    memset(w->acc, 0, sizeof(float) * (size_t)(n * G * D));
    for (int64_t t0 = 0; t0 <= last; t0 += LANES) {
        int32_t loaded = -1; /* the pool block in ktT */
        const float *vt = NULL;
        for (int64_t i = 0; i < n;) {
            if (t0 > pos[i]) { /* fully masked for this row: never read */
                i++;
                continue;
            }
            const int32_t blk = tab[i][t0 / LANES];
            if (blk != loaded) {
                const int64_t off = kvh * head_stride + (int64_t)blk * LANES * D;
                prefetch_next(DT_F32, keys, values, kvh, head_stride, tab[i], LANES, D, t0, pos[i]);
                transpose_tile((const float *)keys + off, D, ktT);
                vt = (const float *)values + off;
                loaded = blk;
            }
            const int64_t nv = pos[i] - t0 + 1 < LANES ? pos[i] - t0 + 1 : LANES;
            int64_t j = i + 1; /* the run of members after i that see this whole block too */
            if (nv == LANES)
                while (j < n && pos[j] - t0 + 1 >= LANES && tab[j][t0 / LANES] == blk) j++;
            const int64_t qi = i * G;
            prompt_tile_w_any(D, (j - i) * G, w->qbuf + qi * D, ktT, vt, nv, w->m + qi, lv + qi * LANES,
                              w->acc + qi * D);
            i = j;
        }
    }
    for (int64_t i = 0; i < n * G; i++) {
        const v16 inv = vsplat(vhsum(w->lv[i]));
        for (int64_t c = 0; c < DV; c++) vstore(w->row + c * LANES, vload(w->acc + i * D + c * LANES) / inv);
        store_row(DT_F32, out, (row0[i / G] * H + kvh * G + i % G) * D, w->row, D);
    }
}
#endif

void pc_attention(int dt, int64_t H, int64_t KV, int64_t D, const float *q, const void *keys,
                  const void *values, int64_t head_stride, int64_t B, int64_t nseg, const int64_t *seg,
                  const int32_t *tables, void *out, int nthreads) {
    const int64_t G = H / KV;
    const int group = GROUP_DECODE(dt, B, D);
    /* work: (segment, first row) items, or (-1 - first, count) for a group of one-row decode
     * segments (order[first ...], sorted by block table, consecutive ones sharing a first block) */
    int64_t nitems = 0, ndec = 0;
    for (int64_t i = 0; i < nseg; i++) {
        if (group && seg[SEG * i + 4] && seg[SEG * i + 1] == 1) ndec++;
        else nitems += (seg[SEG * i + 1] + QB - 1) / QB;
    }
    int64_t *work = (int64_t *)malloc(sizeof(int64_t) * 2 * (size_t)(nitems + ndec + 1));
    int64_t *order = (int64_t *)malloc(sizeof(int64_t) * (size_t)(ndec + 1));
    int64_t w_n = 0;
    {
        int64_t nd = 0;
        for (int64_t i = 0; i < nseg; i++) {
            if (group && seg[SEG * i + 4] && seg[SEG * i + 1] == 1) {
                int64_t at = nd++; /* insertion sort by block table: a step has tens of decode rows */
                while (at > 0 && table_order(seg, tables, B, order[at - 1], i) > 0) {
                    order[at] = order[at - 1];
                    at--;
                }
                order[at] = i;
                continue;
            }
            for (int64_t r = 0; r < seg[SEG * i + 1]; r += QB) {
                work[2 * w_n] = i;
                work[2 * w_n + 1] = r;
                w_n++;
            }
        }
        for (int64_t a = 0; a < nd;) {
            int64_t b = a + 1;
            const int32_t first = tables[seg[SEG * order[a] + 3]];
            while (b < nd && b - a < DG && tables[seg[SEG * order[b] + 3]] == first) b++;
            work[2 * w_n] = -1 - a;
            work[2 * w_n + 1] = b - a;
            w_n++;
            a = b;
        }
    }
    const int64_t nwork = w_n * KV;
    #pragma omp parallel num_threads(threads_or(nthreads))
    {
        const int64_t Q = QB * G;
        attn_scratch w;
        w.kt = falloc(LANES * D); /* [16][D] */
        w.vt = falloc(LANES * D);
        w.acc = falloc(Q * D);
        w.m = falloc(Q);
        w.l = falloc(Q);
        w.row = falloc(D);
        w.qbuf = falloc(Q * D);
        w.part = (v16 *)falloc(LANES * LANES * (2 * G > 6 ? 2 * G : 6));
        w.ktv = (v16 *)falloc(LANES * D);
        w.lv = (v16 *)falloc(LANES * Q);
        w.qh = (uint32_t *)falloc(Q * D / 2);
        w.raw = (uint16_t *)falloc(LANES * D);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t wi = 0; wi < nwork; wi++) {
            const int64_t item = wi / KV, kvh = wi % KV;
            if (work[2 * item] < 0) {
#if defined(__AVX512BF16__)
                if (dt == DT_BF16 && D % 32 == 0) {
                    decode_group_bf16(H, G, D, q, keys, values, head_stride, B, seg, tables,
                                      order - 1 - work[2 * item], work[2 * item + 1], kvh, out, &w);
                    continue;
                }
#elif defined(PC_NATIVE_AVX2)
                decode_group_w(H, G, D, q, keys, values, head_stride, seg, tables, order - 1 - work[2 * item],
                               work[2 * item + 1], kvh, out, &w);
                continue;
#endif
                decode_group(dt, H, G, D, q, keys, values, head_stride, B, seg, tables, order - 1 - work[2 * item],
                             work[2 * item + 1], kvh, out, &w);
                continue;
            }
            const int64_t *sg = seg + SEG * work[2 * item];
            const int64_t r_in = work[2 * item + 1];
            const int64_t nr = sg[1] - r_in < QB ? sg[1] - r_in : QB;
            if (sg[4] && !DECODE_AS_PROMPT(dt, D))
                decode_item(dt, H, G, D, q, keys, values, head_stride, B, sg, tables + sg[3], r_in, nr, kvh, out, &w);
            else
                prompt_item(dt, H, G, D, q, keys, values, head_stride, B, sg, tables + sg[3], r_in, nr, kvh, out, &w);
        }
        free(w.kt);
        free(w.vt);
        free(w.acc);
        free(w.m);
        free(w.l);
        free(w.row);
        free(w.qbuf);
        free(w.part);
        free(w.ktv);
        free(w.lv);
        free(w.qh);
        free(w.raw);
    }
    free(work);
    free(order);
}
