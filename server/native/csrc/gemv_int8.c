/* The base model's projections at a few rows (batch-1 to batch-4 decode) over a weight-only int8
 * weight (gemv_int8), and a float32 / bf16-via-float32 GEMV for CPUs with AVX2 + FMA but no
 * AVX-512 (gemv_f32_avx2, gemv_bf16_avx2; linear.c's gemv_f32 / gemv_bf16 need AVX-512).
 *
 * gemv_int8: y[t, o] = scale[o] * sum_i x[t, i] * q[o, i] for t < T (1-4), o < out; x [T, in]
 * float32 or bfloat16 (x_is_bf16; row stride ld_x), q [out, in] int8 contiguous, scale [out]
 * float32, y [T, out] in x's dtype (row stride ld_y, bf16 rounded once); 16 | in, 16 | out.
 * The int8 values are widened to float32 and FMA'd with x in float32 (x is converted once per
 * call), each q row read once for all T rows, in order, one sequential stream per thread (the
 * threads split the output rows). isa (a GemvIsa): the best this build has, AVX2 + FMA, plain C
 * (the tests run each), or AVX-512 only. Returns NATIVE_DECLINED where the shapes, the build or
 * the CPU do not suit it (nothing written): the caller takes torch's path.
 *
 * gemv_f32_avx2 / gemv_bf16_avx2: linear.c's contract (x and W of one dtype, y = x @ W.T in
 * it; 16 | in, 16 | out), 8-wide FMAs in float32; bf16 x and W widened, y rounded once. */
#include "native_api.h"
#include "common.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#endif


/* x [T, in] (either dtype, row stride ld_x) as float32 [T, in] contiguous, in a fresh buffer. */
static float *x_as_f32(const void *x, int64_t ld_x, int is_bf16, int64_t T, int64_t in) {
    float *xf = malloc(sizeof(float) * (size_t)(T * in));
    if (!xf) return NULL;
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < in; i++) xf[t * in + i] = ld(x, is_bf16, t * ld_x + i);
    return xf;
}

#ifdef HAVE_AVX2
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 weights at w + c as float32: int8 (kind 0), float32 (1) or bf16 (2). */
static inline __m256 load8_w(const void *w, int kind, int64_t c) {
    if (kind == 0) {
        __m128i b = _mm_loadl_epi64((const __m128i *)((const int8_t *)w + c));
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    }
    if (kind == 1) return _mm256_loadu_ps((const float *)w + c);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + c));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* y[t, o] = scale[o] (1 where scale is NULL) * sum_i xf[t, i] * w[o, i], 8-wide FMAs, two
 * partial sums per row and token; 16 | in. */
static inline __attribute__((always_inline)) void rows_avx2(const float *xf, int64_t in,
                                                            const void *W, int kind,
                                                            const float *scale, int64_t o0,
                                                            int64_t o1, void *y, int y_bf16,
                                                            int64_t ld_y, int64_t T) {
    size_t wsize = kind == 0 ? 1 : kind == 1 ? 4 : 2;
    for (int64_t o = o0; o < o1; o++) {
        const char *wo = (const char *)W + (size_t)(o * in) * wsize;
        __m256 even[4], odd[4];
        for (int64_t t = 0; t < T; t++) even[t] = odd[t] = _mm256_setzero_ps();
        for (int64_t c = 0; c < in; c += 16) {
            __m256 w0 = load8_w(wo, kind, c), w1 = load8_w(wo, kind, c + 8);
            for (int64_t t = 0; t < T; t++) {
                even[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xf + t * in + c), even[t]);
                odd[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xf + t * in + c + 8), odd[t]);
            }
        }
        for (int64_t t = 0; t < T; t++) {
            float s = hsum8(_mm256_add_ps(even[t], odd[t]));
            st(y, y_bf16, t * ld_y + o, scale ? scale[o] * s : s);
        }
    }
}
#endif

#ifdef __AVX512F__
/* 16 int8 weights at w + c as float32. */
static inline __m512 load16_i8(const int8_t *w, int64_t c) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + c))));
}

