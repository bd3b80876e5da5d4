/* A decode step's layers in one call (server/model/decode_path.py): `decode_layers` chains kernels
 * of this library that Python called one by one, in the same order on the same buffers, so that
 * the results are bit for bit the per-op path's. What it saves is the Python side of every kernel
 * it chains (about 6 us each: ctypes, checks, a fresh tensor), 180 a SmolLM2 step, and of every
 * LoRA call (20-26 us each in the engine against 4-7 us for the kernel itself, 120 a step when an
 * adapter targets all seven projections): it calls the LoRA kernels (gpu_lora/kernels/csrc/, a
 * library of its own, reached through their addresses) itself, in each projection's GEMV where
 * the LoRA is small (decode_proj.c). A layer:
 *
 *   norm_proj:   h += delta; x = RMSNorm(h); y = x @ W.T (+ bias)          (qkv, gate_up)
 *                then LoRA q, k, v on qkv (from x), or gate, up on gate_up (from x)
 *   attend_proj: RoPE on q and k; k, v into the pool; a = attention(q); y = a @ Wo.T (+ bias)
 *                then LoRA o on y (from a)
 *   act_proj:    a = silu(gate) * up; y = a @ Wd.T (+ bias)
 *                then LoRA down on y (from a)
 *
 * The three are also called one by one from Python (decode_path.py's layer-by-layer path, for
 * steps whose LoRA needs Python: DoRA, a trace, an adapter on the CPU workers).
 * Every function returns a NativeStatus: NATIVE_DECLINED having left the step to the per-op path
 * when a kernel declined before writing (a shape or ISA it does not take); NATIVE_OUT_OF_RANGE
 * when a KV slot (or a LoRA run) lies outside the pool, NATIVE_NO_MEMORY when attention or the
 * LoRA kernel could not allocate. */
#include "native_api.h"
#include "common.h"

/* h [T, H] (row stride ld_h) += delta (row stride ld_delta; NULL: none), x [T, H] contiguous =
 * RMSNorm(h) * norm, y [T, out] contiguous = x @ W.T (+ bias) (+ at's LoRA from x). */
static int norm_proj_at(void *h, const void *delta, const void *norm, void *x, const Proj *p,
                        void *y, int64_t T, int64_t ld_h, int64_t ld_delta, float eps,
                        int is_bf16, int num_threads, const LoraAt *at) {
    int64_t H = p->in;
    add_rms_norm(h, delta, norm, x, T, H, ld_h, ld_delta, H, eps, is_bf16, num_threads);
    return proj_lora(p, x, H, y, p->out, T, is_bf16, num_threads, at);
}

int norm_proj(void *h, const void *delta, const void *norm, void *x, const Proj *p, void *y,
              int64_t T, int64_t ld_h, int64_t ld_delta, float eps, int is_bf16,
              int num_threads) {
    return norm_proj_at(h, delta, norm, x, p, y, T, ld_h, ld_delta, eps, is_bf16, num_threads,
                        NULL);
}

/* qkv [T, (N + 2K) * D] contiguous, the projection (with its LoRA deltas): RoPE on its q and k
 * heads in place (cos, sin [T, D]); its k and v heads into the pool's layer (kc, vc [K, S, D]) at
 * slots [T]; a [T, N * D] contiguous = attention of each q over its request's slots (index
 * [T, L], lengths [T], as decode_attention_*); y [T, out] contiguous = a @ Wo.T (+ bias) (+ at's
 * LoRA from a). */
static int attend_proj_at(void *qkv, const void *cos_t, const void *sin_t, void *kc, void *vc,
                          const int64_t *slots, const int64_t *index, const int64_t *lengths,
                          int64_t L, int64_t S, void *a, const Proj *o, void *y, int64_t T,
                          int64_t N, int64_t K, int64_t D, float scale, int is_bf16,
                          int num_threads, const LoraAt *at) {
    int64_t ld = (N + 2 * K) * D, elem = is_bf16 ? 2 : 4;
    char *base = qkv;
    rope(qkv, cos_t, sin_t, T, N + K, D, ld, is_bf16, num_threads);
    int failed = kv_write(base + N * D * elem, base + (N + K) * D * elem, ld, kc, vc, slots, T, K,
                          D, S, elem, num_threads);
    if (failed) return failed;
    failed = is_bf16 ? decode_attention_bf16(qkv, kc, vc, a, index, lengths, (int)T, (int)N,
                                                 (int)K, (int)D, L, S, ld, scale, num_threads)
                         : decode_attention_f32(qkv, kc, vc, a, index, lengths, (int)T, (int)N,
                                                (int)K, (int)D, L, S, ld, scale, num_threads);
    if (failed) return failed;
    return proj_lora(o, a, N * D, y, o->out, T, is_bf16, num_threads, at);
}

int attend_proj(void *qkv, const void *cos_t, const void *sin_t, void *kc, void *vc,
                const int64_t *slots, const int64_t *index, const int64_t *lengths, int64_t L,
                int64_t S, void *a, const Proj *o, void *y, int64_t T, int64_t N, int64_t K,
                int64_t D, float scale, int is_bf16, int num_threads) {
    return attend_proj_at(qkv, cos_t, sin_t, kc, vc, slots, index, lengths, L, S, a, o, y, T, N,
                          K, D, scale, is_bf16, num_threads, NULL);
}

/* gate_up [T, 2I] contiguous: a [T, I] contiguous = silu(gate) * up; y [T, out] contiguous =
 * a @ Wd.T (+ bias) (+ at's LoRA from a). Returns NATIVE_DECLINED, nothing written, where silu_mul
 * declines (its own rule). */
