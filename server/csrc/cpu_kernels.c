/* CPU kernels of the engine that torch has no fused op for, built once by server/native.py.
 *
 * decode_attention_*: one query token per request against that request's keys and values read
 * in place from the token-level KV pool (no gather copy). Semantics, per request b and query
 * head n (kv head h = n / G, G = N / K):
 *     p[l] = softmax_l(scale * q[b, n] . k[h, index[b, l]]),  l < lengths[b]
 *     out[b, n] = sum_l p[l] * v[h, index[b, l]]
 * Arithmetic in float32 whatever the storage type; bf16 is rounded to nearest even on output.
 * Shapes: q [B, N, D] (row stride ld_q, heads contiguous); out [B, N, D] contiguous;
 * k, v [K, S, D] contiguous (one layer of the pool);
 * index [B, ld_index] int64 slots; lengths [B] int64, each >= 1 and <= ld_index.
 */
#include <math.h>
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

static inline float bf16_load(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* A row of D bf16 values to float32 (the bf16 bits are the high half of the float's). */
static inline void bf16_row(const uint16_t *src, float *dst, int D) {
    uint32_t *bits = (uint32_t *)dst;
#pragma omp simd
    for (int d = 0; d < D; d++) bits[d] = (uint32_t)src[d] << 16;
}

static inline uint16_t bf16_store(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Rows slots[0:len] of one kv head's [S, D] matrix, as float32, into dst [len, D]. */
static inline __attribute__((always_inline)) void load_rows(const void *src, int is_bf16,
                                                             const int64_t *slots, int64_t len,
                                                             int D, float *dst) {
    for (int64_t l = 0; l < len; l++) {
        int64_t off = slots[l] * (int64_t)D;
        if (is_bf16)
            bf16_row((const uint16_t *)src + off, dst + l * D, D);
        else
            memcpy(dst + l * D, (const float *)src + off, sizeof(float) * (size_t)D);
    }
}

#ifdef __AVX512F__
/* 16 values of a row at element offset off, as float32. */
static inline __m512 load16(const void *base, int is_bf16, int64_t off) {
    if (!is_bf16) return _mm512_loadu_ps((const float *)base + off);
    __m256i half = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
#endif

/* sg[l] = scale * (qg . k[slots[l]]) for l < len, D == 64, read in place from the pool. */
static inline __attribute__((always_inline)) int dot_rows64(const float *qg, const void *k,
                                                             int is_bf16, const int64_t *slots,
                                                             int64_t len, float scale,
                                                             float *sg) {
#ifdef __AVX512F__
    __m512 q0 = _mm512_loadu_ps(qg), q1 = _mm512_loadu_ps(qg + 16);
    __m512 q2 = _mm512_loadu_ps(qg + 32), q3 = _mm512_loadu_ps(qg + 48);
    for (int64_t l = 0; l < len; l++) {
        int64_t off = slots[l] * 64;
        __m512 a = _mm512_mul_ps(q0, load16(k, is_bf16, off));
        __m512 b = _mm512_mul_ps(q1, load16(k, is_bf16, off + 16));
        a = _mm512_fmadd_ps(q2, load16(k, is_bf16, off + 32), a);
        b = _mm512_fmadd_ps(q3, load16(k, is_bf16, off + 48), b);
        sg[l] = _mm512_reduce_add_ps(_mm512_add_ps(a, b)) * scale;
    }
    return 1;
#else
    return 0;
#endif
}

/* ag = sum_l sg[l] * v[slots[l]], D == 64, read in place from the pool. */
static inline __attribute__((always_inline)) int weigh_rows64(const float *sg, const void *v,
                                                               int is_bf16, const int64_t *slots,
                                                               int64_t len, float *ag) {
#ifdef __AVX512F__
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for (int64_t l = 0; l < len; l++) {
        int64_t off = slots[l] * 64;
        __m512 p = _mm512_set1_ps(sg[l]);
        a0 = _mm512_fmadd_ps(p, load16(v, is_bf16, off), a0);
        a1 = _mm512_fmadd_ps(p, load16(v, is_bf16, off + 16), a1);
        a2 = _mm512_fmadd_ps(p, load16(v, is_bf16, off + 32), a2);
        a3 = _mm512_fmadd_ps(p, load16(v, is_bf16, off + 48), a3);
    }
    _mm512_storeu_ps(ag, a0);
    _mm512_storeu_ps(ag + 16, a1);
    _mm512_storeu_ps(ag + 32, a2);
    _mm512_storeu_ps(ag + 48, a3);
    return 1;
#else
    return 0;
#endif
}

/* Softmax of sg [len] in place. */
static inline void softmax(float *sg, int64_t len) {
    float mx = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : mx)
    for (int64_t l = 0; l < len; l++) mx = sg[l] > mx ? sg[l] : mx;
#pragma omp simd reduction(+ : sum)
    for (int64_t l = 0; l < len; l++) {
        sg[l] = expf(sg[l] - mx);
        sum += sg[l];
    }
    float inv = 1.f / sum;
    for (int64_t l = 0; l < len; l++) sg[l] *= inv;
}

/* One (request, kv head): G query rows q [G, D] (float32) -> acc [G, D]. rows is [len, D],
 * scores [G, len]. Loops run one query at a time so its D accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend_rows(
    const float *q, const void *k, const void *v, int is_bf16, const int64_t *slots, int64_t len,
    int G, int D, float scale, float *scores, float *rows, float *acc) {
    if (D == 64) {
        int done = 1;
        for (int g = 0; g < G && done; g++) {
            float *sg = scores + (size_t)g * len;
            done = dot_rows64(q + (size_t)g * D, k, is_bf16, slots, len, scale, sg);
            softmax(sg, len);
        }
        for (int g = 0; g < G && done; g++)
            weigh_rows64(scores + (size_t)g * len, v, is_bf16, slots, len, acc + (size_t)g * D);
        if (done) return;
    }
    load_rows(k, is_bf16, slots, len, D, rows);
    for (int g = 0; g < G; g++) {
        const float *qg = q + (size_t)g * D;
        float *sg = scores + (size_t)g * len;
        for (int64_t l = 0; l < len; l++) {
            const float *kr = rows + l * D;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int d = 0; d < D; d++) s += qg[d] * kr[d];
            sg[l] = s * scale;
        }
        softmax(sg, len);
    }
    load_rows(v, is_bf16, slots, len, D, rows);
    for (int g = 0; g < G; g++) {
        const float *sg = scores + (size_t)g * len;
        float *ag = acc + (size_t)g * D;
        for (int d = 0; d < D; d++) ag[d] = 0.f;
        for (int64_t l = 0; l < len; l++) {
            const float *vr = rows + l * D;
            float p = sg[l];
#pragma omp simd
            for (int d = 0; d < D; d++) ag[d] += p * vr[d];
        }
    }
}

static int decode_attention(const void *q, const void *k, const void *v, void *out,
                            const int64_t *index, const int64_t *lengths, int is_bf16, int B,
                            int N, int K, int D, int64_t ld_index, int64_t slots_per_head,
                            int64_t ld_q,
                            float scale, int num_threads) {
    int G = N / K, failed = 0;
    int64_t max_len = 0;
    for (int b = 0; b < B; b++) max_len = lengths[b] > max_len ? lengths[b] : max_len;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        size_t floats = (size_t)G * max_len + (size_t)max_len * D + 2 * (size_t)G * D;
        float *scores = malloc(sizeof(float) * floats);
        if (scores == NULL) {
            failed = 1;
        } else {
            float *rows = scores + (size_t)G * max_len, *qf = rows + (size_t)max_len * D;
            float *acc = qf + (size_t)G * D;
#pragma omp for schedule(dynamic, 1)
            for (int64_t bh = 0; bh < (int64_t)B * K; bh++) {
                int b = (int)(bh / K), h = (int)(bh % K);
                size_t q_off = ((size_t)b * N + (size_t)h * G) * D; /* of out */
                size_t q_in = (size_t)b * ld_q + (size_t)h * G * D;
                for (int i = 0; i < G * D; i++)
                    qf[i] = is_bf16 ? bf16_load(((const uint16_t *)q)[q_in + i])
                                    : ((const float *)q)[q_in + i];
                size_t head = (size_t)h * slots_per_head * D;
                const void *kh = is_bf16 ? (const void *)((const uint16_t *)k + head)
                                         : (const void *)((const float *)k + head);
                const void *vh = is_bf16 ? (const void *)((const uint16_t *)v + head)
                                         : (const void *)((const float *)v + head);
                const int64_t *slots = index + (size_t)b * ld_index;
                /* Constant head dims let the compiler unroll the per-position loops. */
                if (D == 64)
                    attend_rows(qf, kh, vh, is_bf16, slots, lengths[b], G, 64, scale, scores, rows,
                                acc);
                else if (D == 128)
                    attend_rows(qf, kh, vh, is_bf16, slots, lengths[b], G, 128, scale, scores,
                                rows, acc);
                else
                    attend_rows(qf, kh, vh, is_bf16, slots, lengths[b], G, D, scale, scores, rows,
                                acc);
                for (int i = 0; i < G * D; i++) {
                    if (is_bf16)
                        ((uint16_t *)out)[q_off + i] = bf16_store(acc[i]);
                    else
                        ((float *)out)[q_off + i] = acc[i];
                }
            }
            free(scores);
        }
    }
    return failed;
}

