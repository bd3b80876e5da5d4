/* Attention over bfloat16 keys and values with avx512_bf16 dot products (D == 64): the path
 * attention.c takes for prefill rows of a bf16 pool where the CPU has them.
 *
 * Semantics as decode_attention (attention.c), for gn (1-4) query heads of one kv head:
 *     p[g, l] = softmax_l(scale * q[g] . k[slots[l]]),  out[g] = sum_l p[g, l] * v[slots[l]]
 * Products of bf16 pairs are exact in float32 and summed in float32. q is read as bf16 (what
 * the projection wrote); p is rounded to bf16 before it weighs the values, as torch's CPU flash
 * attention rounds its exponentials for a bf16 value product. The float32 path widens every
 * key and value to float32 and sums one reduction per key and head; this one multiplies the
 * pairs as they are stored, sums 16 keys' scores in one transposed reduction, and weighs two
 * value rows per instruction. With the rows in cache (a prefill's own keys) it is 1.2-1.3x the
 * float32 path, which ran at the core's FMA peak; with the rows in DRAM both wait on the reads
 * and the float32 path was 4-7% faster (its longer work per key spaces the prefetches). */
#ifndef TOPPINGS_ATTENTION_BF16_H
#define TOPPINGS_ATTENTION_BF16_H
#include "common.h"

#ifdef __AVX512BF16__
#define KEYS_AHEAD 32 /* key rows prefetched this far ahead */

/* scores[g * len + l] = scale * (q[g] . k[slots[l]]), q [gn, 64] bf16, k rows of 64 bf16;
 * the value rows are prefetched meanwhile (weigh_group64_bf16 reads them next). */
static inline __attribute__((always_inline)) void dot_group64_bf16(
    const uint16_t *q, int gn, const uint16_t *k, const uint16_t *v, const int64_t *slots,
    int64_t len, float scale, float *scores) {
    __m512bh q0[4], q1[4];
    for (int g = 0; g < gn; g++) {
        q0[g] = (__m512bh)_mm512_loadu_si512(q + g * 64);
        q1[g] = (__m512bh)_mm512_loadu_si512(q + g * 64 + 32);
    }
    const __m512 vscale = _mm512_set1_ps(scale);
    int64_t l = 0;
    for (; l + 16 <= len; l += 16) {
        for (int g = 0; g < gn; g++) {
            __m512 part[16];
            for (int j = 0; j < 16; j++) {
                if (g == 0) { /* the next block's key rows and this block's value rows */
                    if (l + KEYS_AHEAD + j < len) {
                        const char *kr = (const char *)(k + slots[l + KEYS_AHEAD + j] * 64);
                        _mm_prefetch(kr, _MM_HINT_T0);
                        _mm_prefetch(kr + 64, _MM_HINT_T0);
                    }
                    const char *vr = (const char *)(v + slots[l + j] * 64);
                    _mm_prefetch(vr, _MM_HINT_T1);
                    _mm_prefetch(vr + 64, _MM_HINT_T1);
                }
                const uint16_t *row = k + slots[l + j] * 64;
                __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), q0[g],
                                            (__m512bh)_mm512_loadu_si512(row));
                part[TRANSPOSED(j)] = _mm512_dpbf16_ps(s, q1[g],
                                                       (__m512bh)_mm512_loadu_si512(row + 32));
            }
            _mm512_storeu_ps(scores + g * len + l, _mm512_mul_ps(reduce16(part), vscale));
        }
    }
    for (; l < len; l++) {
        const uint16_t *row = k + slots[l] * 64;
        __m512bh k0 = (__m512bh)_mm512_loadu_si512(row);
        __m512bh k1 = (__m512bh)_mm512_loadu_si512(row + 32);
        for (int g = 0; g < gn; g++) {
            __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), q0[g], k0);
            scores[g * len + l] = _mm512_reduce_add_ps(_mm512_dpbf16_ps(s, q1[g], k1)) * scale;
        }
    }
}

/* acc[g] = sum_l bf16(p[g, l]) * v[slots[l]] for gn (1-4) heads, D == 64: value rows l and l + 1
 * interleaved column by column against the pair (p[l], p[l + 1]); pairs [gn, (len + 1) / 2]
 * is scratch. The sums of lo/hi hold columns {0-3, 8-11, ...} / {4-7, 12-15, ...} of their
 * 32, put back in order at the end. */
static inline __attribute__((always_inline)) void weigh_group64_bf16(
    const float *scores, int gn, const uint16_t *v, const int64_t *slots, int64_t len,
    uint32_t *pairs, float *acc) {
    int64_t half = (len + 1) / 2;
    for (int g = 0; g < gn; g++) pack_pairs(scores + g * len, len, pairs + g * half);
    __m512 s[4][4];
    for (int g = 0; g < 4; g++)
        for (int c = 0; c < 4; c++) s[g][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < half; i++) {
        const uint16_t *r0 = v + slots[2 * i] * 64;
        __m512i a0 = _mm512_loadu_si512(r0), a1 = _mm512_loadu_si512(r0 + 32);
        __m512i b0 = _mm512_setzero_si512(), b1 = b0;
        if (2 * i + 1 < len) {
            const uint16_t *r1 = v + slots[2 * i + 1] * 64;
            b0 = _mm512_loadu_si512(r1);
            b1 = _mm512_loadu_si512(r1 + 32);
        }
        __m512bh pr[4] = {(__m512bh)_mm512_unpacklo_epi16(a0, b0),
                          (__m512bh)_mm512_unpackhi_epi16(a0, b0),
                          (__m512bh)_mm512_unpacklo_epi16(a1, b1),
                          (__m512bh)_mm512_unpackhi_epi16(a1, b1)};
        for (int g = 0; g < gn; g++) {
            __m512bh p = (__m512bh)_mm512_set1_epi32((int)pairs[g * half + i]);
            for (int c = 0; c < 4; c++) s[g][c] = _mm512_dpbf16_ps(s[g][c], pr[c], p);
        }
    }
    for (int g = 0; g < gn; g++)
        for (int c = 0; c < 2; c++) {
            __m512 lo = s[g][2 * c], hi = s[g][2 * c + 1];
            _mm512_storeu_ps(acc + g * 64 + 32 * c, unpair(lo, hi, 0));
            _mm512_storeu_ps(acc + g * 64 + 32 * c + 16, unpair(lo, hi, 1));
        }
}

#endif
#endif