/* Output rows of block blk (16 of them) with AVX-512: reduce16 gives 16 sums in order. */
static inline __attribute__((always_inline)) void block_int8_avx512(
    const float *xf, int64_t in, const int8_t *q, const float *scale, int64_t blk, void *y,
    int y_bf16, int64_t ld_y, int64_t T) {
    const int8_t *w = q + blk * 16 * in;
    __m512 part[4][16];
    for (int j = 0; j < 16; j++) {
        const int8_t *wj = w + j * in;
        __m512 even[4], odd[4];
        for (int64_t t = 0; t < T; t++) even[t] = odd[t] = _mm512_setzero_ps();
        int64_t c = 0;
        for (; c + 32 <= in; c += 32) {
            __m512 w0 = load16_i8(wj, c), w1 = load16_i8(wj, c + 16);
            for (int64_t t = 0; t < T; t++) {
                even[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xf + t * in + c), even[t]);
                odd[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xf + t * in + c + 16), odd[t]);
            }
        }
        if (c < in) { /* in % 32 == 16: the last 16 columns */
            __m512 w0 = load16_i8(wj, c);
            for (int64_t t = 0; t < T; t++)
                even[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xf + t * in + c), even[t]);
        }
        for (int64_t t = 0; t < T; t++) part[t][TRANSPOSED(j)] = _mm512_add_ps(even[t], odd[t]);
    }
    __m512 s = _mm512_loadu_ps(scale + blk * 16);
    for (int64_t t = 0; t < T; t++)
        store16(y, y_bf16, t * ld_y + blk * 16, _mm512_mul_ps(s, reduce16(part[t])));
}
#endif

/* Plain C: the same sums in float32, one output row at a time. */
static inline __attribute__((always_inline)) void rows_c(const float *xf, int64_t in, const int8_t *q, const float *scale, int64_t o0,
                   int64_t o1, void *y, int y_bf16, int64_t ld_y, int64_t T) {
    for (int64_t o = o0; o < o1; o++) {
        const int8_t *w = q + o * in;
        for (int64_t t = 0; t < T; t++) {
            const float *xt = xf + t * in;
            float acc[16] = {0};
            for (int64_t i = 0; i < in; i += 16)
                for (int k = 0; k < 16; k++) acc[k] += (float)w[i + k] * xt[i + k];
            float s = 0;
            for (int k = 0; k < 16; k++) s += acc[k];
            st(y, y_bf16, t * ld_y + o, scale[o] * s);
        }
    }
}

int gemv_int8(const void *x, int64_t ld_x, int x_is_bf16, const int8_t *q, const float *scale,
              int64_t out, int64_t in, void *y, int64_t ld_y, int64_t T, int isa,
              int num_threads) {
    if (T < 1 || T > 4 || in % 16 != 0 || out % 16 != 0 || in < 16) return NATIVE_DECLINED;
#ifdef __AVX512F__
    if (isa == ISA_BEST) isa = ISA_AVX512;
#elif defined(HAVE_AVX2)
    if (isa == ISA_BEST) isa = ISA_AVX2;
#else
    if (isa == ISA_BEST) isa = ISA_C;
#endif
#ifndef __AVX512F__
    if (isa == ISA_AVX512) return NATIVE_DECLINED;
#endif
#ifndef HAVE_AVX2
    if (isa == ISA_AVX2) return NATIVE_DECLINED;
#endif
    if (isa != ISA_AVX512 && isa != ISA_AVX2 && isa != ISA_C) return NATIVE_DECLINED;
    float *xf = x_as_f32(x, ld_x, x_is_bf16, T, in);
    if (!xf) return NATIVE_NO_MEMORY;
    int64_t blocks = out / 16;
#pragma omp parallel for num_threads(threads_for(out * in, num_threads)) schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
#ifdef __AVX512F__
        if (isa == ISA_AVX512) {
#define CALL(t) block_int8_avx512(xf, in, q, scale, blk, y, x_is_bf16, ld_y, t)
            WITH_CONST_T(T, CALL);
#undef CALL
            continue;
        }
#endif
#ifdef HAVE_AVX2
        if (isa == ISA_AVX2) {
#define CALL(t) rows_avx2(xf, in, q, 0, scale, blk * 16, blk * 16 + 16, y, x_is_bf16, ld_y, t)
            WITH_CONST_T(T, CALL);
#undef CALL
            continue;
        }
#endif
#define CALL(t) rows_c(xf, in, q, scale, blk * 16, blk * 16 + 16, y, x_is_bf16, ld_y, t)
        WITH_CONST_T(T, CALL);
#undef CALL
    }
    free(xf);
    return 0;
}

