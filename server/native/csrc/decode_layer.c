/* A decode step's layer in four calls instead of ten (server/model/decode_path.py): each call
 * chains kernels of this library that Python called one by one, in the same order on the same
 * buffers, so that the results are bit for bit the per-op path's. What a call saves is the
 * Python side of every kernel it chains (about 6 us each: ctypes, checks, a fresh tensor), 180
 * a SmolLM2 step. Between the calls Python adds the LoRA deltas of the projection just made.
 *
 *   norm_proj:   h += delta; x = RMSNorm(h); y = x @ W.T (+ bias)          (qkv, gate_up)
 *   attend_proj: RoPE on q and k; k, v into the pool; a = attention(q); y = a @ Wo.T (+ bias)
 *   act_proj:    a = silu(gate) * up; y = a @ Wd.T (+ bias)
 *
 * Every call returns 0, or nonzero having left the step to the per-op path when a kernel
 * declined before writing (a shape or ISA it does not take); 2 when a KV slot lies outside the
 * pool, 3 when attention could not allocate. */
#include "common.h"

/* The kernels chained here (elementwise.c, attention.c, linear.c, gemv_int8.c). */
int add_rms_norm(void *h, const void *delta, const void *w, void *out, int64_t T, int64_t H,
                 int64_t ld_h, int64_t ld_delta, int64_t ld_out, float eps, int is_bf16,
                 int num_threads);
int rope(void *x, const void *cos_t, const void *sin_t, int64_t T, int64_t heads, int64_t D,
         int64_t ld_x, int is_bf16, int num_threads);
int silu_mul(const void *gu, int64_t ld_gu, void *out, int64_t T, int64_t I, int is_bf16,
             int num_threads);
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

/* One projection and the GEMV that runs it (decode_path.py's `Proj`, field for field). */
enum { GEMV_F32, GEMV_BF16, GEMV_F32_AVX2, GEMV_BF16_AVX2, GEMV_INT8, GEMV_INT4 };
typedef struct {
    int64_t kind;        /* one of the GEMV_* above */
    const void *w;       /* the plain weight [out, in], or int8 values / packed int4 values */
    const float *scale;  /* int8: [out]; int4: [out, in / 32]; else NULL */
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
 * a @ Wd.T (+ bias). Returns 1, nothing written, without AVX-512 (silu_mul's own rule). */
int act_proj(const void *gate_up, void *a, const Proj *down, void *y, int64_t T, int is_bf16,
             int num_threads) {
    int64_t I = down->in;
    if (silu_mul(gate_up, 2 * I, a, T, I, is_bf16, num_threads)) return 1;
    return proj_gemv(down, a, I, y, down->out, T, is_bf16, num_threads);
}
