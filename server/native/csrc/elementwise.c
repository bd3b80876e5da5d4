/* The elementwise ops of a Llama layer, one pass each (RMSNorm with the residual add, RoPE,
 * SwiGLU's silu * up), and the KV write. The first three works on rows of float32 (is_bf16 == 0) or bfloat16
 * (is_bf16 == 1) data and rounds where torch's unfused ops round, so results equal the torch
 * path's up to float32 summation order (and, in silu, exp16's last bit). Rows run in parallel
 * only when there is enough work to pay for waking the other threads (a decode step's rows are
 * few). */
#include "native_api.h"
#include "common.h"

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
                    __m512 x1 = load16(x, is_bf16, base + i);
                    __m512 x2 = load16(x, is_bf16, base + half + i);
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

/* Whether silu_mul runs for an intermediate size I in this build: AVX-512, or AVX2 + FMA, and
 * 16 | I. The one rule its callers ask (decode_layer.c's `decode_layers`, decode_path.py). */
int silu_mul_takes(int64_t I) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    return I > 0 && I % 16 == 0;
#else
    (void)I;
    return 0;
#endif
}

/* SwiGLU: out[t, i] = round(silu(gate[t, i])) * up[t, i], gate = gu[t, :I], up = gu[t, I:]
 * (gu [T, 2I] with row stride ld_gu, out [T, I] contiguous), silu rounded as torch's own op
 * rounds it before the product. AVX-512, or AVX2 + FMA (8 lanes, the same arithmetic: the same
 * bits). Returns NATIVE_DECLINED, having written nothing, where it does not take I
 * (`silu_mul_takes`; the caller's torch path runs instead). */
int silu_mul(const void *gu, int64_t ld_gu, void *out, int64_t T, int64_t I, int is_bf16,
             int num_threads) {
    if (!silu_mul_takes(I)) return NATIVE_DECLINED;
#if defined(__AVX512F__)
#pragma omp parallel for num_threads(threads_for(T * I * 8, num_threads)) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        for (int64_t i = 0; i < I; i += 16) {
            __m512 g = load16(gu, is_bf16, t * ld_gu + i);
            __m512 u = load16(gu, is_bf16, t * ld_gu + I + i);
            __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
            __m512 act = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
            if (is_bf16) act = round16(act);
            store16(out, is_bf16, t * I + i, _mm512_mul_ps(act, u));
        }
    }
    return 0;
#elif defined(__AVX2__) && defined(__FMA__)
#pragma omp parallel for num_threads(threads_for(T * I * 8, num_threads)) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        for (int64_t i = 0; i < I; i += 8) {
            __m256 g = load8(gu, is_bf16, t * ld_gu + i);
            __m256 u = load8(gu, is_bf16, t * ld_gu + I + i);
            __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
            __m256 act = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e));
            if (is_bf16) act = round8(act);
            store8(out, is_bf16, t * I + i, _mm256_mul_ps(act, u));
        }
    }
    return 0;
#else
    (void)gu, (void)ld_gu, (void)out, (void)T, (void)I, (void)is_bf16, (void)num_threads;
    return NATIVE_DECLINED;
#endif
}


/* Keys and values of T tokens into one layer of the pool: kc[h, slots[t]] = k[t, h] and the same
 * for v, k and v [T, K, D] with row stride ld (heads contiguous), kc and vc [K, S, D] contiguous,
 * elem_bytes 2 or 4. Returns NATIVE_OUT_OF_RANGE, having written nothing, when a slot lies outside
 * [0, S). */
int kv_write(const void *k, const void *v, int64_t ld, void *kc, void *vc, const int64_t *slots,
             int64_t T, int64_t K, int64_t D, int64_t S, int64_t elem_bytes, int num_threads) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= S) return NATIVE_OUT_OF_RANGE;
    size_t row = (size_t)(D * elem_bytes);
#pragma omp parallel for num_threads(threads_for(T * K * D * 4, num_threads)) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        for (int64_t h = 0; h < K; h++) {
            size_t src = (size_t)(t * ld + h * D) * (size_t)elem_bytes;
            size_t dst = (size_t)(h * S + slots[t]) * row;
            memcpy((char *)kc + dst, (const char *)k + src, row);
            memcpy((char *)vc + dst, (const char *)v + src, row);
        }
    }
    return 0;
}