/* gemv_int4: y[t, o] = sum_g sum_k x[t, 32 g + k] * (scale[o, g] * q[o, 32 g + k] + offset[o, g])
 * for t < T (1-4); q in [0, 15] as this file's own layout, packed [out, in / 2] uint8: the 16
 * bytes of a group of 32 inputs hold input k in the low nibble of byte k and input k + 16 in its
 * high nibble; scale, offset [out, in / 32] float32 (offset = zero - 8 scale of quant.py's
 * Int4Weight). x float32 or bf16 (x_is_bf16), y in x's dtype; 32 | in, 16 | out. Each group's
 * weights are dequantized once in registers (one FMA) for all T rows, and FMA'd with x in
 * float32. isa as gemv_int8's. Returns NATIVE_DECLINED where it does not suit (nothing written). */
static inline float nibble(const uint8_t *g, int k) {
    return (float)(k < 16 ? g[k] & 15 : g[k - 16] >> 4);
}

static inline __attribute__((always_inline)) void rows_int4_c(const float *xf, int64_t in, const uint8_t *q, const float *scale,
                        const float *offset, int64_t o0, int64_t o1, void *y, int y_bf16,
                        int64_t ld_y, int64_t T) {
    int64_t groups = in / 32;
    for (int64_t o = o0; o < o1; o++) {
        float acc[4][16] = {{0}};
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *b = q + o * (in / 2) + g * 16;
            float s = scale[o * groups + g], c = offset[o * groups + g];
            for (int k = 0; k < 32; k++) {
                float w = s * nibble(b, k) + c;
                for (int64_t t = 0; t < T; t++) acc[t][k % 16] += w * xf[t * in + g * 32 + k];
            }
        }
        for (int64_t t = 0; t < T; t++) {
            float sum = 0;
            for (int k = 0; k < 16; k++) sum += acc[t][k];
            st(y, y_bf16, t * ld_y + o, sum);
        }
    }
}

#ifdef HAVE_AVX2
static inline __attribute__((always_inline)) void rows_int4_avx2(const float *xf, int64_t in, const uint8_t *q, const float *scale,
                           const float *offset, int64_t o0, int64_t o1, void *y, int y_bf16,
                           int64_t ld_y, int64_t T) {
    int64_t groups = in / 32;
    const __m256i low = _mm256_set1_epi32(15);
    for (int64_t o = o0; o < o1; o++) {
        __m256 acc[4][2];
        for (int64_t t = 0; t < T; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *b = q + o * (in / 2) + g * 16;
            __m256 s = _mm256_set1_ps(scale[o * groups + g]);
            __m256 c = _mm256_set1_ps(offset[o * groups + g]);
            for (int h = 0; h < 2; h++) { /* bytes 8h .. 8h + 8: inputs 8h + k and 16 + 8h + k */
                __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 8 * h)));
                __m256 lo = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(_mm256_and_si256(bytes, low)), s, c);
                __m256 hi = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4)), s, c);
                for (int64_t t = 0; t < T; t++) {
                    const float *xg = xf + t * in + g * 32 + 8 * h;
                    acc[t][0] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xg), acc[t][0]);
                    acc[t][1] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xg + 16), acc[t][1]);
                }
            }
        }
        for (int64_t t = 0; t < T; t++)
            st(y, y_bf16, t * ld_y + o, hsum8(_mm256_add_ps(acc[t][0], acc[t][1])));
    }
}
#endif

#ifdef __AVX512F__
static inline __attribute__((always_inline)) void block_int4_avx512(
    const float *xf, int64_t in, const uint8_t *q, const float *scale, const float *offset,
    int64_t blk, void *y, int y_bf16, int64_t ld_y, int64_t T) {
    int64_t groups = in / 32;
    const __m512i low = _mm512_set1_epi32(15);
    __m512 part[4][16];
    for (int j = 0; j < 16; j++) {
        int64_t o = blk * 16 + j;
        __m512 lo_acc[4], hi_acc[4];
        for (int64_t t = 0; t < T; t++) lo_acc[t] = hi_acc[t] = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            __m512i bytes = _mm512_cvtepu8_epi32(
                _mm_loadu_si128((const __m128i *)(q + o * (in / 2) + g * 16)));
            __m512 s = _mm512_set1_ps(scale[o * groups + g]);
            __m512 c = _mm512_set1_ps(offset[o * groups + g]);
            __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, low)), s, c);
            __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), s, c);
            for (int64_t t = 0; t < T; t++) {
                const float *xg = xf + t * in + g * 32;
                lo_acc[t] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xg), lo_acc[t]);
                hi_acc[t] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xg + 16), hi_acc[t]);
            }
        }
        for (int64_t t = 0; t < T; t++)
            part[t][TRANSPOSED(j)] = _mm512_add_ps(lo_acc[t], hi_acc[t]);
    }
    for (int64_t t = 0; t < T; t++) store16(y, y_bf16, t * ld_y + blk * 16, reduce16(part[t]));
}
#endif

