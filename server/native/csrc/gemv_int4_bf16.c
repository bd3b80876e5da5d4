/* The int4 GEMV for bfloat16 activations (`--quantization int4` with bf16, batch-1 to batch-4
 * decode), on CPUs with AVX512_BF16: the weights are multiplied as bf16 by vdpbf16ps, 32 products a
 * instruction, without converting them to float32 first.
 *
 * A 4-bit value n in [0, 15] becomes the bf16 number 128 + n by setting the bits 0x4300 above it
 * (bf16 numbers in [128, 256) step by 1), so a group's dot product is taken against 128 + n and
 * corrected once per group:
 *
 *   y[t, o] = sum_g  s[o, g] * D[t, o, g]  +  (z[o, g] - 136 s[o, g]) * S[t, g]
 *   D[t, o, g] = sum_k x[t, 32 g + k] * (128 + n[o, 32 g + k]),   S[t, g] = sum_k x[t, 32 g + k]
 *
 * which is sum_g sum_k x * (s (n - 8) + z), the weight quant.py's Int4Weight dequantizes to
 * (W = scale * (q - 8) + zero). The products are exact in float32 (8-bit x 8-bit significands);
 * the sums round in float32 (as vdpbf16ps and FMA do), about 8x larger terms than a dot product
 * against n - 8 would sum, so a few more ulps of float32 (far below bf16's output rounding).
 * Measured against torch's bf16 int4 kernel (`_weight_int4pack_mm_for_cpu`), the reason it
 * exists: see quant.py's `gemv_rows`.
 *
 * Layout (quant.py's `int4_bf16_gemv_layout`): q [out, in / 2] uint8. A group of 32 inputs has 16
 * bytes, byte k holding input k in its low nibble and input k + 16 in its high one; two groups
 * (g, g + 1) share 32 bytes, interleaved two bytes at a time (g's bytes 2m, 2m + 1, then g + 1's),
 * so that once widened to 16-bit lanes the even float32 lanes of vdpbf16ps hold group g and the
 * odd ones group g + 1, and a group pair's scales broadcast as a pair (vbroadcasti32x2). A last
 * odd group keeps its 16 bytes in order. sz [out, in / 32] uint32: a group's scale s (low half)
 * and zero z (high half) as bf16 bits (exact: bf16 activations keep their scales in bf16).
 * x [T, in] bf16 (row stride ld_x), y [T, out] bf16 (row stride ld_y, rounded once); T 1-4,
 * 32 | in, 16 | out. Returns NATIVE_DECLINED where it does not suit (nothing written),
 * NATIVE_NO_MEMORY. */
#include "native_api.h"
#include "common.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_DPBF16 1

/* 16 output rows blk * 16 .. + 16. xp [T, G4 * 32]: x in the order the weights unpack (below),
 * zero past `in`; sums [T, G4]: each group's sum of x, zero past G; has_next: whether the
 * thread's next block follows (its rows are prefetched). */
