/* prefixcache's own row-invariant GEMM: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), float32 or bfloat16.
 *
 * Invariance by construction: each output element y[m, n] is one fixed sequence of IEEE operations
 * that depends on K alone (never on M, the row's position, the tile it falls in, or the threads):
 * - 16 partial lanes, lane l accumulating k = l, l + 16, l + 32, ... in ascending order with one
 *   FMA each (float32, and bfloat16 widened to float32 where the CPU has no bf16 dot product), or
 *   with AVX512-BF16 `vdpbf16ps` lane l accumulating the pairs k = 32 c + 2 l, 2 l + 1 in ascending
 *   chunks c; a K tail is read as zeros (masked loads);
 * - then one fixed tree over the lanes (l + l+8, then +4, +2, +1), the bias added in float32,
 *   and (bfloat16) one round-to-nearest-even to bf16, as torch rounds;
 * - threads split only the output columns N (whole columns per thread), never K; register tiles
 *   (rows x columns) only choose which outputs are computed together: every output has its own
 *   accumulator, so no output's arithmetic depends on the tile.
 * The float32 paths (generic, AVX2, AVX512) and the widened bf16 paths compute the same bits on
 * every ISA (the same FMAs in the same order); the `vdpbf16ps` path has its own bits (the cache
 * namespace names the GEMM ISA). Weights are read in place ([N, K] row-major, as torch keeps
 * them): decode is bound by reading weights, and each weight row is read once per row tile, the
 * tile's columns staying in L2 while all row tiles pass over them, and the next block's weights
 * are prefetched into L2 meanwhile (8 rows: the lm_head product 7.9 -> 4.6 ms on the 2-core Xeon
 * measured, where a core computes or waits for memory but does not overlap the two unasked). Up to
 * FEW_ROWS rows a tile has one column, so each weight row streams alone (tiles over 4 interleaved
 * weight rows read at about half the bandwidth on the 2-core AMD EPYC measured); more rows, 4 (2
 * on AVX2) columns. On AVX512 the tiles leave each output's 16 lanes in a buffer and reduce16 sums
 * 16 columns at once (the same tree, vectorised across outputs).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define PC_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define PC_GEMM_VERSION 1
#define U _Pragma("GCC unroll 4")
#ifndef CB
#define CB 64 /* columns per cache block (each thread's columns go block by block; a multiple of 16) */
#endif
#ifndef PF_DIST
#define PF_DIST 1 /* blocks ahead the prefetch reads */
#endif
#ifndef PREFETCH
#define PREFETCH 1 /* prefetch the weights PF_DIST blocks ahead into L2 while this block computes */
#endif
#define BUF_ROW 256 /* floats a row of the lanes buffer holds: 16 columns x 16 lanes */
#ifndef FEW_ROWS
#define FEW_ROWS 4 /* up to this many rows, tiles of one column (pc_gemm) */
#endif

enum { G_GENERIC = 0, G_AVX2 = 1, G_AVX512 = 2, G_AVX512BF16 = 3, G_AMX = 4 };

typedef struct {
    int64_t M, N, K, ldx, ldy;
    const void *x, *w, *bias;
    void *y;
    int bf16;
} job;

