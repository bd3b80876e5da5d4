/* A decode step's layers in one call (server/model/decode_path.py): `decode_layers` chains kernels
 * of this library that Python called one by one, in the same order on the same buffers, so that
 * the results are bit for bit the per-op path's. What it saves is the Python side of every kernel
 * it chains (about 6 us each: ctypes, checks, a fresh tensor), 180 a SmolLM2 step, and of every
 * LoRA call (20-26 us each in the engine against 4-7 us for the kernel itself, 120 a step when an
 * adapter targets all seven projections): it calls the LoRA kernel (gpu_lora/kernels/csrc/
 * lora.c's `lora_runs`, a library of its own, reached through its address) itself. A layer:
 *
 *   norm_proj:   h += delta; x = RMSNorm(h); y = x @ W.T (+ bias)          (qkv, gate_up)
 *                then LoRA q, k, v on qkv (from x), or gate, up on gate_up (from x)
 *   attend_proj: RoPE on q and k; k, v into the pool; a = attention(q); y = a @ Wo.T (+ bias)
 *                then LoRA o on y (from a)
 *   act_proj:    a = silu(gate) * up; y = a @ Wd.T (+ bias)
 *                then LoRA down on y (from a)
 *
 * The three are also called one by one from Python (decode_path.py's layer-by-layer path, for
 * steps whose LoRA needs Python: an adapter still loading, DoRA, a trace).
 * Every function returns 0, or nonzero having left the step to the per-op path when a kernel
 * declined before writing (a shape or ISA it does not take); 2 when a KV slot (or a LoRA run)
 * lies outside the pool, 3 when attention could not allocate, 4 when the LoRA kernel could not. */
#include "common.h"
#include "lora_runs.h" /* LoraProj and lora_runs_fn, as lora.c defines them */

/* The kernels chained here (elementwise.c, attention.c, linear.c, gemv_int8.c). */
int add_rms_norm(void *h, const void *delta, const void *w, void *out, int64_t T, int64_t H,
                 int64_t ld_h, int64_t ld_delta, int64_t ld_out, float eps, int is_bf16,
                 int num_threads);
int rope(void *x, const void *cos_t, const void *sin_t, int64_t T, int64_t heads, int64_t D,
         int64_t ld_x, int is_bf16, int num_threads);
int silu_mul(const void *gu, int64_t ld_gu, void *out, int64_t T, int64_t I, int is_bf16,
             int num_threads);
int silu_mul_takes(int64_t I);
int kv_write(const void *k, const void *v, int64_t ld, void *kc, void *vc, const int64_t *slots,
             int64_t T, int64_t K, int64_t D, int64_t S, int64_t elem_bytes, int num_threads);
int decode_attention_f32(const float *q, const float *k, const float *v, float *out,
                         const int64_t *index, const int64_t *lengths, int B, int N, int K, int D,
                         int64_t ld_index, int64_t slots_per_head, int64_t ld_q, float scale,
                         int num_threads);
int decode_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out,
                          const int64_t *index, const int64_t *lengths, int B, int N, int K,
                          int D, int64_t ld_index, int64_t slots_per_head, int64_t ld_q,
                          float scale, int num_threads);
int gemv_bf16(const uint16_t *x, int64_t ld_x, const uint16_t *W, int64_t out, int64_t in,
              uint16_t *y, int64_t ld_y, int64_t T, int num_threads);
int gemv_f32(const float *x, int64_t ld_x, const float *W, int64_t out, int64_t in, float *y,
             int64_t ld_y, int64_t T, int num_threads);
int gemv_f32_avx2(const float *x, int64_t ld_x, const float *W, int64_t out, int64_t in, float *y,
                  int64_t ld_y, int64_t T, int num_threads);
int gemv_bf16_avx2(const uint16_t *x, int64_t ld_x, const uint16_t *W, int64_t out, int64_t in,
                   uint16_t *y, int64_t ld_y, int64_t T, int num_threads);
int gemv_int8(const void *x, int64_t ld_x, int x_is_bf16, const int8_t *q, const float *scale,
              int64_t out, int64_t in, void *y, int64_t ld_y, int64_t T, int isa,
              int num_threads);
