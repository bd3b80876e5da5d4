/* What every native CPU kernel shares (on the include path of each build, `native_build.py`):
 * bfloat16 <-> float32 conversions with torch's rounding (nearest even), 16-wide AVX-512 loads
 * and stores of either dtype, a vectorized exp, and the thread count for a given amount of work.
 * Every function is static inline: each source includes this header on its own. */
#ifndef TOPPINGS_COMMON_H
#define TOPPINGS_COMMON_H
#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__) || defined(__AVX2__)
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

#ifdef __AVX512F__
/* 16 vectors -> one vector of their sums: lane j holds the sum of the vector stored at
 * v[TRANSPOSED(j)] (the tree below ends in a 4 x 4 transpose of lanes), so 16 dot products
 * come out in order when the j-th one's partial sums are stored there. */
#define TRANSPOSED(j) (((j) % 4) * 4 + (j) / 4)
static inline __m512 reduce16(const __m512 *v) {
    __m512 c[8], e[4], f[2];
    for (int i = 0; i < 8; i++) /* 256-bit halves */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* 128-bit lanes */
        e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* pairs within lanes */
        f[i] = _mm512_add_ps(_mm512_unpacklo_ps(e[2 * i], e[2 * i + 1]),
                             _mm512_unpackhi_ps(e[2 * i], e[2 * i + 1]));
    return _mm512_add_ps(_mm512_shuffle_ps(f[0], f[1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(f[0], f[1], _MM_SHUFFLE(3, 2, 3, 2)));
}

/* Sums over pairs of bf16 rows interleaved column by column (unpacklo/hi_epi16 of two rows of
 * 32 columns, as the bf16 dot-product kernels build them): lo holds columns {0-3, 8-11, 16-19,
 * 24-27}, hi the others. Columns 0-15 (first) and 16-31 (second = 1) back in order. */
static inline __m512 unpair(__m512 lo, __m512 hi, int second) {
    const __m512i first_cols = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21,
                                                 22, 23);
    const __m512i second_cols = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15,
                                                  28, 29, 30, 31);
    return _mm512_permutex2var_ps(lo, second ? second_cols : first_cols, hi);
}
#endif

/* A row of len float32 values as (len + 1) / 2 bf16 pairs, element 2k in the low half of
 * dst[k] and 2k + 1 (zero past the end) in the high half: one operand of a bf16 pair product. */
static inline void pack_pairs(const float *src, int64_t len, uint32_t *dst) {
    for (int64_t k = 0; k < (len + 1) / 2; k++) {
        uint32_t hi = 2 * k + 1 < len ? bf16_store(src[2 * k + 1]) : 0;
        dst[k] = (uint32_t)bf16_store(src[2 * k]) | hi << 16;
    }
}

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

/* CALL(t) with t a constant 1-4 equal to T: the kernels are inlined with their row count known,
 * so that their per-row accumulators stay in registers (a runtime count kept them in memory). */
#define WITH_CONST_T(T, CALL)                                                                  \
    do {                                                                                       \
        switch (T) {                                                                           \
        case 1: CALL(1); break;                                                                \
        case 2: CALL(2); break;                                                                \
        case 3: CALL(3); break;                                                                \
        default: CALL(4); break;                                                               \
        }                                                                                      \
    } while (0)

static inline int threads_for(int64_t elements, int num_threads) {
    return elements >= (1 << 16) ? num_threads : 1;
}

/* Asks L2 for `row_bytes` from `row` (a row of the next block a GEMV thread will read) while it
 * sums the present block: the hardware prefetcher alone left each thread's sequential stream
 * short of the memory's rate (docs/benchmarks.md). Prefetches do not fault. */
static inline void prefetch_l2(const void *row, int64_t row_bytes) {
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch((const char *)row + b, 0, 2);
}

#if defined(__AVX2__) && defined(__FMA__)
/* exp16's arithmetic on 8 lanes (AVX2 + FMA), bit for bit: the same reduction, polynomial and
 * scaling; 2^n applied in two exact powers of two so that the one rounding (to a subnormal, or
 * to infinity) is the one scalef makes. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-104.f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.f / 5040.f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    /* n in [-151, 256] (x >= -104; above, 2^n overflows either way; NaN: p is NaN) */
    n = _mm256_min_ps(n, _mm256_set1_ps(256.f));
    __m256i e = _mm256_cvtps_epi32(n);
    __m256i e1 = _mm256_srai_epi32(e, 1), e2 = _mm256_sub_epi32(e, e1);
    __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e1, _mm256_set1_epi32(127)), 23));
    __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e2, _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

/* 8 values of a row at element offset off, as float32. */
static inline __m256 load8(const void *base, int is_bf16, int64_t off) {
    if (!is_bf16) return _mm256_loadu_ps((const float *)base + off);
    __m128i half = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + off));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

/* f rounded to bfloat16 and widened back: round16's rule (nearest even, NaN kept quiet). */
static inline __m256 round8(__m256 f) {
    __m256i u = _mm256_castps_si256(f);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
    r = _mm256_blendv_epi8(r, quiet, nan);
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u)));
}

/* 8 float32 values to a row at element offset off, rounded as bf16_store where bf16. */
static inline void store8(void *base, int is_bf16, int64_t off, __m256 f) {
    if (!is_bf16) {
        _mm256_storeu_ps((float *)base + off, f);
        return;
    }
    __m256i bits = _mm256_srli_epi32(_mm256_castps_si256(round8(f)), 16);
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits),
                                      _mm256_extracti128_si256(bits, 1));
    _mm_storeu_si128((__m128i *)((uint16_t *)base + off), packed);
}
#endif

#endif