static inline float bf2f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f2bf(float f) { /* round to nearest even, as torch (NaN -> 0x7fc0) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* The tree over 16 lanes: s8 = l + l+8, s4 = s8 + s8+4, s2 = s4 + s4+2, s = s2[0] + s2[1]. */
static inline float tree16(const float *a) {
    float s8[8], s4[4], s2[2];
    for (int i = 0; i < 8; i++) s8[i] = a[i] + a[i + 8];
    for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
    for (int i = 0; i < 2; i++) s2[i] = s4[i] + s4[i + 2];
    return s2[0] + s2[1];
}

static inline void put(const job *j, int64_t m, int64_t n, float s) {
    if (j->bf16) {
        if (j->bias) s = s + bf2f(((const uint16_t *)j->bias)[n]);
        ((uint16_t *)j->y)[m * j->ldy + n] = f2bf(s);
    } else {
        if (j->bias) s = s + ((const float *)j->bias)[n];
        ((float *)j->y)[m * j->ldy + n] = s;
    }
}

static inline float xload(const job *j, const void *p, int64_t i) {
    return j->bf16 ? bf2f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Weight rows [r0, r1) (each `bytes` long) toward L2 (locality 2: T1), on any ISA. */
static inline void prefetch_rows(const void *w, int64_t r0, int64_t r1, int64_t bytes) {
    const char *base = (const char *)w;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(base + r * bytes + off, 0, 2);
}

/* ---------------------------------------------------------------- generic (the reference order) */
static void tile_generic(const job *j, int64_t m, int R, int64_t n, int C, float *buf) {
    (void)buf;
    const int64_t K = j->K;
    const size_t es = j->bf16 ? 2 : 4;
    U for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            const char *xr = (const char *)j->x + (size_t)((m + r) * j->ldx) * es;
            const char *wr = (const char *)j->w + (size_t)((n + c) * K) * es;
            float acc[16] = {0};
            for (int64_t k = 0; k < K; k++)
                acc[k % 16] = __builtin_fmaf(xload(j, xr, k), xload(j, wr, k), acc[k % 16]);
            put(j, m + r, n + c, tree16(acc));
        }
}

#if defined(__AVX2__) && defined(__FMA__)
static inline float tree256x2(__m256 lo, __m256 hi) {
    __m256 s8 = _mm256_add_ps(lo, hi);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

/* 8 lanes from p + k (n valid, the rest zero), float32 or bf16 widened. */
static inline __m256 ld8(const job *j, const void *p, int64_t k, int n) {
    if (j->bf16) {
        const uint16_t *h = (const uint16_t *)p + k;
        __m128i v;
        if (n >= 8) {
            v = _mm_loadu_si128((const __m128i *)h);
        } else {
            uint16_t t[8] = {0};
            for (int i = 0; i < n; i++) t[i] = h[i];
            v = _mm_loadu_si128((const __m128i *)t);
        }
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
    }
    const float *f = (const float *)p + k;
    if (n >= 8) return _mm256_loadu_ps(f);
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(f, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx));
}

/* R rows x 2 columns, 16 lanes as two ymm each. */
static inline __attribute__((always_inline)) void tile_avx2_r(const job *j, int64_t m, const int R, int64_t n, int C,
                                                              const int CW) {
    const int64_t K = j->K;
    const size_t es = j->bf16 ? 2 : 4;
    const void *xr[4], *wr[2];
    U for (int r = 0; r < R; r++) xr[r] = (const char *)j->x + (size_t)((m + r) * j->ldx) * es;
    U for (int c = 0; c < CW; c++) wr[c] = (const char *)j->w + (size_t)((n + (c < C ? c : 0)) * K) * es;
    __m256 lo[4][2], hi[4][2];
    U for (int r = 0; r < R; r++)
        U for (int c = 0; c < CW; c++) lo[r][c] = hi[r][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const int left = K - k >= 16 ? 16 : (int)(K - k);
        const int n0 = left >= 8 ? 8 : left, n1 = left - n0;
        __m256 w0[2], w1[2];
        U for (int c = 0; c < CW; c++) {
            w0[c] = ld8(j, wr[c], k, n0);
            w1[c] = n1 > 0 ? ld8(j, wr[c], k + 8, n1) : _mm256_setzero_ps();
        }
        U for (int r = 0; r < R; r++) {
            const __m256 x0 = ld8(j, xr[r], k, n0);
            const __m256 x1 = n1 > 0 ? ld8(j, xr[r], k + 8, n1) : _mm256_setzero_ps();
            U for (int c = 0; c < CW; c++) {
                lo[r][c] = _mm256_fmadd_ps(x0, w0[c], lo[r][c]);
                hi[r][c] = _mm256_fmadd_ps(x1, w1[c], hi[r][c]);
            }
        }
    }
    U for (int r = 0; r < R; r++)
        U for (int c = 0; c < CW; c++) if (c < C) put(j, m + r, n + c, tree256x2(lo[r][c], hi[r][c]));
}

static void tile_avx2(const job *j, int64_t m, int R, int64_t n, int C, float *buf) {
    (void)buf;
    if (R == 2) tile_avx2_r(j, m, 2, n, C, 2);
    else tile_avx2_r(j, m, 1, n, C, 2);
}

/* One column, up to 4 rows (few rows: see pc_gemm). */
static void tile_avx2_1(const job *j, int64_t m, int R, int64_t n, int C, float *buf) {
    (void)C;
    (void)buf;
    switch (R) {
    case 4: tile_avx2_r(j, m, 4, n, 1, 1); break;
    case 3: tile_avx2_r(j, m, 3, n, 1, 1); break;
    case 2: tile_avx2_r(j, m, 2, n, 1, 1); break;
    default: tile_avx2_r(j, m, 1, n, 1, 1); break;
    }
}
#endif

#if defined(__AVX512F__)
/* 16 lanes from p + k (n valid, the rest zero), float32 or bf16 widened. */
static inline __m512 ld16(const job *j, const void *p, int64_t k, int n) {
    const __mmask16 mk = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
    if (j->bf16) {
        const __m256i h = _mm256_maskz_loadu_epi16(mk, (const uint16_t *)p + k);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(mk, (const float *)p + k);
}

/* R rows x 4 columns, one zmm accumulator per output; the 16 lanes of output (r, c) go to
 * buf[r * BUF_ROW + c * 16] (the caller reduces 16 columns at once: reduce16). */
static inline __attribute__((always_inline)) void tile_avx512_r(const job *j, int64_t m, const int R, int64_t n, int C,
                                                                const int CW, float *buf) {
    const int64_t K = j->K;
    const size_t es = j->bf16 ? 2 : 4;
    const void *xr[4], *wr[4];
    U for (int r = 0; r < R; r++) xr[r] = (const char *)j->x + (size_t)((m + r) * j->ldx) * es;
    U for (int c = 0; c < CW; c++) wr[c] = (const char *)j->w + (size_t)((n + (c < C ? c : 0)) * K) * es;
    __m512 acc[4][4];
    U for (int r = 0; r < R; r++)
        U for (int c = 0; c < CW; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const int left = K - k >= 16 ? 16 : (int)(K - k);
        __m512 wv[4];
        U for (int c = 0; c < CW; c++) wv[c] = ld16(j, wr[c], k, left);
        U for (int r = 0; r < R; r++) {
            const __m512 xv = ld16(j, xr[r], k, left);
            U for (int c = 0; c < CW; c++) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
    U for (int r = 0; r < R; r++)
        U for (int c = 0; c < CW; c++) if (c < C) _mm512_store_ps(buf + r * BUF_ROW + c * 16, acc[r][c]);
}

static void tile_avx512(const job *j, int64_t m, int R, int64_t n, int C, float *buf) {
    switch (R) {
    case 4: tile_avx512_r(j, m, 4, n, C, 4, buf); break;
    case 3: tile_avx512_r(j, m, 3, n, C, 4, buf); break;
    case 2: tile_avx512_r(j, m, 2, n, C, 4, buf); break;
    default: tile_avx512_r(j, m, 1, n, C, 4, buf); break;
    }
}

/* One column, up to 4 rows (few rows: see pc_gemm). */
static void tile_avx512_1(const job *j, int64_t m, int R, int64_t n, int C, float *buf) {
    (void)C;
    switch (R) {
    case 4: tile_avx512_r(j, m, 4, n, 1, 1, buf); break;
    case 3: tile_avx512_r(j, m, 3, n, 1, 1, buf); break;
    case 2: tile_avx512_r(j, m, 2, n, 1, 1, buf); break;
    default: tile_avx512_r(j, m, 1, n, 1, 1, buf); break;
    }
}

/* The 16 sums of 16 columns' lane vectors (buf[c * 16 + l]: lane l of column c), each the same
 * tree as tree16 and tree256x2 (l + l+8, then +4, +2, +1: the same pairs, so the same bits), 16 at a time:
 * each step adds two shuffles that line the pairs of several columns up in one vector. */
static inline __m512 reduce16(const float *buf) {
    __m512 w[8], x[4], y[2];
    for (int p = 0; p < 8; p++) { /* lanes 0-7: column 2p's s8, 8-15: column 2p+1's */
        const __m512 a = _mm512_load_ps(buf + 32 * p), b = _mm512_load_ps(buf + 32 * p + 16);
        w[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    }
    for (int p = 0; p < 4; p++) /* 128-bit lane i: s4 of column 4p + i */
        x[p] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * p], w[2 * p + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * p], w[2 * p + 1], 0xDD));
    for (int p = 0; p < 2; p++) /* lane i: [s2 of column 8p + i (2), of column 8p + 4 + i (2)] */
        y[p] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * p], x[2 * p + 1], 0x44),
                             _mm512_shuffle_ps(x[2 * p], x[2 * p + 1], 0xEE));
    /* element 4i + k: the sum of column i + 4k */
    const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, z);
}