int gemv_int4(const void *x, int64_t ld_x, int x_is_bf16, const uint8_t *q, const float *scale,
              const float *offset, int64_t out, int64_t in, void *y, int64_t ld_y, int64_t T,
              int isa, int num_threads);
int gemv_int4_bf16(const uint16_t *x, int64_t ld_x, const uint8_t *q, const uint32_t *sz,
                   int64_t out, int64_t in, uint16_t *y, int64_t ld_y, int64_t T,
                   int num_threads);

/* One projection and the GEMV that runs it (decode_path.py's `Proj`, field for field). */
enum { GEMV_F32, GEMV_BF16, GEMV_F32_AVX2, GEMV_BF16_AVX2, GEMV_INT8, GEMV_INT4, GEMV_INT4_BF16 };
typedef struct {
    int64_t kind;        /* one of the GEMV_* above */
    const void *w;       /* the plain weight [out, in], or int8 values / packed int4 values */
    const float *scale;  /* int8: [out]; int4: [out, in / 32]; int4 bf16: its uint32 scale-zero
                            pairs [out, in / 32]; else NULL */
    const float *offset; /* int4: [out, in / 32]; else NULL */
    const void *bias;    /* [out] in the activation dtype, or NULL */
    int64_t out, in;
} Proj;

/* y [T, out] (row stride ld_y) = x [T, in] (row stride ld_x) @ W.T, then += bias rounded as
 * torch's in-place add rounds it. */
static int proj_gemv(const Proj *p, const void *x, int64_t ld_x, void *y, int64_t ld_y,
                     int64_t T, int is_bf16, int num_threads) {
    int failed;
    switch (p->kind) {
    case GEMV_F32:
        failed = gemv_f32(x, ld_x, p->w, p->out, p->in, y, ld_y, T, num_threads);
        break;
    case GEMV_BF16:
        failed = gemv_bf16(x, ld_x, p->w, p->out, p->in, y, ld_y, T, num_threads);
        break;
    case GEMV_F32_AVX2:
        failed = gemv_f32_avx2(x, ld_x, p->w, p->out, p->in, y, ld_y, T, num_threads);
        break;
    case GEMV_BF16_AVX2:
        failed = gemv_bf16_avx2(x, ld_x, p->w, p->out, p->in, y, ld_y, T, num_threads);
        break;
    case GEMV_INT8:
        failed = gemv_int8(x, ld_x, is_bf16, p->w, p->scale, p->out, p->in, y, ld_y, T, 0,
                           num_threads);
        break;
    case GEMV_INT4:
        failed = gemv_int4(x, ld_x, is_bf16, p->w, p->scale, p->offset, p->out, p->in, y, ld_y,
                           T, 0, num_threads);
        break;
    case GEMV_INT4_BF16:
        failed = is_bf16 ? gemv_int4_bf16(x, ld_x, p->w, (const uint32_t *)p->scale, p->out,
                                          p->in, y, ld_y, T, num_threads)
                         : 1;
        break;
    default:
        return 1;
    }
    if (failed || p->bias == NULL) return failed;
    for (int64_t t = 0; t < T; t++)
        for (int64_t o = 0; o < p->out; o++)
            st(y, is_bf16, t * ld_y + o,
               ld(y, is_bf16, t * ld_y + o) + ld(p->bias, is_bf16, o));
    return 0;
}

/* h [T, H] (row stride ld_h) += delta (row stride ld_delta; NULL: none), x [T, H] contiguous =
 * RMSNorm(h) * norm, y [T, out] contiguous = x @ W.T (+ bias). */
int norm_proj(void *h, const void *delta, const void *norm, void *x, const Proj *p, void *y,
              int64_t T, int64_t ld_h, int64_t ld_delta, float eps, int is_bf16,
              int num_threads) {
    int64_t H = p->in;
    add_rms_norm(h, delta, norm, x, T, H, ld_h, ld_delta, H, eps, is_bf16, num_threads);
    return proj_gemv(p, x, H, y, p->out, T, is_bf16, num_threads);
}

