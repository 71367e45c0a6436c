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
 * - one exp (pc_exp16) for softmax, its rescaling and SiLU;
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

#define PC_VERSION 1
#define LANES 16 /* partial sums of a reduction; also the attention key tile */

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
static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN stays NaN */
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)(v.u >> 16);
}

/* n values of dtype dt at src (element offset off) -> float32 dst */
static inline void load_row(int dt, const void *src, int64_t off, float *dst, int64_t n) {
    if (dt == DT_F32) {
        memcpy(dst, (const float *)src + off, (size_t)n * sizeof(float));
    } else {
        const uint16_t *s = (const uint16_t *)src + off;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    }
}

static inline void store_row(int dt, void *dst, int64_t off, const float *src, int64_t n) {
    if (dt == DT_F32) {
        memcpy((float *)dst + off, src, (size_t)n * sizeof(float));
    } else {
        uint16_t *d = (uint16_t *)dst + off;
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
    }
}

/* Round float32 values to what dtype dt holds (identity for float32). */
static inline void round_to(int dt, float *x, int64_t n) {
    if (dt == DT_BF16)
        for (int64_t i = 0; i < n; i++) x[i] = bf16_to_f32(f32_to_bf16(x[i]));
}

/* ------------------------------------------------------------------ exp */
/* exp of 16 lanes in place: Cody-Waite reduction by ln 2, a degree-6 polynomial, 2^n by the
 * exponent field. Inputs below -87.33 (and -inf) give exactly +0; above 88.72 saturate. */
static void pc_exp16(float *x) {
    float r[LANES], n[LANES];
    union { uint32_t u[LANES]; float f[LANES]; } s;
    int zero[LANES];
    for (int l = 0; l < LANES; l++) {
        float v = x[l];
        zero[l] = v < -87.33654f;
        v = v < -87.33654f ? -87.33654f : v;
        v = v > 88.72283f ? 88.72283f : v;
        float k = floorf(v * 1.44269504088896341f + 0.5f);
        float t = fmaf(k, -0.693359375f, v);
        t = fmaf(k, 2.12194440e-4f, t);
        n[l] = k;
        r[l] = t;
    }
    for (int l = 0; l < LANES; l++) {
        float t = r[l];
        float p = 1.9875691500e-4f;
        p = fmaf(p, t, 1.3981999507e-3f);
        p = fmaf(p, t, 8.3334519073e-3f);
        p = fmaf(p, t, 4.1665795894e-2f);
        p = fmaf(p, t, 1.6666665459e-1f);
        p = fmaf(p, t, 5.0000001201e-1f);
        p = fmaf(p, t * t, t);
        r[l] = p + 1.0f;
        s.u[l] = (uint32_t)((int32_t)n[l] + 126) << 23; /* 2^(n-1): n reaches 128 at the top */
    }
    for (int l = 0; l < LANES; l++) x[l] = zero[l] ? 0.0f : (r[l] * s.f[l]) * 2.0f;
}

/* ------------------------------------------------------------------ fixed-order sums */
/* sum over i < n of a[i] * b[i] (b == NULL: a[i] * a[i]): 16 lanes (lane = i mod 16, each an
 * fmaf chain in ascending i), then a fixed tree. */
static float dot_fixed(const float *a, const float *b, int64_t n) {
    float part[LANES] = {0};
    int64_t i = 0;
    if (b == NULL) b = a;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) part[l] = fmaf(a[i + l], b[i + l], part[l]);
    for (int l = 0; i + l < n; l++) part[l] = fmaf(a[i + l], b[i + l], part[l]);
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) part[l] = part[l] + part[l + w];
    return part[0];
}

static int threads_or(int nt) { return nt > 0 ? nt : 1; }

/* ------------------------------------------------------------------ RMSNorm + residual */
/* For each of `rows` rows of `hidden` values (dtype dt):
 *   delta != NULL: x = round(x + delta)  (in place; the residual stream)
 *   out = round(w * round(x * (1 / sqrt(mean(x^2) + eps))))
 * w may be NULL (no weight). */