/* put() for outputs (m, n .. n + cnt - 1) at once: bias in float32, one rounding to bf16. */
static inline void put16(const job *j, int64_t m, int64_t n, int cnt, __m512 s) {
    const __mmask16 mk = cnt >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << cnt) - 1);
    if (j->bf16) {
        if (j->bias) {
            const __m256i b = _mm256_maskz_loadu_epi16(mk, (const uint16_t *)j->bias + n);
            s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
        }
        const __m512i u = _mm512_castps_si512(s);
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                      _mm512_set1_epi32(0x7f800000));
        r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
        _mm256_mask_storeu_epi16((uint16_t *)j->y + m * j->ldy + n, mk, _mm512_cvtepi32_epi16(r));
    } else {
        if (j->bias) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(mk, (const float *)j->bias + n));
        _mm512_mask_storeu_ps((float *)j->y + m * j->ldy + n, mk, s);
    }
}
#endif

#if defined(__AVX512BF16__)
/* bf16 x bf16 -> float32 lanes by vdpbf16ps: lane l += x[2l] w[2l] + x[2l+1] w[2l+1], 32 k a step. */
static inline __attribute__((always_inline)) void tile_bf16_r(const job *j, int64_t m, const int R, int64_t n, int C,
                                                              const int CW, float *buf) {
    const int64_t K = j->K;
    const uint16_t *xr[4], *wr[4];
    U for (int r = 0; r < R; r++) xr[r] = (const uint16_t *)j->x + (m + r) * j->ldx;
    U for (int c = 0; c < CW; c++) wr[c] = (const uint16_t *)j->w + (n + (c < C ? c : 0)) * K;
    __m512 acc[4][4];
    U for (int r = 0; r < R; r++)
        U for (int c = 0; c < CW; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        const int64_t left = K - k;
        const __mmask32 mk = left >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << left) - 1);
        __m512i wv[4];
        U for (int c = 0; c < CW; c++) wv[c] = _mm512_maskz_loadu_epi16(mk, wr[c] + k);
        U for (int r = 0; r < R; r++) {
            const __m512i xv = _mm512_maskz_loadu_epi16(mk, xr[r] + k);
            U for (int c = 0; c < CW; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)xv, (__m512bh)wv[c]);
        }
    }
    U for (int r = 0; r < R; r++)
        U for (int c = 0; c < CW; c++) if (c < C) _mm512_store_ps(buf + r * BUF_ROW + c * 16, acc[r][c]);
}

static void tile_bf16(const job *j, int64_t m, int R, int64_t n, int C, float *buf) {
    switch (R) {
    case 4: tile_bf16_r(j, m, 4, n, C, 4, buf); break;
    case 3: tile_bf16_r(j, m, 3, n, C, 4, buf); break;
    case 2: tile_bf16_r(j, m, 2, n, C, 4, buf); break;
    default: tile_bf16_r(j, m, 1, n, C, 4, buf); break;
    }
}

/* One column, up to 4 rows (few rows: see pc_gemm). */
static void tile_bf16_1(const job *j, int64_t m, int R, int64_t n, int C, float *buf) {
    (void)C;
    switch (R) {
    case 4: tile_bf16_r(j, m, 4, n, 1, 1, buf); break;
    case 3: tile_bf16_r(j, m, 3, n, 1, 1, buf); break;
    case 2: tile_bf16_r(j, m, 2, n, 1, 1, buf); break;
    default: tile_bf16_r(j, m, 1, n, 1, 1, buf); break;
    }
}
#endif