/* qkv [T, (N + 2K) * D] contiguous, the projection (with its LoRA deltas): RoPE on its q and k
 * heads in place (cos, sin [T, D]); its k and v heads into the pool's layer (kc, vc [K, S, D]) at
 * slots [T]; a [T, N * D] contiguous = attention of each q over its request's slots (index
 * [T, L], lengths [T], as decode_attention_*); y [T, out] contiguous = a @ Wo.T (+ bias). */
int attend_proj(void *qkv, const void *cos_t, const void *sin_t, void *kc, void *vc,
                const int64_t *slots, const int64_t *index, const int64_t *lengths, int64_t L,
                int64_t S, void *a, const Proj *o, void *y, int64_t T, int64_t N, int64_t K,
                int64_t D, float scale, int is_bf16, int num_threads) {
    int64_t ld = (N + 2 * K) * D, elem = is_bf16 ? 2 : 4;
    char *base = qkv;
    rope(qkv, cos_t, sin_t, T, N + K, D, ld, is_bf16, num_threads);
    if (kv_write(base + N * D * elem, base + (N + K) * D * elem, ld, kc, vc, slots, T, K, D, S,
                 elem, num_threads))
        return 2;
    int failed = is_bf16 ? decode_attention_bf16(qkv, kc, vc, a, index, lengths, (int)T, (int)N,
                                                 (int)K, (int)D, L, S, ld, scale, num_threads)
                         : decode_attention_f32(qkv, kc, vc, a, index, lengths, (int)T, (int)N,
                                                (int)K, (int)D, L, S, ld, scale, num_threads);
    if (failed) return 3;
    return proj_gemv(o, a, N * D, y, o->out, T, is_bf16, num_threads);
}

/* gate_up [T, 2I] contiguous: a [T, I] contiguous = silu(gate) * up; y [T, out] contiguous =
 * a @ Wd.T (+ bias). Returns 1, nothing written, where silu_mul declines (its own rule). */
int act_proj(const void *gate_up, void *a, const Proj *down, void *y, int64_t T, int is_bf16,
             int num_threads) {
    int64_t I = down->in;
    if (silu_mul(gate_up, 2 * I, a, T, I, is_bf16, num_threads)) return 1;
    return proj_gemv(down, a, I, y, down->out, T, is_bf16, num_threads);
}

/* One projection's adapter tables of a step (decode_path.py's `LoraTable`): layer l's A rows
 * [pool_rows, H_in] at A0 + l * a_step bytes, its B rows [pool_rows, H_out] at B0 + l * b_step;
 * A0 NULL: no request of the step adapts the projection. */
typedef struct {
    const char *A0, *B0;
    int64_t a_step, b_step;
    const int32_t *ranks; /* [num_runs] */
    int64_t pool_rows;
} LoraTable;

enum { LORA_Q, LORA_K, LORA_V, LORA_O, LORA_GATE, LORA_UP, LORA_DOWN, LORA_MODULES };

/* The step's adapter runs (gpu_lora's RunsStep): tokens starts[g] .. starts[g + 1] read rows
 * offsets[g] .. offsets[g] + ranks[g] of each table, scaled by scales[g]. */
typedef struct {
    lora_runs_fn run;
    const int32_t *starts, *offsets;
    const float *scales;
    int64_t num_runs;
    LoraTable tables[LORA_MODULES];
} LoraStep;

/* y_m (columns col_m.. of a [T, ld_y] buffer) += LoRA of modules m in [first, first + count)
 * from x [T, H_in] contiguous, at layer l; nothing when no module is adapted. */
