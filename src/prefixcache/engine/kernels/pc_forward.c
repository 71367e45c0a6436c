/* The decoder's layer loop in compiled code: one call runs every layer of a step.
 *
 * pc_layers performs exactly the calls the Python loop of llama_native.native_step makes, in the
 * same order, on the same buffers' contents, with the same thread count: per layer the fused QKV
 * GEMM, RoPE + KV write, paged attention, the output GEMM, RMSNorm + residual, the gate/up GEMM,
 * SwiGLU, the down GEMM and RMSNorm + residual (fused with the next layer's input norm). So its
 * bits are the Python loop's bits (tests/engine/test_layer_loop.py checks logits and every KV
 * row). What it saves is the Python between the kernels and 240 releases and re-takes of the GIL
 * a step: in a server the step thread gives the GIL up once a step instead of once a kernel.
 *
 * It runs only where every weight product of the step goes through the own kernels (the Python
 * side checks the rule): pc_gemm over all rows with dense weights (wfmt 0), or, with `prompt`,
 * pc_gemm over the decode rows and pc_gemm_rows (the prompt-rows arithmetic) over the prompt rows,
 * one call per run of consecutive segments of one kind, as GemmRule.linear splits them; or, on a
 * step of decode rows alone, pc_q4_linear with 4-bit weights (wfmt 1: each projection's pointer
 * is a pc_q4w, no biases; the same bits as pc_gemm on the dequantized weights, see pc_q4.c; or
 * pc_q4a8_linear's 8-bit rows where the pc_q4w says a8, another model numerically); or,
 * on a step with both kinds, 4-bit weights for the decode runs and their dequantized values for
 * the prompt runs (wfmt 2: the pc_q4w's `dense`), as GemmRule.linear does with a Q4Weight.
 */
#include <stdint.h>
#include <stdlib.h>

void pc_rms_residual(int dt, int64_t rows, int64_t hidden, void *x, const void *delta, const void *w, float eps,
                     void *out, int nthreads);
void pc_rope_kv(int dt, int64_t rows, int64_t H, int64_t KV, int64_t D, const void *qkv, const int64_t *pos,
                const int64_t *slots, const void *cos_t, const void *sin_t, float scaling, float *q_out, void *keys,
                void *values, int64_t head_stride, int nthreads);
void pc_attention(int dt, int64_t H, int64_t KV, int64_t D, const float *q, const void *keys, const void *values,
                  int64_t head_stride, int64_t B, int64_t nseg, const int64_t *seg, const int32_t *tables, void *out,
                  int nthreads);
void pc_swiglu(int dt, int64_t rows, int64_t I, const void *gu, void *out, int nthreads);
int pc_gemm(int dtype, int isa, int64_t M, int64_t N, int64_t K, const void *x, int64_t ldx, const void *w,
            const void *bias, void *y, int64_t ldy, int nt);
int pc_gemm_rows(int dtype, int isa, int64_t M, int64_t N, int64_t K, const void *x, int64_t ldx, const void *w,
                 const void *bias, void *y, int64_t ldy, int nt);
int pc_q4_linear(int dt, int isa, int64_t nr, int64_t n, int64_t k, const void *x, int64_t ldx, const uint8_t *qs,
                 const uint16_t *d, const uint16_t *m, void *y, int64_t ldy, int threads, int path);
int pc_q4a8_linear(int dt, int64_t nr, int64_t n, int64_t k, const void *x, int64_t ldx, const uint8_t *qs,
                   const uint16_t *d, const uint16_t *m, void *y, int64_t ldy, int threads, int path);

/* A 4-bit weight as pc_q4.c reads it (nibbles, float16 scales and mins), its values dequantized
 * into the compute dtype ([N, K], contiguous), and a8: non-NULL where its decode rows go in 8 bits
 * a group (pc_q4a8_linear, --weights q4a8; qs then in that kernel's two-group records). */
typedef struct {
    const uint8_t *qs;
    const uint16_t *d, *m;
    const void *dense, *a8;
} pc_q4w;

static int q4_rows(const pc_q4w *q, int dt, int isa, int64_t nr, int64_t N, int64_t K, const void *x, void *y,
                   int nt) {
    if (q->a8) return pc_q4a8_linear(dt, nr, N, K, x, K, q->qs, q->d, q->m, y, N, nt, 0);
    return pc_q4_linear(dt, isa, nr, N, K, x, K, q->qs, q->d, q->m, y, N, nt, 0);
}

/* Runs of consecutive rows of one kind (a prompt run, a decode run), from the segments. */
typedef struct {
    int64_t n, (*run)[3]; /* run: first row, rows, decode */
} pc_runs;

/* y [R, N] = x [R, K] @ W^T (+ bias) by the weight's own kernel (runs: NULL, or the prompt and
 * decode runs, each through its own arithmetic; prompt: prompt runs through pc_gemm_rows). */
static int project(int wfmt, int prompt, int dt, int isa, int64_t R, int64_t N, int64_t K, const void *x,
                   const void *w, const void *bias, void *y, int nt, const pc_runs *runs) {
    const pc_q4w *q = (const pc_q4w *)w;
    if (wfmt == 1) return q4_rows(q, dt, isa, R, N, K, x, y, nt);
    if (!runs) return pc_gemm(dt, isa, R, N, K, x, K, w, bias, y, N, nt);
    const void *dense = wfmt == 2 ? q->dense : w;
    const int64_t es = dt == 1 ? 2 : 4;
    for (int64_t i = 0; i < runs->n; i++) {
        const int64_t r0 = runs->run[i][0], nr = runs->run[i][1];
        const char *xr = (const char *)x + r0 * K * es;
        char *yr = (char *)y + r0 * N * es;
        int rc;
        if (runs->run[i][2] && wfmt == 2)
            rc = q4_rows(q, dt, isa, nr, N, K, xr, yr, nt);
        else if (runs->run[i][2] || !prompt)
            rc = pc_gemm(dt, isa, nr, N, K, xr, K, dense, bias, yr, N, nt);
        else
            rc = pc_gemm_rows(dt, isa, nr, N, K, xr, K, dense, bias, yr, N, nt);
        if (rc) return rc;
    }
    return 0;
}

