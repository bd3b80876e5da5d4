/* Attention over the token-level KV pool, read in place (no gather copy).
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
#include "native_api.h"
#include "attention_bf16.h"
#include "common.h"

/* Softmax of sg [len] in place. */
static inline void softmax(float *sg, int64_t len) {
#ifdef __AVX512F__
    int64_t l = 0;
    __m512 vmx = _mm512_set1_ps(-INFINITY);
    for (; l + 16 <= len; l += 16) vmx = _mm512_max_ps(vmx, _mm512_loadu_ps(sg + l));
    float mx = _mm512_reduce_max_ps(vmx);
    for (; l < len; l++) mx = sg[l] > mx ? sg[l] : mx;
    __m512 vsum = _mm512_setzero_ps(), vmax = _mm512_set1_ps(mx);
    for (l = 0; l + 16 <= len; l += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + l), vmax));
        _mm512_storeu_ps(sg + l, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    if (l < len) { /* the tail, masked */
        __mmask16 m = (__mmask16)((1u << (len - l)) - 1u);
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sg + l), vmax));
        _mm512_mask_storeu_ps(sg + l, m, e);
        vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(m, e));
    }
    float inv = 1.f / _mm512_reduce_add_ps(vsum);
    __m512 vinv = _mm512_set1_ps(inv);
    for (l = 0; l + 16 <= len; l += 16)
        _mm512_storeu_ps(sg + l, _mm512_mul_ps(_mm512_loadu_ps(sg + l), vinv));
    for (; l < len; l++) sg[l] *= inv;
#else
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
#endif
}

/* Keys PREFETCH_AHEAD positions ahead and the value rows are prefetched (their first 128 bytes:
 * a whole bf16 row) while the scores are computed: a decode step's pool rows are cold in cache
 * and reached through the slot index (measured in the engine, SmolLM2 bf16 at batch 64, every
 * layer in turn: 0.66 -> 0.49 ms a layer). */
#define PREFETCH_AHEAD 16

/* For the gn (1-4) query heads of one kv head, D == 64, read in place from the pool:
 * scores[g * len + l] = scale * (q[g] . k[slots[l]]). Each key row is loaded once for all of
 * them (GQA: the heads of a group share it). */
static inline __attribute__((always_inline)) void dot_group64(const float *q, int gn,
                                                              const void *k, const void *v,
                                                              int is_bf16,
                                                              const int64_t *slots, int64_t len,
                                                              float scale, float *scores) {
#ifdef __AVX512F__
    for (int64_t l = 0; l < len; l++) {
        int64_t off = slots[l] * 64;
        if (l + PREFETCH_AHEAD < len) {
            const char *kr = (const char *)k + slots[l + PREFETCH_AHEAD] * 64 * (is_bf16 ? 2 : 4);
            const char *vr = (const char *)v + slots[l] * 64 * (is_bf16 ? 2 : 4);
            _mm_prefetch(kr, _MM_HINT_T0);
            _mm_prefetch(kr + 64, _MM_HINT_T0);
            _mm_prefetch(vr, _MM_HINT_T1);
            _mm_prefetch(vr + 64, _MM_HINT_T1);
        }
        __m512 k0 = load16(k, is_bf16, off), k1 = load16(k, is_bf16, off + 16);
        __m512 k2 = load16(k, is_bf16, off + 32), k3 = load16(k, is_bf16, off + 48);
        for (int g = 0; g < gn; g++) {
            const float *qg = q + g * 64;
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qg), k0);
            __m512 b = _mm512_mul_ps(_mm512_loadu_ps(qg + 16), k1);
            a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 32), k2, a);
            b = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 48), k3, b);
            scores[g * len + l] = _mm512_reduce_add_ps(_mm512_add_ps(a, b)) * scale;
        }
    }
#endif
}

/* acc[g] = sum_l scores[g * len + l] * v[slots[l]] for gn (1-4) heads, D == 64: each value
 * row loaded once, the gn x 64 sums held in registers. */
