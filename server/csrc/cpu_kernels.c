/* CPU kernels of the engine that torch has no fused op for, built once by server/native.py.
 *
 * decode_attention_*: one query token per request against that request's keys and values read
 * in place from the token-level KV pool (no gather copy). Semantics, per request b and query
 * head n (kv head h = n / G, G = N / K):
 *     p[l] = softmax_l(scale * q[b, n] . k[h, index[b, l]]),  l < lengths[b]
 *     out[b, n] = sum_l p[l] * v[h, index[b, l]]
 * Arithmetic in float32 whatever the storage type; bf16 is rounded to nearest even on output.
 * Shapes: q, out [B, N, D] contiguous; k, v [K, S, D] contiguous (one layer of the pool);
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
                size_t q_off = ((size_t)b * N + (size_t)h * G) * D;
                for (int i = 0; i < G * D; i++)
                    qf[i] = is_bf16 ? bf16_load(((const uint16_t *)q)[q_off + i])
                                    : ((const float *)q)[q_off + i];
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
                         int64_t ld_index, int64_t slots_per_head, float scale, int num_threads) {
    return decode_attention(q, k, v, out, index, lengths, 0, B, N, K, D, ld_index,
                            slots_per_head, scale, num_threads);
}

int decode_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out,
                          const int64_t *index, const int64_t *lengths, int B, int N, int K,
                          int D, int64_t ld_index, int64_t slots_per_head, float scale,
                          int num_threads) {
    return decode_attention(q, k, v, out, index, lengths, 1, B, N, K, D, ld_index,
                            slots_per_head, scale, num_threads);
}