int decode_attention_f32(const float *q, const float *k, const float *v, float *out,
                         const int64_t *index, const int64_t *lengths, int B, int N, int K, int D,
                         int64_t ld_index, int64_t slots_per_head, int64_t ld_q, float scale,
                         int num_threads) {
    return decode_attention(q, k, v, out, index, lengths, 0, B, N, K, D, ld_index,
                            slots_per_head, ld_q, scale, num_threads);
}

int decode_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out,
                          const int64_t *index, const int64_t *lengths, int B, int N, int K,
                          int D, int64_t ld_index, int64_t slots_per_head, int64_t ld_q,
                          float scale,
                          int num_threads) {
    return decode_attention(q, k, v, out, index, lengths, 1, B, N, K, D, ld_index,
                            slots_per_head, ld_q, scale, num_threads);
}


/* ---- elementwise ops of a Llama layer, one pass each -------------------------------------
 * Every function works on rows of float32 (is_bf16 == 0) or bfloat16 (is_bf16 == 1) data and
 * rounds where torch's unfused ops round, so results equal the torch path's up to float32
 * summation order. Rows run in parallel only when there is enough work to pay for waking the
 * other threads (a decode step's rows are few). */

static inline float ld(const void *p, int is_bf16, int64_t i) {
    return is_bf16 ? bf16_load(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline float rnd(float f, int is_bf16) { return is_bf16 ? bf16_load(bf16_store(f)) : f; }

static inline void st(void *p, int is_bf16, int64_t i, float f) {
    if (is_bf16)
        ((uint16_t *)p)[i] = bf16_store(f);
    else
        ((float *)p)[i] = f;
}

static inline int threads_for(int64_t elements, int num_threads) {
    return elements >= (1 << 16) ? num_threads : 1;
}

/* If delta: h[t] += delta[t] (rounded to h's dtype, in place). Then
 * out[t] = w * round(h[t] * rsqrt(mean(h[t]^2) + eps)), the product rounded too (transformers'
 * LlamaRMSNorm). h, delta, out [T, H] with row strides ld_h, ld_delta, ld_out; w [H]. */
int add_rms_norm(void *h, const void *delta, const void *w, void *out, int64_t T, int64_t H,
                 int64_t ld_h, int64_t ld_delta, int64_t ld_out, float eps, int is_bf16,
                 int num_threads) {
#pragma omp parallel for num_threads(threads_for(T * H, num_threads)) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        float ss = 0.f;
        for (int64_t i = 0; i < H; i++) {
            float v = ld(h, is_bf16, t * ld_h + i);
            if (delta != NULL) {
                v = rnd(v + ld(delta, is_bf16, t * ld_delta + i), is_bf16);
                st(h, is_bf16, t * ld_h + i, v);
            }
            ss += v * v;
        }
        float inv = 1.f / sqrtf(ss / (float)H + eps);
        for (int64_t i = 0; i < H; i++) {
            float v = rnd(ld(h, is_bf16, t * ld_h + i) * inv, is_bf16);
            st(out, is_bf16, t * ld_out + i, ld(w, is_bf16, i) * v);
        }
    }
    return 0;
}

/* Rotate-half RoPE in place on x [T, heads, D] (row stride ld_x, heads contiguous);
 * cos, sin [T, D] contiguous: x[i] = x[i] * cos[i] + rot[i] * sin[i], rot = (-x2, x1). */
int rope(void *x, const void *cos_t, const void *sin_t, int64_t T, int64_t heads, int64_t D,
         int64_t ld_x, int is_bf16, int num_threads) {
    int64_t half = D / 2;
#pragma omp parallel for num_threads(threads_for(T * heads * D, num_threads)) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        for (int64_t n = 0; n < heads; n++) {
            int64_t base = t * ld_x + n * D;
            for (int64_t i = 0; i < half; i++) {
                float x1 = ld(x, is_bf16, base + i), x2 = ld(x, is_bf16, base + half + i);
                float c1 = ld(cos_t, is_bf16, t * D + i), s1 = ld(sin_t, is_bf16, t * D + i);
                float c2 = ld(cos_t, is_bf16, t * D + half + i);
                float s2 = ld(sin_t, is_bf16, t * D + half + i);
                float a1 = rnd(x1 * c1, is_bf16), b1 = rnd(-x2 * s1, is_bf16);
                float a2 = rnd(x2 * c2, is_bf16), b2 = rnd(x1 * s2, is_bf16);
                st(x, is_bf16, base + i, a1 + b1);
                st(x, is_bf16, base + half + i, a2 + b2);
            }
        }
    }
    return 0;
}