static inline __attribute__((always_inline)) void weigh_group64(const float *scores, int gn,
                                                                const void *v, int is_bf16,
                                                                const int64_t *slots,
                                                                int64_t len, float *acc) {
#ifdef __AVX512F__
    __m512 s[4][4];
    for (int g = 0; g < 4; g++)
        for (int c = 0; c < 4; c++) s[g][c] = _mm512_setzero_ps();
    for (int64_t l = 0; l < len; l++) {
        int64_t off = slots[l] * 64;
        __m512 v0 = load16(v, is_bf16, off), v1 = load16(v, is_bf16, off + 16);
        __m512 v2 = load16(v, is_bf16, off + 32), v3 = load16(v, is_bf16, off + 48);
        for (int g = 0; g < gn; g++) {
            __m512 p = _mm512_set1_ps(scores[g * len + l]);
            s[g][0] = _mm512_fmadd_ps(p, v0, s[g][0]);
            s[g][1] = _mm512_fmadd_ps(p, v1, s[g][1]);
            s[g][2] = _mm512_fmadd_ps(p, v2, s[g][2]);
            s[g][3] = _mm512_fmadd_ps(p, v3, s[g][3]);
        }
    }
    for (int g = 0; g < gn; g++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + g * 64 + c * 16, s[g][c]);
#endif
}

/* Heads g0 .. g0 + gn of one kv head (gn a constant 1-4 at each call site). */
static inline __attribute__((always_inline)) void attend_group64(
    const float *q, int gn, const void *k, const void *v, int is_bf16, const int64_t *slots,
    int64_t len, float scale, float *scores, float *acc) {
    dot_group64(q, gn, k, v, is_bf16, slots, len, scale, scores);
    for (int g = 0; g < gn; g++) softmax(scores + (size_t)g * len, len);
    weigh_group64(scores, gn, v, is_bf16, slots, len, acc);
}

#ifdef __AVX512BF16__
/* The same over bf16 keys and values (attention_bf16.h); pairs: scratch [gn, (len + 1) / 2]. */
static inline __attribute__((always_inline)) void attend_group64_bf16(
    const uint16_t *q, int gn, const uint16_t *k, const uint16_t *v, const int64_t *slots,
    int64_t len, float scale, float *scores, uint32_t *pairs, float *acc) {
    dot_group64_bf16(q, gn, k, v, slots, len, scale, scores);
    for (int g = 0; g < gn; g++) softmax(scores + (size_t)g * len, len);
    weigh_group64_bf16(scores, gn, v, slots, len, pairs, acc);
}
#endif

/* One (request, kv head): G query rows q [G, D] (float32; qb the same rows in bf16, or NULL)
 * -> acc [G, D]. rows is [len, D], scores [G, len]. D == 64 reads the pool in place, up to 4
 * heads per pass over the rows (with qb and avx512_bf16: attention_bf16.h); otherwise the rows
 * are copied to float32 first and one query runs at a time. */
