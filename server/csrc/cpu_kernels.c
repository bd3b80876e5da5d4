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

/* f rounded to bfloat16 (nearest even, NaN kept quiet) and widened back: bf16_store's rule. */
static inline __m512 round16(__m512 f) {
    __m512i u = _mm512_castps_si512(f);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
}

/* 16 float32 values to a row at element offset off, rounded as bf16_store where bf16. */
static inline void store16(void *base, int is_bf16, int64_t off, __m512 f) {
    if (!is_bf16) {
        _mm512_storeu_ps((float *)base + off, f);
        return;
    }
    __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(round16(f)), 16);
    _mm256_storeu_si256((__m256i *)((uint16_t *)base + off), _mm512_cvtepi32_epi16(bits));
}

/* exp of 16 values, to about 1 ulp: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p of degree 7
 * (Taylor). Inputs below -104 give 0, as expf does (its result underflows there). */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.f / 5040.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}
#endif

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

/* For the gn (1-4) query heads of one kv head, D == 64, read in place from the pool:
 * scores[g * len + l] = scale * (q[g] . k[slots[l]]). Each key row is loaded once for all of
 * them (GQA: the heads of a group share it). */
static inline __attribute__((always_inline)) void dot_group64(const float *q, int gn,
                                                              const void *k, int is_bf16,
                                                              const int64_t *slots, int64_t len,
                                                              float scale, float *scores) {
#ifdef __AVX512F__
    for (int64_t l = 0; l < len; l++) {
        int64_t off = slots[l] * 64;
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
    dot_group64(q, gn, k, is_bf16, slots, len, scale, scores);
    for (int g = 0; g < gn; g++) softmax(scores + (size_t)g * len, len);
    weigh_group64(scores, gn, v, is_bf16, slots, len, acc);
}

/* One (request, kv head): G query rows q [G, D] (float32) -> acc [G, D]. rows is [len, D],
 * scores [G, len]. D == 64 reads the pool in place, up to 4 heads per pass over the rows;
 * otherwise the rows are copied to float32 first and one query runs at a time. */
static inline __attribute__((always_inline)) void attend_rows(
    const float *q, const void *k, const void *v, int is_bf16, const int64_t *slots, int64_t len,
    int G, int D, float scale, float *scores, float *rows, float *acc) {
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
#pragma omp for schedule(dynamic, 4)
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
#ifdef __AVX512F__
    if (H % 16 == 0) {
#pragma omp parallel for num_threads(threads_for(T * H, num_threads)) schedule(static)
        for (int64_t t = 0; t < T; t++) {
            int64_t row = t * ld_h;
            __m512 ss = _mm512_setzero_ps();
            for (int64_t i = 0; i < H; i += 16) {
                __m512 v = load16(h, is_bf16, row + i);
                if (delta != NULL) {
                    v = _mm512_add_ps(v, load16(delta, is_bf16, t * ld_delta + i));
                    if (is_bf16) v = round16(v);
                    store16(h, is_bf16, row + i, v);
                }
                ss = _mm512_add_ps(ss, _mm512_mul_ps(v, v));
            }
            __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(ss) / (float)H + eps));
            for (int64_t i = 0; i < H; i += 16) {
                __m512 v = _mm512_mul_ps(load16(h, is_bf16, row + i), inv);
                if (is_bf16) v = round16(v);
                store16(out, is_bf16, t * ld_out + i, _mm512_mul_ps(load16(w, is_bf16, i), v));
            }
        }
        return 0;
    }