static int act_proj_at(const void *gate_up, void *a, const Proj *down, void *y, int64_t T,
                       int is_bf16, int num_threads, const LoraAt *at) {
    int64_t I = down->in;
    int failed = silu_mul(gate_up, 2 * I, a, T, I, is_bf16, num_threads);
    if (failed) return failed;
    return proj_lora(down, a, I, y, down->out, T, is_bf16, num_threads, at);
}

int act_proj(const void *gate_up, void *a, const Proj *down, void *y, int64_t T, int is_bf16,
             int num_threads) {
    return act_proj_at(gate_up, a, down, y, T, is_bf16, num_threads, NULL);
}

/* Whether idx[0 .. T) all lie in [0, rows). */
static int in_table(const int64_t *idx, int64_t T, int64_t rows) {
    for (int64_t t = 0; t < T; t++)
        if (idx[t] < 0 || idx[t] >= rows) return 0;
    return 1;
}

/* Rows idx[t] of table [*, width] (elem bytes each) into dst [T, width], for t < T. */
static void gather_rows(void *dst, const void *table, const int64_t *idx, int64_t T,
                        int64_t width, int64_t elem) {
    for (int64_t t = 0; t < T; t++)
        memcpy((char *)dst + t * width * elem, (const char *)table + idx[t] * width * elem,
               (size_t)(width * elem));
}

/* Every layer of a decode step: s->residual [T, H] = the last layer's output (the caller adds
 * it into h), and the step's ends where s asks for them (DecodeStep in native_api.h). Returns
 * NATIVE_DECLINED, nothing written, where silu_mul does not take the intermediate size
 * (`silu_mul_takes`: no AVX-512 nor AVX2 + FMA, or 16 does not divide it);
 * NATIVE_DECLINED_MID_STEP when a kernel declined mid-step (h already written: not to be redone
 * per op; logits_scan refusing the logits' shape included); NATIVE_OUT_OF_RANGE, nothing
 * written, when a token id or a position lies outside its table; else as above. */
#define STEP(call)                                                                              \
    if ((failed = (call))) return failed == NATIVE_DECLINED ? NATIVE_DECLINED_MID_STEP : failed
int decode_layers(const DecodeStep *s, const DecodeLayer *layers, int64_t num_layers,
                  const LoraStep *lora, int is_bf16, int num_threads) {
    if (!silu_mul_takes(s->I)) return NATIVE_DECLINED;
    int64_t T = s->T, H = s->H, I = s->I, nd = s->N * s->D, kd = s->K * s->D;
    int64_t elem = is_bf16 ? 2 : 4;
    if ((s->embed != NULL && !in_table(s->ids, T, s->embed_rows)) ||
        (s->cos_table != NULL && !in_table(s->positions, T, s->table_rows)))
        return NATIVE_OUT_OF_RANGE;
    if (s->embed != NULL) gather_rows(s->h, s->embed, s->ids, T, H, elem);
    if (s->cos_table != NULL) {
        gather_rows(s->cos, s->cos_table, s->positions, T, s->D, elem);
        gather_rows(s->sin, s->sin_table, s->positions, T, s->D, elem);
    }
    const int64_t qkv_col[3] = {0, nd, nd + kd}, qkv_width[3] = {nd, kd, kd};
    const int64_t zero[1] = {0}, hidden[1] = {H}, gu_col[2] = {0, I}, inter[2] = {I, I};
    int failed;
    for (int64_t l = 0; l < num_layers; l++) {
        const DecodeLayer *y = &layers[l];
        const LoraAt qkv = {lora, l, LORA_Q, 3, qkv_col, qkv_width},
                     o = {lora, l, LORA_O, 1, zero, hidden},
                     gate_up = {lora, l, LORA_GATE, 2, gu_col, inter},
                     down = {lora, l, LORA_DOWN, 1, zero, hidden};
        int adapted = lora != NULL;
        STEP(norm_proj_at(s->h, l ? s->residual : NULL, y->input_norm, s->x, y->qkv, s->qkv, T,
                          H, H, s->eps, is_bf16, num_threads, adapted ? &qkv : NULL));
        STEP(attend_proj_at(s->qkv, s->cos, s->sin, y->kc, y->vc, s->slots, s->index,
                            s->lengths, s->L, s->S, s->attn, y->o, s->out, T, s->N, s->K, s->D,
                            s->scale, is_bf16, num_threads, adapted ? &o : NULL));
        STEP(norm_proj_at(s->h, s->out, y->post_norm, s->x, y->gate_up, s->gate_up, T, H, H,
                          s->eps, is_bf16, num_threads, adapted ? &gate_up : NULL));
        STEP(act_proj_at(s->gate_up, s->act, y->down, s->residual, T, is_bf16, num_threads,
                         adapted ? &down : NULL));
    }
    if (s->lm_head == NULL) return NATIVE_OK;
    add_rms_norm(s->h, s->residual, s->final_norm, s->normed, T, H, H, H, H, s->eps, is_bf16,
                 num_threads);
    int64_t V = s->lm_head->out;
    STEP(proj_lora(s->lm_head, s->normed, H, s->logits, V, T, is_bf16, num_threads, NULL));
    if (s->finite == NULL) return NATIVE_OK;
    if (is_bf16) {
#pragma omp parallel for num_threads(threads_for(T * V, num_threads)) schedule(static)
        for (int64_t t = 0; t < T; t++)
            for (int64_t v = 0; v < V; v += 1 << 20) /* bf16_row takes an int length */
                bf16_row((const uint16_t *)s->logits + t * V + v, s->logits_f32 + t * V + v,
                         (int)(V - v < (1 << 20) ? V - v : 1 << 20));
    }
    STEP(logits_scan(is_bf16 ? s->logits_f32 : s->logits, V, T, V, s->finite, s->argmax,
                     num_threads));
    return NATIVE_OK;
}