#ifdef PC_AMX
/* ---------------------------------------------------------------- AMX (bfloat16)
 * y^T tiles: C[16 weight rows n][16 x rows m] += W[n, k .. k+32) . X[m, k .. k+32) by TDPBF16PS,
 * k ascending in steps of 32: each output (m, n) is one fixed sequence of tile products that
 * depends on K alone (the hardware computes every element of C by the same arithmetic, whatever
 * its place in the tile or the other rows: checked by the tests at every row count). Weight rows
 * are tile A as they lie ([N, K] row-major, 64 bytes a row); X is repacked once a call into B
 * (VNNI: pairs of k per m), zero rows past M. Needs K % 32 == 0 and N % 16 == 0 (the caller
 * falls back to the dot-product path otherwise: a choice by shape, never by row count). */
#define AMX_NT 4 /* n tiles (64 weight rows) a pass: C in tmm0-3, A in tmm4/tmm6, B in tmm5 */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg;

static int amx_permitted(void) { /* Linux grants AMX state per process on request */
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

static void amx_config(void) {
    amx_cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = 16;
    _tile_loadconfig(&c);
}

/* In-register transpose of 16 x 16 floats (r[i] lane j -> r[j] lane i): the AMX epilogue and packing. */
static inline void tr16(__m512 *r) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 4; i++) {
            t[8 * h + i] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + 4 + i], 0x88);
            t[8 * h + 4 + i] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + 4 + i], 0xDD);
        }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
        r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xDD);
    }
}

/* X [M, K] bf16 -> B blocks: xp[(mt * KS + ks) * 512 + i * 32 + mm * 2 + e] = X[mt*16+mm][ks*32+2i+e]
 * (a 16 x 16 transpose of k pairs per block), for m tiles [mt0, mt1). */
static void amx_pack(const job *j, uint16_t *xp, int64_t mt0, int64_t mt1) {
    const int64_t KS = j->K / 32;
    const uint16_t *x = (const uint16_t *)j->x;
    for (int64_t mt = mt0; mt < mt1; mt++)
        for (int64_t ks = 0; ks < KS; ks++) {
            __m512 r[16];
            for (int mm = 0; mm < 16; mm++) {
                const int64_t m = mt * 16 + mm;
                r[mm] = m < j->M ? _mm512_castsi512_ps(_mm512_loadu_si512(x + m * j->ldx + ks * 32)) : _mm512_setzero_ps();
            }
            tr16(r);
            float *blk = (float *)(xp + (mt * KS + ks) * 512);
            for (int i = 0; i < 16; i++) _mm512_store_ps(blk + i * 16, r[i]);
        }
}

/* n tiles [n, n + 16 nt) of x rows [16 mt, 16 mt + 16) (nt in 1..AMX_NT). */
static inline __attribute__((always_inline)) void amx_pass(const job *j, const uint16_t *xp, int64_t mt, int64_t n,
                                                           const int nt, float *cbuf) {
    const int64_t K = j->K, KS = K / 32;
    const uint16_t *w = (const uint16_t *)j->w;
    _tile_zero(0);
    if (nt > 1) _tile_zero(1);
    if (nt > 2) _tile_zero(2);
    if (nt > 3) _tile_zero(3);
    for (int64_t ks = 0; ks < KS; ks++) {
        _tile_loadd(5, xp + (mt * KS + ks) * 512, 64);
        const uint16_t *a = w + n * K + ks * 32;
        _tile_loadd(4, a, K * 2);
        _tile_dpbf16ps(0, 4, 5);
        if (nt > 1) {
            _tile_loadd(6, a + 16 * K, K * 2);
            _tile_dpbf16ps(1, 6, 5);
        }
        if (nt > 2) {
            _tile_loadd(4, a + 32 * K, K * 2);
            _tile_dpbf16ps(2, 4, 5);
        }
        if (nt > 3) {
            _tile_loadd(6, a + 48 * K, K * 2);
            _tile_dpbf16ps(3, 6, 5);
        }
    }
    _tile_stored(0, cbuf, 64);
    if (nt > 1) _tile_stored(1, cbuf + 256, 64);
    if (nt > 2) _tile_stored(2, cbuf + 512, 64);
    if (nt > 3) _tile_stored(3, cbuf + 768, 64);
    const int64_t rows = j->M - mt * 16 < 16 ? j->M - mt * 16 : 16;
    for (int t = 0; t < nt; t++) { /* C tile t transposed: r[mm] = outputs (m, n + 16 t ..) */
        __m512 r[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_load_ps(cbuf + 256 * t + 16 * i);
        tr16(r);
        for (int64_t mm = 0; mm < rows; mm++) put16(j, mt * 16 + mm, n + 16 * t, 16, r[mm]);
    }
}

static void amx_gemm(const job *j, int nt) {
    const int64_t MT = (j->M + 15) / 16, groups = j->N / 16;
    uint16_t *xp = (uint16_t *)aligned_alloc(64, (size_t)(MT * j->K * 16 * 2));
    if (nt > groups) nt = (int)groups;
#pragma omp parallel num_threads(nt)
    {
        int t = 0, T = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        T = omp_get_num_threads();
#endif
        float cbuf[AMX_NT * 256] __attribute__((aligned(64)));
        amx_pack(j, xp, MT * t / T, MT * (t + 1) / T); /* each thread packs a share of the row tiles */
#pragma omp barrier
        amx_config();
        const int64_t g0 = groups * t / T, g1 = groups * (t + 1) / T;
        for (int64_t g = g0; g < g1; g += AMX_NT) {
            const int left = g1 - g < AMX_NT ? (int)(g1 - g) : AMX_NT;
            if (PREFETCH && g + AMX_NT < g1) /* the next pass's weights into L2 */
                prefetch_rows(j->w, (g + AMX_NT) * 16, (g + 2 * AMX_NT < g1 ? g + 2 * AMX_NT : g1) * 16, j->K * 2);
            for (int64_t mt = 0; mt < MT; mt++) {
                switch (left) {
                case 4: amx_pass(j, xp, mt, g * 16, 4, cbuf); break;
                case 3: amx_pass(j, xp, mt, g * 16, 3, cbuf); break;
                case 2: amx_pass(j, xp, mt, g * 16, 2, cbuf); break;
                default: amx_pass(j, xp, mt, g * 16, 1, cbuf); break;
                }
            }
        }
        _tile_release();
    }
    free(xp);
}
#endif

typedef void (*tile_fn)(const job *, int64_t, int, int64_t, int, float *);

/* Bit i set: GEMM ISA i is compiled in and this CPU runs it (found once a process). */
static int isas_found = -1;

int pc_gemm_isas(void) {
    int found = __atomic_load_n(&isas_found, __ATOMIC_ACQUIRE);
    if (found >= 0) return found;
    int mask = 1 << G_GENERIC;
#if defined(__x86_64__)
    __builtin_cpu_init();
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) mask |= 1 << G_AVX2;
#endif
#if defined(__AVX512F__)
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) mask |= 1 << G_AVX512;
#endif
#if defined(__AVX512BF16__)
    if (__builtin_cpu_supports("avx512bf16")) mask |= 1 << G_AVX512BF16;
