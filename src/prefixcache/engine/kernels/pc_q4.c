/* 4-bit weights (Q4_1 groups of 32): y = x @ W^T, rows invariant by construction.
 *
 * W [N, K] is stored per output row n as K/32 groups: 16 bytes of nibbles (byte j holds element j
 * in its low nibble and element j + 16 in its high nibble, the GGUF's own order) and a float32
 * scale d and min m per group, so w = d * q + m.
 *
 * For each (row r, output n) the arithmetic is fixed by K alone:
 *   lo[p], hi[p] (16 float lanes each, p = 0, 1 the group's parity) = 0
 *   for g in 0..K/32-1, p = g & 1, lane i:
 *       lo[p][i] = fma(fma(q[i], d, m), x[32g + i], lo[p][i])
 *       hi[p][i] = fma(fma(q[16 + i], d, m), x[32g + 16 + i], hi[p][i])
 *   y = sum over i ascending of ((lo[0][i] + lo[1][i]) + (hi[0][i] + hi[1][i]))
 * (AVX512 looks fma(q, d, m) up in a 16-entry table of the group, AVX2 computes it in 8-lane
 * quarters, scalar per lane: all three compute the same bits.) Rows are processed in tiles that share each decoded
 * weight group; a row's arithmetic does not depend on its tile, the row count, its position or
 * the thread count (OpenMP splits the output columns only). No fast-math, no compiler FMA
 * contraction (build flags); the FMAs are written out.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define PC_Q4_VERSION 3
#define Q4_TILE 4

int pc_q4_version(void) { return PC_Q4_VERSION; }

/* The lane sum in a fixed order: a[p][h][i] (p the group's parity, h low/high half, i the lane)
 * as sum over i ascending of ((a00[i] + a10[i]) + (a01[i] + a11[i])). */
static float q4_lanes(const float *a) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += (a[i] + a[32 + i]) + (a[16 + i] + a[48 + i]);
    return s;
}

static void q4_col_scalar(const uint8_t *qs, const float *d, const float *m, int64_t k,
                          const float *x, int64_t nr, int64_t ldx, float *y, int64_t ldy) {
    for (int64_t r = 0; r < nr; r++) {
        float a[64] = {0};
        const float *xr = x + r * ldx;
        for (int64_t g = 0; g < k / 32; g++) {
            const uint8_t *b = qs + g * 16;
            for (int i = 0; i < 16; i++) {
                float wl = __builtin_fmaf((float)(b[i] & 15), d[g], m[g]);
                float wh = __builtin_fmaf((float)(b[i] >> 4), d[g], m[g]);
                float *lo = a + 32 * (g & 1), *hi = lo + 16;
                lo[i] = __builtin_fmaf(wl, xr[g * 32 + i], lo[i]);
                hi[i] = __builtin_fmaf(wh, xr[g * 32 + 16 + i], hi[i]);
            }
        }
        y[r * ldy] = q4_lanes(a);
    }
}

#ifdef __AVX2__
static void q4_col_avx2(const uint8_t *qs, const float *d, const float *m, int64_t k,
                        const float *x, int64_t nr, int64_t ldx, float *y, int64_t ldy) {
    __m256 acc[Q4_TILE][8];
    const __m256i lo = _mm256_set1_epi32(15);
    for (int64_t r0 = 0; r0 < nr; r0 += Q4_TILE) {
        int64_t t = nr - r0 < Q4_TILE ? nr - r0 : Q4_TILE;
        for (int64_t j = 0; j < t; j++)
            for (int h = 0; h < 8; h++) acc[j][h] = _mm256_setzero_ps();
        for (int64_t g = 0; g < k / 32; g++) {
            __m256 w[4];
            __m256 dg = _mm256_set1_ps(d[g]), mg = _mm256_set1_ps(m[g]);
            for (int h = 0; h < 2; h++) {
                __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + g * 16 + 8 * h)));
                w[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, lo)), dg, mg);
                w[2 + h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), dg, mg);
            }
            for (int64_t j = 0; j < t; j++) {
                const float *xr = x + (r0 + j) * ldx + g * 32;
                __m256 *aj = acc[j] + 4 * (g & 1);
                for (int h = 0; h < 4; h++) aj[h] = _mm256_fmadd_ps(w[h], _mm256_loadu_ps(xr + 8 * h), aj[h]);
            }
        }
        for (int64_t j = 0; j < t; j++) {
            float a[64];
            for (int h = 0; h < 8; h++) _mm256_storeu_ps(a + 8 * h, acc[j][h]);
            y[(r0 + j) * ldy] = q4_lanes(a);
        }
    }
}
#endif