static inline __attribute__((always_inline)) void attend_rows(
    const float *q, const uint16_t *qb, const void *k, const void *v, int is_bf16,
    const int64_t *slots, int64_t len, int G, int D, float scale, float *scores, float *rows,
    float *acc) {
#ifdef __AVX512BF16__
    if (D == 64 && qb != NULL) { /* attention_bf16.h: bf16 pairs multiplied as stored */
        const uint16_t *kb = k, *vb = v;
        for (int g0 = 0; g0 < G; g0 += 4) {
            const uint16_t *qg = qb + (size_t)g0 * 64;
            float *ag = acc + (size_t)g0 * 64;
            uint32_t *pairs = (uint32_t *)rows;
            switch (G - g0 < 4 ? G - g0 : 4) {
            case 1: attend_group64_bf16(qg, 1, kb, vb, slots, len, scale, scores, pairs, ag); break;
            case 2: attend_group64_bf16(qg, 2, kb, vb, slots, len, scale, scores, pairs, ag); break;
            case 3: attend_group64_bf16(qg, 3, kb, vb, slots, len, scale, scores, pairs, ag); break;
            default: attend_group64_bf16(qg, 4, kb, vb, slots, len, scale, scores, pairs, ag);
            }
        }
        return;
    }
#endif
#ifdef __AVX512F__
    if (D == 64) {
        for (int g0 = 0; g0 < G; g0 += 4) {
            const float *qg = q + (size_t)g0 * 64;
            float *ag = acc + (size_t)g0 * 64;
            switch (G - g0 < 4 ? G - g0 : 4) { /* constant group sizes: registers, unrolled */
            case 1: attend_group64(qg, 1, k, v, is_bf16, slots, len, scale, scores, ag); break;
            case 2: attend_group64(qg, 2, k, v, is_bf16, slots, len, scale, scores, ag); break;
            case 3: attend_group64(qg, 3, k, v, is_bf16, slots, len, scale, scores, ag); break;
            default: attend_group64(qg, 4, k, v, is_bf16, slots, len, scale, scores, ag);
            }
        }
        return;
    }
#endif
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

/* Row b's slots start at index + row_start[b] (row_start NULL: at index + b * ld_index); a
 * row of length 0 is skipped (its output is not written). */
static int decode_attention(const void *q, const void *k, const void *v, void *out,
                            const int64_t *index, const int64_t *row_start,
                            const int64_t *lengths, int is_bf16, int B, int N, int K, int D,
                            int64_t ld_index, int64_t slots_per_head, int64_t ld_q, float scale,
                            int num_threads) {
    int G = N / K, failed = NATIVE_OK;
    int64_t max_len = 0;
    for (int b = 0; b < B; b++) max_len = lengths[b] > max_len ? lengths[b] : max_len;
    /* One thread for a small step (one request's decode over a short context): waking the
     * other costs more than its share of the work. */
    if ((int64_t)B * N * max_len * D < (1 << 18)) num_threads = 1;
    /* Items (request, kv head) in chunks of 4 where there are many; one at a time where there
     * are few (one request over SmolLM2's 3 kv heads: chunks of 4 gave one thread them all). */
    int chunk = (int64_t)B * K >= 8 * (int64_t)num_threads ? 4 : 1;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        size_t floats = (size_t)G * max_len + (size_t)max_len * D + 2 * (size_t)G * D;
        float *scores = malloc(sizeof(float) * floats);
        if (scores == NULL) {
            failed = NATIVE_NO_MEMORY;
        } else {
            float *rows = scores + (size_t)G * max_len, *qf = rows + (size_t)max_len * D;
            float *acc = qf + (size_t)G * D;
#pragma omp for schedule(dynamic, chunk)
            for (int64_t bh = 0; bh < (int64_t)B * K; bh++) {
                int b = (int)(bh / K), h = (int)(bh % K);
                if (lengths[b] <= 0) continue;
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
                const int64_t *slots = index + (row_start ? row_start[b] : (int64_t)b * ld_index);
                /* bf16 pairs multiplied as stored (attention_bf16.h) where the rows are in cache:
                 * a prefill's keys were written just now. A decode step's rows come from DRAM,
                 * where the float32 path keeps the reads flowing better (measured at batch 64:
                 * 12.4 vs 12.9 ms cold for SmolLM2's 30 layers; in cache 6.8 vs 5.4 ms). */
                const uint16_t *qb = is_bf16 && row_start ? (const uint16_t *)q + q_in : NULL;
                /* Constant head dims let the compiler unroll the per-position loops. */
                if (D == 64)
                    attend_rows(qf, qb, kh, vh, is_bf16, slots, lengths[b], G, 64, scale, scores,
                                rows, acc);
                else if (D == 128)
                    attend_rows(qf, qb, kh, vh, is_bf16, slots, lengths[b], G, 128, scale, scores,
                                rows, acc);
                else
                    attend_rows(qf, qb, kh, vh, is_bf16, slots, lengths[b], G, D, scale, scores,
                                rows, acc);
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
    return decode_attention(q, k, v, out, index, NULL, lengths, 0, B, N, K, D, ld_index,
                            slots_per_head, ld_q, scale, num_threads);
}

int decode_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out,
                          const int64_t *index, const int64_t *lengths, int B, int N, int K,
                          int D, int64_t ld_index, int64_t slots_per_head, int64_t ld_q,
                          float scale,
                          int num_threads) {
    return decode_attention(q, k, v, out, index, NULL, lengths, 1, B, N, K, D, ld_index,
                            slots_per_head, ld_q, scale, num_threads);
}

/* Prefill rows: token b attends to the lengths[b] slots at index + row_start[b] (its segment's
 * cached prefix and its own tokens up to itself), read in place after the step's keys and
 * values are written; rows of length 0 are left to the caller. Shapes as decode_attention_*
 * with B = T tokens; index is one flat list. */
int attention_rows(const void *q, const void *k, const void *v, void *out, const int64_t *index,
                   const int64_t *row_start, const int64_t *lengths, int B, int N, int K, int D,
                   int64_t slots_per_head, int64_t ld_q, float scale, int is_bf16,
                   int num_threads) {
    return decode_attention(q, k, v, out, index, row_start, lengths, is_bf16, B, N, K, D, 0,
                            slots_per_head, ld_q, scale, num_threads);
}