#endif
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
#ifdef __AVX512F__
    if (half % 16 == 0) {
#pragma omp parallel for num_threads(threads_for(T * heads * D, num_threads)) schedule(static)
        for (int64_t t = 0; t < T; t++) {
            for (int64_t i = 0; i < half; i += 16) {
                __m512 c1 = load16(cos_t, is_bf16, t * D + i);
                __m512 s1 = load16(sin_t, is_bf16, t * D + i);
                __m512 c2 = load16(cos_t, is_bf16, t * D + half + i);
                __m512 s2 = load16(sin_t, is_bf16, t * D + half + i);
                for (int64_t n = 0; n < heads; n++) {
                    int64_t base = t * ld_x + n * D;
                    __m512 x1 = load16(x, is_bf16, base + i), x2 = load16(x, is_bf16, base + half + i);
                    __m512 a1 = _mm512_mul_ps(x1, c1), b1 = _mm512_mul_ps(x2, s1);
                    __m512 a2 = _mm512_mul_ps(x2, c2), b2 = _mm512_mul_ps(x1, s2);
                    if (is_bf16) {
                        a1 = round16(a1), b1 = round16(b1), a2 = round16(a2), b2 = round16(b2);
                    }
                    store16(x, is_bf16, base + i, _mm512_sub_ps(a1, b1));
                    store16(x, is_bf16, base + half + i, _mm512_add_ps(a2, b2));
                }
            }
        }
        return 0;
    }
#endif
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

/* SwiGLU: out[t, i] = round(silu(gate[t, i])) * up[t, i], gate = gu[t, :I], up = gu[t, I:]
 * (gu [T, 2I] with row stride ld_gu, out [T, I] contiguous), silu rounded as torch's own op
 * rounds it before the product. Returns 1, having written nothing, where I % 16 != 0 or there
 * is no AVX-512 (the caller's torch path runs instead). */
int silu_mul(const void *gu, int64_t ld_gu, void *out, int64_t T, int64_t I, int is_bf16,
             int num_threads) {
#ifdef __AVX512F__
    if (I % 16 != 0) return 1;
#pragma omp parallel for num_threads(threads_for(T * I * 8, num_threads)) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        for (int64_t i = 0; i < I; i += 16) {
            __m512 g = load16(gu, is_bf16, t * ld_gu + i), u = load16(gu, is_bf16, t * ld_gu + I + i);
            __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
            __m512 act = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
            if (is_bf16) act = round16(act);
            store16(out, is_bf16, t * I + i, _mm512_mul_ps(act, u));
        }
    }
    return 0;
#else
    return 1;
#endif
}

/* ---- LoRA over runs of one adapter's tokens (MBGMV semantics, CPU decode steps) ----------
 * For each run g with ranks[g] > 0 and each token t in [starts[g], starts[g + 1]):
 *     h = A[off:off + r] @ x[t]                 (r = ranks[g], off = offsets[g])
 *     y[t] += scales[g] * (h @ Bt[off:off + r])
 * x [T, H_in] (row stride ld_x), y [T, H_out] (row stride ld_y) in place, A [C, H_in] and
 * Bt [C, H_out] contiguous pool rows (C = pool_rows); all float32 or all bfloat16 (float32
 * arithmetic, y rounded once). Each token is computed over its own adapter's rows only.
 * Returns 2, having written nothing, when a run lies outside y or the pool. */
#ifdef __AVX512F__
/* Tokens t .. t + n (n <= 4) of one run: h = A[off:off + r] @ x[t] for each, then
 * y[t] += scale * h @ Bt[off:off + r], each A and Bt row read once for the n tokens.
 * 16 | H_in and 16 | H_out; xf [4, H_in] and h [4, r] are the caller's scratch. */