/* Weights per layer in `w`, PC_LW pointers each: input norm, qkv, qkv bias, o, o bias,
 * post-attention norm, gate|up, gate|up bias, down, down bias (biases and norms may be NULL). */
enum { W_LN1, W_QKV, W_QKV_B, W_O, W_O_B, W_LN2, W_GU, W_GU_B, W_DOWN, W_DOWN_B, PC_LW };

static void *buf(int64_t elems, int64_t elem_size) {
    size_t n = (size_t)(elems * elem_size);
    return aligned_alloc(64, (n + 63) / 64 * 64 + 64);
}

/* x [R, hidden] (dtype dt): the embedded rows, the residual stream (updated in place).
 * h [R, hidden]: out, the final norm of the last layer (norm: the model's final norm weight).
 * dims: layers, H, KV, D, hidden, inter (the MLP width). pool: [layers, 2, KV, blocks, B, D].
 * pos, slots: per row; seg, tables: pc_attention's segments and block tables.
 * wfmt: 0 dense weights (pc_gemm), 1 4-bit (pc_q4_linear), 2 both (see the header).
 * prompt: 1, prompt rows through pc_gemm_rows (wfmt 0; see the header), else 0.
 * Returns 0, or the first failing product's code (-1: ISA not available, -2 the prompt-rows GEMM
 * refused the dtype), or -3 (no memory). */
int pc_layers(int dt, int isa, int wfmt, int prompt, int64_t R, const int64_t *dims, const void *const *w, const void *norm, float eps,
              float scaling, void *x, void *h, void *pool, int64_t blocks, int64_t B, const int64_t *pos,
              const int64_t *slots, const void *cos_t, const void *sin_t, int64_t nseg, const int64_t *seg,
              const int32_t *tables, int nt) {
    const int64_t L = dims[0], H = dims[1], KV = dims[2], D = dims[3], hidden = dims[4], inter = dims[5];
    const int64_t es = dt == 1 ? 2 : 4, width = (H + 2 * KV) * D;
    const int64_t head_stride = blocks * B * D, layer_elems = 2 * KV * head_stride;
    void *qkv = buf(R * width, es), *attn = buf(R * H * D, es), *o = buf(R * hidden, es);
    void *gu = buf(R * 2 * inter, es), *act = buf(R * inter, es);
    float *q = (float *)buf(R * H * D, 4);
    const int split = (prompt && wfmt == 0) || wfmt == 2; /* runs of one kind a product */
    int64_t(*run)[3] = split ? malloc(sizeof *run * (size_t)(nseg > 0 ? nseg : 1)) : NULL;
    pc_runs runs = {0, run};
    int rc = 0;
    if (!qkv || !attn || !o || !gu || !act || !q || (split && !run)) {
        rc = -3;
        goto done;
    }
    for (int64_t i = 0; run && i < nseg; i++) { /* seg: row0, rows, start, table offset, decode */
        const int64_t *sg = seg + 5 * i, decode = sg[4] != 0;
        if (runs.n && run[runs.n - 1][2] == decode && run[runs.n - 1][0] + run[runs.n - 1][1] == sg[0])
            run[runs.n - 1][1] += sg[1];
        else
            run[runs.n][0] = sg[0], run[runs.n][1] = sg[1], run[runs.n][2] = decode, runs.n++;
    }
    const pc_runs *rp = run ? &runs : NULL;
    pc_rms_residual(dt, R, hidden, x, NULL, w[W_LN1], eps, h, nt);
    for (int64_t li = 0; li < L && rc == 0; li++) {
        const void *const *lw = w + li * PC_LW;
        char *keys = (char *)pool + li * layer_elems * es, *values = keys + KV * head_stride * es;
        rc = project(wfmt, prompt, dt, isa, R, width, hidden, h, lw[W_QKV], lw[W_QKV_B], qkv, nt, rp);
        if (rc) break;
        pc_rope_kv(dt, R, H, KV, D, qkv, pos, slots, cos_t, sin_t, scaling, q, keys, values, head_stride, nt);
        pc_attention(dt, H, KV, D, q, keys, values, head_stride, B, nseg, seg, tables, attn, nt);
        rc = project(wfmt, prompt, dt, isa, R, hidden, H * D, attn, lw[W_O], lw[W_O_B], o, nt, rp);
        if (rc) break;
        pc_rms_residual(dt, R, hidden, x, o, lw[W_LN2], eps, h, nt);
        rc = project(wfmt, prompt, dt, isa, R, 2 * inter, hidden, h, lw[W_GU], lw[W_GU_B], gu, nt, rp);
        if (rc) break;
        pc_swiglu(dt, R, inter, gu, act, nt);
        rc = project(wfmt, prompt, dt, isa, R, hidden, inter, act, lw[W_DOWN], lw[W_DOWN_B], o, nt, rp);
        if (rc) break;
        const void *next = li + 1 < L ? w[(li + 1) * PC_LW + W_LN1] : norm;
        pc_rms_residual(dt, R, hidden, x, o, next, eps, h, nt);
    }
done:
    free(qkv);
    free(attn);
    free(o);
    free(gu);
    free(act);
    free(q);
    free(run);
    return rc;
}