static int lora_add(const LoraStep *lora, int64_t l, int first, int count, const void *x,
                    int64_t H_in, void *y, int64_t ld_y, const int64_t *col, const int64_t *width,
                    int64_t T, int is_bf16, int num_threads) {
    LoraProj procs[3];
    int64_t n = 0, elem = is_bf16 ? 2 : 4;
    if (lora == NULL) return 0;
    for (int i = 0; i < count; i++) {
        const LoraTable *t = &lora->tables[first + i];
        if (t->A0 == NULL) continue;
        procs[n++] = (LoraProj){t->A0 + l * t->a_step, t->B0 + l * t->b_step,
                                (char *)y + col[i] * elem, t->ranks, ld_y, width[i],
                                t->pool_rows};
    }
    if (n == 0) return 0;
    int failed = lora->run(x, H_in, H_in, T, procs, n, lora->starts, lora->offsets, lora->scales,
                           lora->num_runs, is_bf16, num_threads);
    return failed == 2 ? 2 : failed ? 4 : 0;
}

/* One layer's weights and its layer of the KV pool (decode_path.py's `DecodeLayer`). */
typedef struct {
    const void *input_norm, *post_norm; /* [H] */
    const Proj *qkv, *o, *gate_up, *down;
    void *kc, *vc; /* [K, S, D] */
} DecodeLayer;

/* The step (decode_path.py's `DecodeStep`): its tokens, buffers and shapes. */
typedef struct {
    void *h; /* [T, H]: the residual stream, added into in place */
    void *x, *qkv, *attn, *out, *gate_up, *act, *residual; /* the layers' buffers, contiguous */
    const void *cos, *sin;                                  /* [T, D] */
    const int64_t *slots, *index, *lengths;                 /* [T], [T, L], [T] */
    int64_t L, S, T, H, N, K, D, I;
    float eps, scale;
} DecodeStep;

/* Every layer of a decode step: s->residual [T, H] = the last layer's output (the caller adds
 * it into h). Returns 1, nothing written, where silu_mul does not take the intermediate size
 * (`silu_mul_takes`: no AVX-512 nor AVX2 + FMA, or 16 does not divide it); 5 when a kernel
 * declined mid-step (h already written: not to be redone per op); else as above. */
#define STEP(call)                                                                              \
    if ((failed = (call))) return failed == 1 ? 5 : failed
int decode_layers(const DecodeStep *s, const DecodeLayer *layers, int64_t num_layers,
                  const LoraStep *lora, int is_bf16, int num_threads) {
    if (!silu_mul_takes(s->I)) return 1;
    int64_t T = s->T, H = s->H, I = s->I, nd = s->N * s->D, kd = s->K * s->D;
    const int64_t qkv_col[3] = {0, nd, nd + kd}, qkv_width[3] = {nd, kd, kd};
    const int64_t zero[1] = {0}, hidden[1] = {H}, gu_col[2] = {0, I}, inter[2] = {I, I};
    int failed;
    for (int64_t l = 0; l < num_layers; l++) {
        const DecodeLayer *y = &layers[l];
        STEP(norm_proj(s->h, l ? s->residual : NULL, y->input_norm, s->x, y->qkv, s->qkv, T, H,
                       H, s->eps, is_bf16, num_threads));
        STEP(lora_add(lora, l, LORA_Q, 3, s->x, H, s->qkv, nd + 2 * kd, qkv_col, qkv_width, T,
                      is_bf16, num_threads));
        STEP(attend_proj(s->qkv, s->cos, s->sin, y->kc, y->vc, s->slots, s->index, s->lengths,
                         s->L, s->S, s->attn, y->o, s->out, T, s->N, s->K, s->D, s->scale,
                         is_bf16, num_threads));
        STEP(lora_add(lora, l, LORA_O, 1, s->attn, nd, s->out, H, zero, hidden, T, is_bf16,
                      num_threads));
        STEP(norm_proj(s->h, s->out, y->post_norm, s->x, y->gate_up, s->gate_up, T, H, H, s->eps,
                       is_bf16, num_threads));
        STEP(lora_add(lora, l, LORA_GATE, 2, s->x, H, s->gate_up, 2 * I, gu_col, inter, T,
                      is_bf16, num_threads));
        STEP(act_proj(s->gate_up, s->act, y->down, s->residual, T, is_bf16, num_threads));
        STEP(lora_add(lora, l, LORA_DOWN, 1, s->act, I, s->residual, H, zero, hidden, T, is_bf16,
                      num_threads));
    }
    return 0;
}