#endif
#ifdef PC_AMX
    if ((mask >> G_AVX512BF16 & 1) && __builtin_cpu_supports("amx-bf16") && amx_permitted()) mask |= 1 << G_AMX;
#endif
    __atomic_store_n(&isas_found, mask, __ATOMIC_RELEASE);
    return mask;
}

int pc_gemm_version(void) { return PC_GEMM_VERSION; }

/* y[m * ldy + n] = sum_k x[m * ldx + k] w[n * K + k] (+ bias[n]); dtype 0 float32, 1 bfloat16;
 * isa one of G_* (the bf16 dot-product ISA computes bf16 only; float32 there runs AVX512).
 * Returns 0, or -1 when the ISA is not available here (nothing written). */
int pc_gemm(int dtype, int isa, int64_t M, int64_t N, int64_t K, const void *x, int64_t ldx, const void *w,
            const void *bias, void *y, int64_t ldy, int nt) {
    if (isa < 0 || isa > G_AMX || !((pc_gemm_isas() >> isa) & 1)) return -1;
    const job j = {M, N, K, ldx, ldy, x, w, bias, y, dtype == 1};
#ifdef PC_AMX
    if (isa == G_AMX && j.bf16 && K % 32 == 0 && N % 16 == 0 && M > 0) {
        amx_gemm(&j, nt < 1 ? 1 : nt);
        return 0;
    }
#endif
    if (isa == G_AMX) isa = G_AVX512BF16; /* float32, or a shape AMX does not take: the dot product */
    const int64_t es = dtype == 1 ? 2 : 4; /* bytes an element */
    tile_fn tile = tile_generic;
    int RT = 1, CT = 1, lanes = 0; /* lanes: tiles leave 16 lanes per output for reduce16 */
    (void)lanes;
    /* Up to FEW_ROWS rows (decode): one column per tile, so each weight row is read as one
     * sequential stream (several interleaved rows measured at half the read bandwidth on the AMD
     * EPYC); more rows: wider tiles, which reuse each loaded weight vector across rows. Either way
     * every output is the same sequence of operations (the header), so the choice changes no bits. */
    const int one = M <= FEW_ROWS;
    (void)one;
#if defined(__AVX2__) && defined(__FMA__)
    if (isa == G_AVX2) tile = one ? tile_avx2_1 : tile_avx2, RT = one ? 4 : 2, CT = one ? 1 : 2;
#endif
#if defined(__AVX512F__)
    if (isa == G_AVX512 || (isa == G_AVX512BF16 && !j.bf16))
        tile = one ? tile_avx512_1 : tile_avx512, RT = 4, CT = one ? 1 : 4, lanes = 1;
#endif
#if defined(__AVX512BF16__)
    if (isa == G_AVX512BF16 && j.bf16) tile = one ? tile_bf16_1 : tile_bf16, RT = 4, CT = one ? 1 : 4, lanes = 1;
#endif
    if (M <= 0 || N <= 0) return 0;
    /* Threads own whole groups of 16 columns (one reduce16 each). */
    const int64_t groups = (N + 15) / 16;
    if (nt < 1) nt = 1;
    if (nt > groups) nt = (int)groups;
#pragma omp parallel num_threads(nt)
    {
        int t = 0, T = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        T = omp_get_num_threads();
#endif
        float buf[4 * BUF_ROW] __attribute__((aligned(64)));
        memset(buf, 0, sizeof buf); /* columns past N's end are summed, never stored */
        const int64_t n0 = groups * t / T * 16;
        int64_t n1 = groups * (t + 1) / T * 16;
        if (n1 > N) n1 = N;
        for (int64_t b = n0; b < n1; b += CB) {
            const int64_t e = b + CB < n1 ? b + CB : n1;
            for (int64_t m = 0; m < M; m += RT) {
                const int R = M - m < RT ? (int)(M - m) : RT;
                for (int64_t g = b; g < e; g += 16) {
                    const int cnt = e - g < 16 ? (int)(e - g) : 16;
                    if (m == 0 && PREFETCH) { /* group g's twin PF_DIST blocks ahead, into L2 */
                        const int64_t pg = g + PF_DIST * CB;
                        prefetch_rows(w, pg, pg + 16 < n1 ? pg + 16 : n1, K * es);
                    }
                    for (int64_t n = g; n < g + cnt; n += CT)
                        tile(&j, m, R, n, g + cnt - n < CT ? (int)(g + cnt - n) : CT, buf + (n - g) * 16);
#if defined(__AVX512F__)
                    if (lanes)
                        for (int r = 0; r < R; r++) put16(&j, m + r, g, cnt, reduce16(buf + r * BUF_ROW));
#endif
                }
            }
        }
    }
    return 0;
}