static void lora_block(const void *x, int64_t ld_x, void *y, int64_t ld_y, const void *A,
                       const void *Bt, int64_t H_in, int64_t H_out, int64_t t, int64_t n,
                       int64_t off, int64_t r, float scale, int is_bf16, float *xf, float *h) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t c = 0; c < H_in; c += 16)
            _mm512_storeu_ps(xf + i * H_in + c, load16(x, is_bf16, (t + i) * ld_x + c));
    for (int64_t j = 0; j < r; j++) {
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        int64_t row = (off + j) * H_in;
        for (int64_t c = 0; c < H_in; c += 16) {
            __m512 a = load16(A, is_bf16, row + c);
            s0 = _mm512_fmadd_ps(a, _mm512_loadu_ps(xf + c), s0);
            if (n > 1) s1 = _mm512_fmadd_ps(a, _mm512_loadu_ps(xf + H_in + c), s1);
            if (n > 2) s2 = _mm512_fmadd_ps(a, _mm512_loadu_ps(xf + 2 * H_in + c), s2);
            if (n > 3) s3 = _mm512_fmadd_ps(a, _mm512_loadu_ps(xf + 3 * H_in + c), s3);
        }
        h[j] = _mm512_reduce_add_ps(s0) * scale;
        if (n > 1) h[r + j] = _mm512_reduce_add_ps(s1) * scale;
        if (n > 2) h[2 * r + j] = _mm512_reduce_add_ps(s2) * scale;
        if (n > 3) h[3 * r + j] = _mm512_reduce_add_ps(s3) * scale;
    }
    for (int64_t c = 0; c < H_out; c += 16) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t j = 0; j < r; j++) {
            __m512 b = load16(Bt, is_bf16, (off + j) * H_out + c);
            a0 = _mm512_fmadd_ps(_mm512_set1_ps(h[j]), b, a0);
            if (n > 1) a1 = _mm512_fmadd_ps(_mm512_set1_ps(h[r + j]), b, a1);
            if (n > 2) a2 = _mm512_fmadd_ps(_mm512_set1_ps(h[2 * r + j]), b, a2);
            if (n > 3) a3 = _mm512_fmadd_ps(_mm512_set1_ps(h[3 * r + j]), b, a3);
        }
        __m512 acc[4] = {a0, a1, a2, a3};
        for (int64_t i = 0; i < n; i++) {
            int64_t at = (t + i) * ld_y + c;
            store16(y, is_bf16, at, _mm512_add_ps(load16(y, is_bf16, at), acc[i]));
        }
    }
}
#endif

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
    /* blocks[g]: the 4-token blocks of the runs before g that have an adapter (rank > 0). */
    int64_t *blocks = NULL;
#ifdef __AVX512F__
    if (H_in % 16 == 0 && H_out % 16 == 0) {
        blocks = malloc(sizeof(int64_t) * (size_t)(num_runs + 1));
        if (blocks == NULL) return 1;
        blocks[0] = 0;
        for (int64_t g = 0; g < num_runs; g++)
            blocks[g + 1] = blocks[g] + (ranks[g] > 0 ? (starts[g + 1] - starts[g] + 3) / 4 : 0);
    }
#endif
#pragma omp parallel num_threads(threads_for(T * max_rank * (H_in + H_out), num_threads)) \
    reduction(| : failed)
    {
        float *buf = malloc(sizeof(float) * (size_t)(4 * H_in + H_out + 4 * max_rank + 1));
        if (buf == NULL) {
            failed = 1;
        } else {
            float *xf = buf, *acc = buf + 4 * H_in, *h = acc + H_out;
#ifdef __AVX512F__
            if (blocks != NULL) { /* blocks of 4 tokens of one run, spread over the threads */
#pragma omp for schedule(dynamic, 4)
                for (int64_t w = 0; w < blocks[num_runs]; w++) {
                    int64_t lo = 0, hi = num_runs; /* the run g with blocks[g] <= w < blocks[g+1] */
                    while (hi - lo > 1) {
                        int64_t mid = (lo + hi) / 2;
                        if (blocks[mid] <= w) lo = mid; else hi = mid;
                    }
                    int64_t g = lo, t = starts[g] + 4 * (w - blocks[g]);
                    int64_t n = starts[g + 1] - t < 4 ? starts[g + 1] - t : 4;
                    lora_block(x, ld_x, y, ld_y, A, Bt, H_in, H_out, t, n, offsets[g], ranks[g],
                               scales[g], is_bf16, xf, h);
                }
            } else
#endif
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
    free(blocks);
    return failed;
}