void pc_rms_residual(int dt, int64_t rows, int64_t hidden, void *x, const void *delta, const void *w,
                     float eps, void *out, int nthreads) {
    #pragma omp parallel num_threads(threads_or(nthreads))
    {
        float *buf = (float *)malloc(sizeof(float) * (size_t)hidden * 3);
        float *xr = buf, *dr = buf + hidden, *wr = buf + 2 * hidden;
        if (w != NULL) load_row(dt, w, 0, wr, hidden);
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            load_row(dt, x, r * hidden, xr, hidden);
            if (delta != NULL) {
                load_row(dt, delta, r * hidden, dr, hidden);
                for (int64_t i = 0; i < hidden; i++) xr[i] = xr[i] + dr[i];
                round_to(dt, xr, hidden);
                store_row(dt, x, r * hidden, xr, hidden);
            }
            float ms = dot_fixed(xr, NULL, hidden) / (float)hidden;
            float inv = 1.0f / sqrtf(ms + eps);
            for (int64_t i = 0; i < hidden; i++) xr[i] = xr[i] * inv;
            round_to(dt, xr, hidden);
            if (w != NULL) {
                for (int64_t i = 0; i < hidden; i++) xr[i] = wr[i] * xr[i];
            }
            store_row(dt, out, r * hidden, xr, hidden);
        }
        free(buf);
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
        float *buf = (float *)malloc(sizeof(float) * (size_t)(width + 3 * D));
        float *xr = buf, *c = buf + width, *s = c + D, *o = s + D;
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
        free(buf);
    }
}

/* ------------------------------------------------------------------ SwiGLU */
/* gu: [rows, 2 I] (gate | up), out: [rows, I] = round(silu(gate) * up), silu(g) = g / (1 + exp(-g)). */
void pc_swiglu(int dt, int64_t rows, int64_t I, const void *gu, void *out, int nthreads) {
    #pragma omp parallel num_threads(threads_or(nthreads))
    {
        float *buf = (float *)malloc(sizeof(float) * (size_t)(2 * I + LANES));
        float *g = buf, *u = buf + I;
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            load_row(dt, gu, r * 2 * I, g, 2 * I);
            for (int64_t i = 0; i < I; i += LANES) {
                float e[LANES];
                int64_t n = I - i < LANES ? I - i : LANES;
                for (int l = 0; l < LANES; l++) e[l] = l < n ? -g[i + l] : 0.0f;
                pc_exp16(e);
                for (int l = 0; l < n; l++) g[i + l] = (g[i + l] / (1.0f + e[l])) * u[i + l];
            }
            store_row(dt, out, r * I, g, I);
        }
        free(buf);
    }
}

/* ------------------------------------------------------------------ paged attention */
/* One call for every row of a step. Segment i: rows [seg[4i], seg[4i] + seg[4i+1]) of q/out at
 * positions seg[4i+2], seg[4i+2] + 1, ...; its block table is tables[seg[4i+3] ...] (pool block
 * indices of positions 0, B, 2B, ...). keys/values: one layer of the pool, [KV, blocks, B, D]
 * (head_stride = blocks * B * D elements). q: [rows, H, D] float32, scaled. out: [rows, H, D] dt.
 *
 * Work item: (segment, KV head, block of up to QB rows); its G * rows query heads share one
 * pass over the keys (each 16-key tile converted to float32 once, keys transposed). Per query:
 * tiles ascending; scores s_j = sum_d q[d] k_j[d] (fmaf chain, d ascending); m' = max(m, max_j s_j);
 * a = exp(m - m'); p_j = exp(s_j - m'); l = l a + sum_j p_j (j ascending);
 * acc = acc a + sum_j p_j v_j (fmaf, j ascending); out = acc / l. */
#define QB 16