/* ================================================================ prompt rows (pc_gemm_rows)
 *
 * A second arithmetic, for prompt rows only (the runner's GEMM rule decides which rows are which:
 * engine/gemm.py), float32: each output element is ONE chain of FMAs over k = 0, 1, ..., K - 1
 * in ascending order from +0, then the bias added in float32:
 *     acc = 0; for k: acc = fma(x[m, k], w[n, k], acc); y[m, n] = acc (+ bias[n]).
 * That sequence depends on K alone, never on M, the row's position, the tile or the threads, so a
 * prompt row has the same bits in a one-row tail as in a 2,112-row prefill. It is not pc_gemm's
 * 16-lane order, so prompt rows and decode rows are two arithmetics, each invariant on its own (as
 * in attention; a decode row's KV is never cached). Why a second one: the lanes order needs a
 * horizontal sum per output and reads each weight row once per row tile, which on AVX2 ran at a
 * third of the FMA rate; here a weight panel of 16 columns is packed once (k-major, in L2) and a
 * register tile of 6 rows x 16 columns takes 12 independent chains, 12 FMAs per 2 panel loads
 * and 6 broadcasts: about 1.4x torch's float32 GEMM at 512 rows and 4-6x at a 32-row tail (which
 * torch's fixed 128-row pieces pad). The generic path runs the same chains in C (same bits). */
#define PR_RT 6 /* rows a register tile */

static void prompt_generic(const job *j, int64_t n0, int64_t n1) {
    const float *x = (const float *)j->x, *w = (const float *)j->w, *bias = (const float *)j->bias;
    float *y = (float *)j->y;
    for (int64_t m = 0; m < j->M; m++)
        for (int64_t n = n0; n < n1; n++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < j->K; k++) acc = __builtin_fmaf(x[m * j->ldx + k], w[n * j->K + k], acc);
            y[m * j->ldy + n] = bias ? acc + bias[n] : acc;
        }
}

#if defined(__AVX2__) && defined(__FMA__)
/* dst[c * ldd + r] = src[r * lds + c] for an 8 x 8 block of floats, by AVX shuffles (also the
 * AVX2 attention's key transpose, pc_kernels.c). */
void pc_transpose8(const float *src, int64_t lds, float *dst, int64_t ldd) {
    __m256 r[8], t[8], u[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * lds);
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(u[i], u[4 + i], 0x20));
        _mm256_storeu_ps(dst + (4 + i) * ldd, _mm256_permute2f128_ps(u[i], u[4 + i], 0x31));
    }
}

/* P[k * 16 + c] = w[(n0 + c) * K + k] for the panel's `cols` columns, zero past them. */
static void pack_panel(const float *w, int64_t K, int64_t n0, int cols, float *P) {
    int64_t k = 0;
    if (cols == 16)
        for (; k + 8 <= K; k += 8)
            for (int h = 0; h < 2; h++) pc_transpose8(w + (n0 + 8 * h) * K + k, K, P + k * 16 + 8 * h, 16);
    for (; k < K; k++)
        for (int c = 0; c < 16; c++) P[k * 16 + c] = c < cols ? w[(n0 + c) * K + k] : 0.0f;
}

/* Named accumulators (arrays of __m256 indexed in the loop were kept in memory by GCC 12). */
#define PR_DECL(r) __m256 a##r##0 = _mm256_setzero_ps(), a##r##1 = _mm256_setzero_ps();
#define PR_STEP(r)                                                                                                 \
    if (R > r) {                                                                                                   \
        const __m256 xa = _mm256_broadcast_ss(x + r * ldx + k);                                                    \
        a##r##0 = _mm256_fmadd_ps(xa, b0, a##r##0);                                                                \
        a##r##1 = _mm256_fmadd_ps(xa, b1, a##r##1);                                                                \
    }
#define PR_OUT(r)                                                                                                  \
    if (R > r) out[r][0] = a##r##0, out[r][1] = a##r##1;