static inline __attribute__((always_inline)) void block_int4_bf16(
    const uint16_t *xp, const float *sums, int64_t G4, int64_t in, const uint8_t *q,
    const uint32_t *sz, int64_t blk, uint16_t *y, int64_t ld_y, int64_t T, int has_next) {
    int64_t G = in / 32;
    const __m512i low4 = _mm512_set1_epi8(0x0F), bias = _mm512_set1_epi8(0x43);
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512 c136 = _mm512_set1_ps(-136.f);
    __m512 part[4][16];
    for (int j = 0; j < 16; j++) {
        int64_t o = blk * 16 + j;
        const uint8_t *qo = q + o * (in / 2);
        const uint32_t *szo = sz + o * G;
        if (has_next) { /* the next block's row j into L2 while this one is summed (linear.c) */
            prefetch_l2(qo + 16 * (in / 2), in / 2);
            prefetch_l2(szo + 16 * G, G * 4);
        }
        __m512 acc[4];
        for (int64_t t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
        /* Four groups a vector: each 128-bit lane holds one group's 16 bytes; its low nibbles
         * (inputs 0-15) and high ones (16-31), each byte unpacked beside 0x43 into a bf16 word
         * 0x430n = 128 + n, make four vectors whose 32-bit lanes 4L .. 4L + 3 belong to group L. */
        for (int64_t g = 0; g < G; g += 4) {
            int rest = G - g >= 4 ? 4 : (int)(G - g);
            __m512i v = _mm512_maskz_loadu_epi8(rest == 4 ? ~(__mmask64)0
                                                          : (((__mmask64)1 << (16 * rest)) - 1),
                                                qo + 16 * g);
            __m512i lo = _mm512_and_si512(v, low4);
            __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            __m512i w0 = _mm512_unpacklo_epi8(lo, bias), w1 = _mm512_unpackhi_epi8(lo, bias);
            __m512i w2 = _mm512_unpacklo_epi8(hi, bias), w3 = _mm512_unpackhi_epi8(hi, bias);
            __m512i pairs = _mm512_permutexvar_epi32(
                spread, _mm512_castsi128_si512(_mm_maskz_loadu_epi32(
                            (__mmask8)((1u << rest) - 1), szo + g)));
            __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
            for (int64_t t = 0; t < T; t++) {
                const uint16_t *xt = xp + t * G4 * 32 + 32 * g;
                __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)w0,
                                            (__m512bh)_mm512_loadu_si512(xt));
                d = _mm512_dpbf16_ps(d, (__m512bh)w1, (__m512bh)_mm512_loadu_si512(xt + 32));
                d = _mm512_dpbf16_ps(d, (__m512bh)w2, (__m512bh)_mm512_loadu_si512(xt + 64));
                d = _mm512_dpbf16_ps(d, (__m512bh)w3, (__m512bh)_mm512_loadu_si512(xt + 96));
                acc[t] = _mm512_fmadd_ps(d, s, acc[t]);
            }
        }
        for (int64_t g = 0; g < G; g += 16) { /* (z - 136 s) * S, 16 groups at a time */
            __mmask16 m = G - g >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (G - g)) - 1);
            __m512i v = _mm512_maskz_loadu_epi32(m, szo + g);
            __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            __m512 c = _mm512_fmadd_ps(c136, s, _mm512_castsi512_ps(_mm512_and_si512(v, high)));
            for (int64_t t = 0; t < T; t++)
                acc[t] = _mm512_fmadd_ps(c, _mm512_maskz_loadu_ps(m, sums + t * G4 + g), acc[t]);
        }
        for (int64_t t = 0; t < T; t++) part[t][TRANSPOSED(j)] = acc[t];
    }
    for (int64_t t = 0; t < T; t++) store16(y, 1, t * ld_y + blk * 16, reduce16(part[t]));
}
#endif

int gemv_int4_bf16(const uint16_t *x, int64_t ld_x, const uint8_t *q, const uint32_t *sz,
                   int64_t out, int64_t in, uint16_t *y, int64_t ld_y, int64_t T,
                   int num_threads) {
#ifndef HAVE_DPBF16
    (void)x, (void)ld_x, (void)q, (void)sz, (void)out, (void)in, (void)y, (void)ld_y, (void)T,
        (void)num_threads;
    return NATIVE_DECLINED;
#else
    if (T < 1 || T > 4 || in % 32 != 0 || out % 16 != 0 || in < 32) return NATIVE_DECLINED;
    int64_t G = in / 32, G4 = (G + 3) / 4 * 4;
    uint16_t *xp = calloc((size_t)(T * G4 * 32), sizeof(uint16_t)); /* zero past `in` */
    float *sums = malloc(sizeof(float) * (size_t)(T * G4));
    if (!xp || !sums) {
        free(xp), free(sums);
        return NATIVE_NO_MEMORY;
    }
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *xt = x + t * ld_x;
        /* In each block of four groups, vector k lane L (8 words) holds group L's inputs
         * 8k .. 8k + 8: an 8-input block transpose of x. */
        for (int64_t g = 0; g < G; g++)
            for (int k = 0; k < 4; k++)
                memcpy(xp + t * G4 * 32 + (g / 4) * 128 + 32 * k + 8 * (g % 4),
                       xt + 32 * g + 8 * k, 8 * sizeof(uint16_t));
        for (int64_t g = 0; g < G; g++) {
            float s = 0;
            for (int k = 0; k < 32; k++) s += bf16_load(xt[32 * g + k]);
            sums[t * G4 + g] = s;
        }
    }
    int64_t blocks = out / 16;
#pragma omp parallel for num_threads(threads_for(out * in / 2, num_threads)) schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
#define CALL(t) block_int4_bf16(xp, sums, G4, in, q, sz, blk, y, ld_y, t, blk + 1 < blocks)
        WITH_CONST_T(T, CALL);
#undef CALL
    }
    free(xp), free(sums);
    return 0;
#endif
}