int gemv_int4(const void *x, int64_t ld_x, int x_is_bf16, const uint8_t *q, const float *scale,
              const float *offset, int64_t out, int64_t in, void *y, int64_t ld_y, int64_t T,
              int isa, int num_threads) {
    if (T < 1 || T > 4 || in % 32 != 0 || out % 16 != 0 || in < 32) return NATIVE_DECLINED;
#ifdef __AVX512F__
    if (isa == ISA_BEST) isa = ISA_AVX512;
#elif defined(HAVE_AVX2)
    if (isa == ISA_BEST) isa = ISA_AVX2;
#else
    if (isa == ISA_BEST) isa = ISA_C;
#endif
#ifndef __AVX512F__
    if (isa == ISA_AVX512) return NATIVE_DECLINED;
#endif
#ifndef HAVE_AVX2
    if (isa == ISA_AVX2) return NATIVE_DECLINED;
#endif
    if (isa != ISA_AVX512 && isa != ISA_AVX2 && isa != ISA_C) return NATIVE_DECLINED;
    float *xf = x_as_f32(x, ld_x, x_is_bf16, T, in);
    if (!xf) return NATIVE_NO_MEMORY;
    int64_t blocks = out / 16;
#pragma omp parallel for num_threads(threads_for(out * in / 2, num_threads)) schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
#ifdef __AVX512F__
        if (isa == ISA_AVX512) {
#define CALL(t) block_int4_avx512(xf, in, q, scale, offset, blk, y, x_is_bf16, ld_y, t)
            WITH_CONST_T(T, CALL);
#undef CALL
            continue;
        }
#endif
#ifdef HAVE_AVX2
        if (isa == ISA_AVX2) {
#define CALL(t)                                                                                \
    rows_int4_avx2(xf, in, q, scale, offset, blk * 16, blk * 16 + 16, y, x_is_bf16, ld_y, t)
            WITH_CONST_T(T, CALL);
#undef CALL
            continue;
        }
#endif
#define CALL(t) rows_int4_c(xf, in, q, scale, offset, blk * 16, blk * 16 + 16, y, x_is_bf16, ld_y, t)
        WITH_CONST_T(T, CALL);
#undef CALL
    }
    free(xf);
    return 0;
}

/* linear.c's GEMV over a plain float32 (is_bf16 0) or bf16 weight, with AVX2 + FMA. */
static int gemv_float_avx2(const void *x, int64_t ld_x, const void *W, int64_t out, int64_t in,
                           void *y, int64_t ld_y, int64_t T, int is_bf16, int num_threads) {
#ifdef HAVE_AVX2
    if (T < 1 || T > 4 || in % 16 != 0 || out % 16 != 0 || in < 16) return NATIVE_DECLINED;
    float *xf = x_as_f32(x, ld_x, is_bf16, T, in);
    if (!xf) return NATIVE_NO_MEMORY;
    int64_t blocks = out / 16;
#pragma omp parallel for num_threads(threads_for(out * in, num_threads)) schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
        if (is_bf16) {
#define CALL(t) rows_avx2(xf, in, W, 2, NULL, blk * 16, blk * 16 + 16, y, 1, ld_y, t)
            WITH_CONST_T(T, CALL);
#undef CALL
        } else {
#define CALL(t) rows_avx2(xf, in, W, 1, NULL, blk * 16, blk * 16 + 16, y, 0, ld_y, t)
            WITH_CONST_T(T, CALL);
#undef CALL
        }
    }
    free(xf);
    return 0;
#else
    (void)x, (void)ld_x, (void)W, (void)out, (void)in, (void)y, (void)ld_y, (void)T;
    (void)is_bf16, (void)num_threads;
    return NATIVE_DECLINED;
#endif
}

int gemv_f32_avx2(const float *x, int64_t ld_x, const float *W, int64_t out, int64_t in, float *y,
                  int64_t ld_y, int64_t T, int num_threads) {
    return gemv_float_avx2(x, ld_x, W, out, in, y, ld_y, T, 0, num_threads);
}

int gemv_bf16_avx2(const uint16_t *x, int64_t ld_x, const uint16_t *W, int64_t out, int64_t in,
                   uint16_t *y, int64_t ld_y, int64_t T, int num_threads) {
    return gemv_float_avx2(x, ld_x, W, out, in, y, ld_y, T, 1, num_threads);
}