void pc_attention(int dt, int64_t H, int64_t KV, int64_t D, const float *q, const void *keys,
                  const void *values, int64_t head_stride, int64_t B, int64_t nseg, const int64_t *seg,
                  const int32_t *tables, void *out, int nthreads) {
    const int64_t G = H / KV;
    int64_t nblocks = 0;
    for (int64_t i = 0; i < nseg; i++) nblocks += (seg[4 * i + 1] + QB - 1) / QB;
    int64_t *work = (int64_t *)malloc(sizeof(int64_t) * 2 * (size_t)(nblocks > 0 ? nblocks : 1));
    {
        int64_t w = 0;
        for (int64_t i = 0; i < nseg; i++)
            for (int64_t r = 0; r < seg[4 * i + 1]; r += QB) {
                work[2 * w] = i;
                work[2 * w + 1] = r;
                w++;
            }
    }
    const int64_t nwork = nblocks * KV;
    #pragma omp parallel num_threads(threads_or(nthreads))
    {
        const int64_t Q = QB * G;
        float *kt = (float *)malloc(sizeof(float) * (size_t)(D * LANES)); /* [D][16] */
        float *vt = (float *)malloc(sizeof(float) * (size_t)(LANES * D)); /* [16][D] */
        float *acc = (float *)malloc(sizeof(float) * (size_t)(Q * D));
        float *m = (float *)malloc(sizeof(float) * (size_t)Q);
        float *l = (float *)malloc(sizeof(float) * (size_t)Q);
        float *row = (float *)malloc(sizeof(float) * (size_t)D);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t wi = 0; wi < nwork; wi++) {
            const int64_t item = wi / KV, kvh = wi % KV;
            const int64_t *sg = seg + 4 * work[2 * item];
            const int64_t r_in = work[2 * item + 1];
            const int64_t nr = sg[1] - r_in < QB ? sg[1] - r_in : QB;
            const int64_t row0 = sg[0] + r_in, pos0 = sg[2] + r_in;
            const int32_t *table = tables + sg[3];
            const int64_t last = pos0 + nr - 1;
            for (int64_t i = 0; i < nr * G; i++) {
                m[i] = -INFINITY;
                l[i] = 0.0f;
            }
            memset(acc, 0, sizeof(float) * (size_t)(nr * G * D));
            for (int64_t t0 = 0; t0 <= last; t0 += LANES) {
                const int64_t nk = last - t0 + 1 < LANES ? last - t0 + 1 : LANES;
                for (int64_t j = 0; j < nk; j++) {
                    const int64_t p = t0 + j;
                    const int64_t off = kvh * head_stride + ((int64_t)table[p / B] * B + p % B) * D;
                    load_row(dt, keys, off, row, D);
                    for (int64_t d = 0; d < D; d++) kt[d * LANES + j] = row[d];
                    load_row(dt, values, off, vt + j * D, D);
                }
                for (int64_t j = nk; j < LANES; j++)
                    for (int64_t d = 0; d < D; d++) kt[d * LANES + j] = 0.0f;
                for (int64_t ri = 0; ri < nr; ri++) {
                    const int64_t p = pos0 + ri;
                    if (t0 > p) continue; /* fully masked for this row: never read */
                    const int64_t nv = p - t0 + 1 < LANES ? p - t0 + 1 : LANES;
                    for (int64_t g = 0; g < G; g++) {
                        const int64_t qi = ri * G + g;
                        const float *qq = q + ((row0 + ri) * H + kvh * G + g) * D;
                        float s[LANES] = {0};
                        for (int64_t d = 0; d < D; d++) {
                            const float qd = qq[d];
                            const float *kd = kt + d * LANES;
                            for (int l2 = 0; l2 < LANES; l2++) s[l2] = fmaf(qd, kd[l2], s[l2]);
                        }
                        float mt = m[qi];
                        for (int64_t j = 0; j < nv; j++) mt = s[j] > mt ? s[j] : mt;
                        float e[LANES], a[LANES];
                        for (int l2 = 0; l2 < LANES; l2++) {
                            e[l2] = l2 < nv ? s[l2] - mt : -INFINITY;
                            a[l2] = -INFINITY;
                        }
                        a[0] = m[qi] - mt; /* -inf on the first tile: alpha = 0 */
                        pc_exp16(e);
                        pc_exp16(a);
                        const float alpha = a[0];
                        float sum = l[qi] * alpha;
                        for (int64_t j = 0; j < nv; j++) sum = sum + e[j];
                        l[qi] = sum;
                        m[qi] = mt;
                        float *ac = acc + qi * D;
                        for (int64_t d = 0; d < D; d++) ac[d] = ac[d] * alpha;
                        for (int64_t j = 0; j < nv; j++) {
                            const float pj = e[j];
                            const float *vj = vt + j * D;
                            for (int64_t d = 0; d < D; d++) ac[d] = fmaf(pj, vj[d], ac[d]);
                        }
                    }
                }
            }
            for (int64_t ri = 0; ri < nr; ri++)
                for (int64_t g = 0; g < G; g++) {
                    const int64_t qi = ri * G + g;
                    const float inv = l[qi];
                    for (int64_t d = 0; d < D; d++) row[d] = acc[qi * D + d] / inv;
                    store_row(dt, out, ((row0 + ri) * H + kvh * G + g) * D, row, D);
                }
        }
        free(kt);
        free(vt);
        free(acc);
        free(m);
        free(l);
        free(row);
    }
    free(work);
}