/* R rows x the panel's columns (y, bias: at the panel's first column). */
static inline __attribute__((always_inline)) void prompt_tile(const float *x, int64_t ldx, const float *P, int64_t K,
                                                               const int R, float *y, int64_t ldy, const float *bias,
                                                               int cols) {
    PR_DECL(0) PR_DECL(1) PR_DECL(2) PR_DECL(3) PR_DECL(4) PR_DECL(5)
    for (int64_t k = 0; k < K; k++) {
        const __m256 b0 = _mm256_load_ps(P + k * 16), b1 = _mm256_load_ps(P + k * 16 + 8);
        PR_STEP(0) PR_STEP(1) PR_STEP(2) PR_STEP(3) PR_STEP(4) PR_STEP(5)
    }
    __m256 out[PR_RT][2];
    PR_OUT(0) PR_OUT(1) PR_OUT(2) PR_OUT(3) PR_OUT(4) PR_OUT(5)
    for (int r = 0; r < R; r++) {
        if (cols == 16) {
            __m256 lo = out[r][0], hi = out[r][1];
            if (bias) lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias)), hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias + 8));
            _mm256_storeu_ps(y + r * ldy, lo);
            _mm256_storeu_ps(y + r * ldy + 8, hi);
        } else {
            float t[16];
            _mm256_storeu_ps(t, out[r][0]);
            _mm256_storeu_ps(t + 8, out[r][1]);
            for (int c = 0; c < cols; c++) y[r * ldy + c] = bias ? t[c] + bias[c] : t[c];
        }
    }
}

static void prompt_avx2(const job *j, int64_t p0, int64_t p1) {
    static __thread float *pbuf; /* this thread's packed panel, grown as K asks */
    static __thread int64_t pcap;
    const int64_t K = j->K, M = j->M, ldx = j->ldx, ldy = j->ldy;
    if (pcap < K) {
        free(pbuf);
        pbuf = (float *)aligned_alloc(64, (size_t)K * 64);
        pcap = pbuf ? K : 0;
    }
    if (!pbuf) { /* no memory for the panel: the same chains, unpacked */
        prompt_generic(j, p0 * 16, p1 * 16 < j->N ? p1 * 16 : j->N);
        return;
    }
    const float *x = (const float *)j->x, *bias = (const float *)j->bias;
    float *y = (float *)j->y;
    for (int64_t p = p0; p < p1; p++) {
        const int64_t n0 = p * 16;
        const int cols = j->N - n0 < 16 ? (int)(j->N - n0) : 16;
        pack_panel((const float *)j->w, K, n0, cols, pbuf);
        const float *b = bias ? bias + n0 : NULL;
        int64_t m = 0;
        for (; m + PR_RT <= M; m += PR_RT) prompt_tile(x + m * ldx, ldx, pbuf, K, PR_RT, y + m * ldy + n0, ldy, b, cols);
        switch (M - m) {
        case 5: prompt_tile(x + m * ldx, ldx, pbuf, K, 5, y + m * ldy + n0, ldy, b, cols); break;
        case 4: prompt_tile(x + m * ldx, ldx, pbuf, K, 4, y + m * ldy + n0, ldy, b, cols); break;
        case 3: prompt_tile(x + m * ldx, ldx, pbuf, K, 3, y + m * ldy + n0, ldy, b, cols); break;
        case 2: prompt_tile(x + m * ldx, ldx, pbuf, K, 2, y + m * ldy + n0, ldy, b, cols); break;
        case 1: prompt_tile(x + m * ldx, ldx, pbuf, K, 1, y + m * ldy + n0, ldy, b, cols); break;
        default: break;
        }
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* AVX512: a register tile of PZ_RT rows x PZ_NP packed 16-column panels (64 columns), 24 zmm
 * chains: 4 panel loads and 6 broadcasts per 24 FMAs (two panels x 8 rows, 2 loads and 8
 * broadcasts per 16, took 1.18x the time: 15.1 against 12.7 ms for one layer's four products at
 * 512 rows). Each lane is still one output's chain over k ascending from +0, then its bias: the
 * AVX2 tiles' and the C chain's bits. A thread's last 1-3 panels go as a narrower tile (NP). */
#define PZ_RT 6
#define PZ_NP 4
#define PZ_DECL(r) __m512 z##r##0 = _mm512_setzero_ps(), z##r##1 = z##r##0, z##r##2 = z##r##0, z##r##3 = z##r##0;
#define PZ_STEP(r)                                                                                                 \
    if (R > r) {                                                                                                   \
        const __m512 xa = _mm512_set1_ps(x[r * ldx + k]);                                                          \
        z##r##0 = _mm512_fmadd_ps(xa, b0, z##r##0);                                                                \
        if (NP > 1) z##r##1 = _mm512_fmadd_ps(xa, b1, z##r##1);                                                    \
        if (NP > 2) z##r##2 = _mm512_fmadd_ps(xa, b2, z##r##2);                                                    \
        if (NP > 3) z##r##3 = _mm512_fmadd_ps(xa, b3, z##r##3);                                                    \
    }
#define PZ_OUT(r)                                                                                                  \
    if (R > r) out[r][0] = z##r##0, out[r][1] = z##r##1, out[r][2] = z##r##2, out[r][3] = z##r##3;

/* Stores one output row's panel (`cols` columns at y; bias at the panel's first column). */
static inline __attribute__((always_inline)) void pz_store(float *y, __m512 v, const float *bias, int cols) {
    const __mmask16 mask = cols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1u);
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias));
    _mm512_mask_storeu_ps(y, mask, v);
}