#ifdef __AVX512F__
static void q4_col_avx512(const uint8_t *qs, const float *d, const float *m, int64_t k,
                          const float *x, int64_t nr, int64_t ldx, float *y, int64_t ldy) {
    __m512 acc[Q4_TILE][4];
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t r0 = 0; r0 < nr; r0 += Q4_TILE) {
        int64_t t = nr - r0 < Q4_TILE ? nr - r0 : Q4_TILE;
        for (int64_t j = 0; j < t; j++)
            for (int h = 0; h < 4; h++) acc[j][h] = _mm512_setzero_ps();
        for (int64_t g = 0; g < k / 32; g++) {
            /* table[q] = fma(q, d, m): the same bits as the other paths' per-element fma */
            __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(d[g]), _mm512_set1_ps(m[g]));
            __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + g * 16)));
            __m512 wl = _mm512_permutexvar_ps(b, table); /* low 4 bits index */
            __m512 wh = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
            for (int64_t j = 0; j < t; j++) {
                const float *xr = x + (r0 + j) * ldx + g * 32;
                __m512 *aj = acc[j] + 2 * (g & 1);
                aj[0] = _mm512_fmadd_ps(wl, _mm512_loadu_ps(xr), aj[0]);
                aj[1] = _mm512_fmadd_ps(wh, _mm512_loadu_ps(xr + 16), aj[1]);
            }
        }
        for (int64_t j = 0; j < t; j++) {
            float a[64];
            for (int h = 0; h < 4; h++) _mm512_storeu_ps(a + 16 * h, acc[j][h]);
            y[(r0 + j) * ldy] = q4_lanes(a);
        }
    }
}
#endif

/* The path a call takes: 0 the best compiled here, 1 AVX2, 2 scalar (all give the same bits). */
const char *pc_q4_path(int path) {
#ifdef __AVX512F__
    if (path == 0) return "avx512";
#endif
#ifdef __AVX2__
    if (path <= 1) return "avx2";
#endif
    (void)path;
    return "scalar";
}

/* y[nr, n] (float32, row stride ldy) = x[nr, k] (float32, row stride ldx) @ W^T.
 * qs: uint8 [n, k/32, 16]; d, m: float32 [n, k/32]; k a multiple of 32. threads: the OpenMP team. */
void pc_q4_linear(int64_t nr, int64_t n, int64_t k, const float *x, int64_t ldx, const uint8_t *qs,
                  const float *d, const float *m, float *y, int64_t ldy, int threads, int path) {
    if (nr <= 0 || n <= 0) return;
    const char *p = pc_q4_path(path);
    int kind = p[0] == 's' ? 2 : (p[4] == '5' ? 0 : 1);
    int64_t gk = k / 32;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t c = 0; c < n; c++) {
        const uint8_t *qc = qs + c * gk * 16;
        const float *dc = d + c * gk, *mc = m + c * gk;
#ifdef __AVX512F__
        if (kind == 0) {
            q4_col_avx512(qc, dc, mc, k, x, nr, ldx, y + c, ldy);
            continue;
        }
#endif
#ifdef __AVX2__
        if (kind == 1) {
            q4_col_avx2(qc, dc, mc, k, x, nr, ldx, y + c, ldy);
            continue;
        }
#endif
        q4_col_scalar(qc, dc, mc, k, x, nr, ldx, y + c, ldy);
    }
}