/* ---- LoRA over runs of one adapter's tokens (MBGMV semantics, CPU decode steps) ----------
 * For each run g with ranks[g] > 0 and each token t in [starts[g], starts[g + 1]):
 *     h = A[off:off + r] @ x[t]                 (r = ranks[g], off = offsets[g])
 *     y[t] += scales[g] * (h @ Bt[off:off + r])
 * x [T, H_in] (row stride ld_x), y [T, H_out] (row stride ld_y) in place, A [C, H_in] and
 * Bt [C, H_out] contiguous pool rows (C = pool_rows); all float32 or all bfloat16 (float32
 * arithmetic, y rounded once). Each token is computed over its own adapter's rows only.
 * Returns 2, having written nothing, when a run lies outside y or the pool. */
int lora_runs(const void *x, int64_t ld_x, void *y, int64_t ld_y, const void *A, const void *Bt,
              int64_t H_in, int64_t H_out, int64_t pool_rows, int64_t num_tokens,
              const int32_t *starts, const int32_t *offsets, const int32_t *ranks,
              const float *scales, int64_t num_runs, int is_bf16, int num_threads) {
    int64_t max_rank = 0, T = starts[num_runs] - starts[0];
    for (int64_t g = 0; g < num_runs; g++) { /* 2: arguments outside the tensors, nothing done */
        if (starts[g] < 0 || starts[g] > starts[g + 1] || starts[g + 1] > num_tokens) return 2;
        if (ranks[g] < 0 || (ranks[g] > 0 && (offsets[g] < 0 || offsets[g] + ranks[g] > pool_rows)))
            return 2;
        max_rank = ranks[g] > max_rank ? ranks[g] : max_rank;
    }
    int failed = 0;
#pragma omp parallel num_threads(threads_for(T * max_rank * (H_in + H_out), num_threads)) \
    reduction(| : failed)
    {
        float *buf = malloc(sizeof(float) * (size_t)(H_in + H_out + max_rank + 1));
        if (buf == NULL) {
            failed = 1;
        } else {
            float *xf = buf, *acc = buf + H_in, *h = acc + H_out;
#pragma omp for schedule(dynamic, 1)
            for (int64_t g = 0; g < num_runs; g++) {
                int64_t r = ranks[g], off = offsets[g];
                if (r <= 0) continue;
                for (int64_t t = starts[g]; t < starts[g + 1]; t++) {
                    for (int64_t i = 0; i < H_in; i++) xf[i] = ld(x, is_bf16, t * ld_x + i);
                    for (int64_t j = 0; j < r; j++) {
                        float s = 0.f;
                        if (is_bf16) {
                            const uint16_t *a = (const uint16_t *)A + (off + j) * H_in;
#pragma omp simd reduction(+ : s)
                            for (int64_t i = 0; i < H_in; i++) s += xf[i] * bf16_load(a[i]);
                        } else {
                            const float *a = (const float *)A + (off + j) * H_in;
#pragma omp simd reduction(+ : s)
                            for (int64_t i = 0; i < H_in; i++) s += xf[i] * a[i];
                        }
                        h[j] = s * scales[g];
                    }
                    for (int64_t o = 0; o < H_out; o++) acc[o] = 0.f;
                    for (int64_t j = 0; j < r; j++) {
                        float hj = h[j];
                        if (is_bf16) {
                            const uint16_t *b = (const uint16_t *)Bt + (off + j) * H_out;
#pragma omp simd
                            for (int64_t o = 0; o < H_out; o++) acc[o] += hj * bf16_load(b[o]);
                        } else {
                            const float *b = (const float *)Bt + (off + j) * H_out;
#pragma omp simd
                            for (int64_t o = 0; o < H_out; o++) acc[o] += hj * b[o];
                        }
                    }
                    for (int64_t o = 0; o < H_out; o++)
                        st(y, is_bf16, t * ld_y + o, ld(y, is_bf16, t * ld_y + o) + acc[o]);
                }
            }
            free(buf);
        }
    }
    return failed;
}