static inline __attribute__((always_inline)) void prompt_tile512(const float *x, int64_t ldx, const float *P, int64_t K,
                                                                  const int R, const int NP, float *y, int64_t ldy,
                                                                  const float *bias, const int *cols) {
    PZ_DECL(0) PZ_DECL(1) PZ_DECL(2) PZ_DECL(3) PZ_DECL(4) PZ_DECL(5)
    const float *P1 = P + K * 16, *P2 = P + K * 32, *P3 = P + K * 48;
    for (int64_t k = 0; k < K; k++) {
        const __m512 b0 = _mm512_load_ps(P + k * 16);
        const __m512 b1 = NP > 1 ? _mm512_load_ps(P1 + k * 16) : b0;
        const __m512 b2 = NP > 2 ? _mm512_load_ps(P2 + k * 16) : b0;
        const __m512 b3 = NP > 3 ? _mm512_load_ps(P3 + k * 16) : b0;
        PZ_STEP(0) PZ_STEP(1) PZ_STEP(2) PZ_STEP(3) PZ_STEP(4) PZ_STEP(5)
    }
    __m512 out[PZ_RT][PZ_NP];
    PZ_OUT(0) PZ_OUT(1) PZ_OUT(2) PZ_OUT(3) PZ_OUT(4) PZ_OUT(5)
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NP; c++) pz_store(y + r * ldy + 16 * c, out[r][c], bias ? bias + 16 * c : NULL, cols[c]);
}

#define PZ_ROWS(NP)                                                                                                \
    do {                                                                                                           \
        int64_t m = 0;                                                                                             \
        for (; m + PZ_RT <= M; m += PZ_RT)                                                                         \
            prompt_tile512(x + m * ldx, ldx, zbuf, K, PZ_RT, NP, y + m * ldy + n0, ldy, b, cols);                  \
        switch (M - m) {                                                                                           \
        case 5: prompt_tile512(x + m * ldx, ldx, zbuf, K, 5, NP, y + m * ldy + n0, ldy, b, cols); break;           \
        case 4: prompt_tile512(x + m * ldx, ldx, zbuf, K, 4, NP, y + m * ldy + n0, ldy, b, cols); break;           \
        case 3: prompt_tile512(x + m * ldx, ldx, zbuf, K, 3, NP, y + m * ldy + n0, ldy, b, cols); break;           \
        case 2: prompt_tile512(x + m * ldx, ldx, zbuf, K, 2, NP, y + m * ldy + n0, ldy, b, cols); break;           \
        case 1: prompt_tile512(x + m * ldx, ldx, zbuf, K, 1, NP, y + m * ldy + n0, ldy, b, cols); break;           \
        default: break;                                                                                            \
        }                                                                                                          \
    } while (0)

static void prompt_avx512(const job *j, int64_t p0, int64_t p1) {
    static __thread float *zbuf; /* this thread's PZ_NP packed panels, grown as K asks */
    static __thread int64_t zcap;
    const int64_t K = j->K, M = j->M, ldx = j->ldx, ldy = j->ldy;
    if (zcap < K) {
        free(zbuf);
        zbuf = (float *)aligned_alloc(64, (size_t)K * 64 * PZ_NP);
        zcap = zbuf ? K : 0;
    }
    if (!zbuf) { /* no memory for the panels: the same chains, unpacked */
        prompt_generic(j, p0 * 16, p1 * 16 < j->N ? p1 * 16 : j->N);
        return;
    }
    const float *x = (const float *)j->x, *bias = (const float *)j->bias;
    float *y = (float *)j->y;
    for (int64_t p = p0; p < p1; p += PZ_NP) {
        const int64_t n0 = p * 16;
        const int np = p1 - p < PZ_NP ? (int)(p1 - p) : PZ_NP;
        int cols[PZ_NP] = {0, 0, 0, 0};
        for (int c = 0; c < np; c++) {
            cols[c] = j->N - n0 - 16 * c < 16 ? (int)(j->N - n0 - 16 * c) : 16;
            pack_panel((const float *)j->w, K, n0 + 16 * c, cols[c], zbuf + K * 16 * c);
        }
        const float *b = bias ? bias + n0 : NULL;
        switch (np) {
        case 4: PZ_ROWS(4); break;
        case 3: PZ_ROWS(3); break;
        case 2: PZ_ROWS(2); break;
        default: PZ_ROWS(1); break;
        }
    }
}
#endif

/* y[m * ldy + n] = the prompt-rows chain above, float32 (dtype 0) only, on `isa`: G_GENERIC (C),
 * G_AVX2 (the AVX2 tiles) or G_AVX512 and up (the AVX512 tiles); the same bits on each. Threads
 * split whole 16-column panels.
 * Returns 0; -1 when the ISA is not available here; -2 for a dtype other than float32. */
int pc_gemm_rows(int dtype, int isa, int64_t M, int64_t N, int64_t K, const void *x, int64_t ldx, const void *w,
                 const void *bias, void *y, int64_t ldy, int nt) {
    if (dtype != 0) return -2;
    if (isa < 0 || isa > G_AMX || !((pc_gemm_isas() >> isa) & 1)) return -1;
    if (M <= 0 || N <= 0) return 0;
    const job j = {M, N, K, ldx, ldy, x, w, bias, y, 0};
    const int64_t panels = (N + 15) / 16;
    if (nt < 1) nt = 1;
    if (nt > panels) nt = (int)panels;
#pragma omp parallel num_threads(nt)
    {
        int t = 0, T = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        T = omp_get_num_threads();
#endif
        const int64_t p0 = panels * t / T, p1 = panels * (t + 1) / T;
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
        if (isa >= G_AVX512)
            prompt_avx512(&j, p0, p1);
        else
#endif
#if defined(__AVX2__) && defined(__FMA__)
        if (isa >= G_AVX2)
            prompt_avx2(&j, p0, p1);
        else
#endif
            prompt_generic(&j, p0 * 16, p1 * 16 < N ? p1 * 16 : N);
    }
    return 0;
}
