/* The LoRA kernels' AVX-512 pieces (lora.c's `lora_runs`, lora_parts.c's split of a decode
 * step between a GEMV's threads): a block of up to 4 tokens of one run, its shrinkage one A row
 * at a time (`shrink_row`), its expansion over a range of output columns (`lora_expand`,
 * `lora_expand_bf16`). Each output column's sum runs over the rank in the same order whatever
 * range a call covers, so that splitting the columns between threads changes no bit. */
#ifndef TOPPINGS_LORA_VEC_H
#define TOPPINGS_LORA_VEC_H
#include "common.h"

#ifdef __AVX512F__
/* The nv (1-4) 16-column vectors at column c of the n (1-4) tokens' sums h [n, r] @ Bt rows
 * off .. off + r, added into y (n and nv constant at each call site: registers, unrolled). */
static inline __attribute__((always_inline)) void expand_strip(
    void *y, int64_t ld_y, const void *Bt, int64_t H_out, int64_t t, int n, int nv, int64_t c,
    int64_t off, int64_t r, int is_bf16, const float *h) {
    __m512 acc[4][4];
    for (int i = 0; i < 4; i++)
        for (int u = 0; u < 4; u++) acc[i][u] = _mm512_setzero_ps();
    for (int64_t j = 0; j < r; j++) {
        __m512 b[4];
        for (int u = 0; u < nv; u++) b[u] = load16(Bt, is_bf16, (off + j) * H_out + c + 16 * u);
        for (int i = 0; i < n; i++) {
            __m512 hj = _mm512_set1_ps(h[i * r + j]);
            for (int u = 0; u < nv; u++) acc[i][u] = _mm512_fmadd_ps(hj, b[u], acc[i][u]);
        }
    }
    for (int i = 0; i < n; i++)
        for (int u = 0; u < nv; u++) {
            int64_t at = (t + i) * ld_y + c + 16 * u;
            store16(y, is_bf16, at, _mm512_add_ps(load16(y, is_bf16, at), acc[i][u]));
        }
}

/* Columns c0 .. c1 (16 | both) of y[t + i] += h[i] @ Bt[off:off + r] for the n (<= 4) tokens
 * of a block, h [n, r] float32. */
static inline __attribute__((always_inline)) void expand_n(void *y, int64_t ld_y, const void *Bt,
                                                            int64_t H_out, int64_t c0, int64_t c1,
                                                            int64_t t, int n, int64_t off,
                                                            int64_t r, int is_bf16,
                                                            const float *h) {
    int64_t c = c0;
    for (; c + 64 <= c1; c += 64)
        expand_strip(y, ld_y, Bt, H_out, t, n, 4, c, off, r, is_bf16, h);
    switch ((c1 - c) / 16) {
    case 3: expand_strip(y, ld_y, Bt, H_out, t, n, 3, c, off, r, is_bf16, h); break;
    case 2: expand_strip(y, ld_y, Bt, H_out, t, n, 2, c, off, r, is_bf16, h); break;
    case 1: expand_strip(y, ld_y, Bt, H_out, t, n, 1, c, off, r, is_bf16, h); break;
    }
}

/* Columns c0 .. c1 of y[t + i] += h[i] @ Bt[off:off + r] (Bt rows H_out long), n <= 4. */
static void lora_expand(void *y, int64_t ld_y, const void *Bt, int64_t H_out, int64_t c0,
                        int64_t c1, int64_t t, int64_t n, int64_t off, int64_t r, int is_bf16,
                        const float *h) {
    switch (n) {
    case 1: expand_n(y, ld_y, Bt, H_out, c0, c1, t, 1, off, r, is_bf16, h); break;
    case 2: expand_n(y, ld_y, Bt, H_out, c0, c1, t, 2, off, r, is_bf16, h); break;
    case 3: expand_n(y, ld_y, Bt, H_out, c0, c1, t, 3, off, r, is_bf16, h); break;
    default: expand_n(y, ld_y, Bt, H_out, c0, c1, t, 4, off, r, is_bf16, h); break;
    }
}

#ifdef __AVX512BF16__
/* bf16 expansion, two Bt rows per instruction: rows j and j + 1 interleaved column by column
 * (unpacklo/hi within 128-bit lanes) against the pair (h[j], h[j + 1]) rounded to bf16, as
 * PEFT's bf16 LoRA rounds its A output. Half the multiply instructions of the float32 path and
 * no widening of B: on SmolLM2's q/k/v the float32 expansion ran at the core's FMA peak.
 * A sum of lo holds columns {0-3, 8-11, 16-19, 24-27} of its 32, hi the others: put back in
 * order by unpair (common.h). hp [n, (r + 1) / 2] packed pairs; nc (1-2) 32-column chunks. */
static inline __attribute__((always_inline)) void expand_strip_bf16(
    void *y, int64_t ld_y, const uint16_t *Bt, int64_t H_out, int64_t t, int n, int nc,
    int64_t c, int64_t off, int64_t r, const uint32_t *hp) {
    int64_t half = (r + 1) / 2;
    __m512 acc[4][4];
    for (int i = 0; i < 4; i++)
        for (int u = 0; u < 4; u++) acc[i][u] = _mm512_setzero_ps();
    for (int64_t jp = 0; jp < half; jp++) {
        const uint16_t *r0 = Bt + (off + 2 * jp) * H_out + c;
        int has_next = 2 * jp + 1 < r;
        __m512bh pr[4];
        for (int u = 0; u < nc; u++) {
            __m512i a = _mm512_loadu_si512(r0 + 32 * u);
            __m512i b = has_next ? _mm512_loadu_si512(r0 + H_out + 32 * u) : _mm512_setzero_si512();
            pr[2 * u] = (__m512bh)_mm512_unpacklo_epi16(a, b);
            pr[2 * u + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
        }
        for (int i = 0; i < n; i++) {
            __m512bh hv = (__m512bh)_mm512_set1_epi32((int)hp[i * half + jp]);
            for (int u = 0; u < 2 * nc; u++) acc[i][u] = _mm512_dpbf16_ps(acc[i][u], pr[u], hv);
        }
    }
    for (int i = 0; i < n; i++)
        for (int u = 0; u < nc; u++) {
            __m512 lo = acc[i][2 * u], hi = acc[i][2 * u + 1];
            int64_t at = (t + i) * ld_y + c + 32 * u;
            __m512 s0 = unpair(lo, hi, 0), s1 = unpair(lo, hi, 1);
            store16(y, 1, at, _mm512_add_ps(load16(y, 1, at), s0));
            store16(y, 1, at + 16, _mm512_add_ps(load16(y, 1, at + 16), s1));
        }
}

static inline __attribute__((always_inline)) void expand_bf16_n(
    void *y, int64_t ld_y, const uint16_t *Bt, int64_t H_out, int64_t c0, int64_t c1, int64_t t,
    int n, int64_t off, int64_t r, const uint32_t *hp) {
    int64_t c = c0;
    for (; c + 64 <= c1; c += 64) expand_strip_bf16(y, ld_y, Bt, H_out, t, n, 2, c, off, r, hp);
    if (c < c1) expand_strip_bf16(y, ld_y, Bt, H_out, t, n, 1, c, off, r, hp);
}

/* Columns c0 .. c1 (32 | both) of y[t + i] += h[i] @ Bt[off:off + r], bf16, Bt rows H_out
 * long (32 | H_out); h [n, r] float32, hp scratch. */
static void lora_expand_bf16(void *y, int64_t ld_y, const void *Bt, int64_t H_out, int64_t c0,
                             int64_t c1, int64_t t, int64_t n, int64_t off, int64_t r,
                             const float *h, uint32_t *hp) {
    int64_t half = (r + 1) / 2;
    for (int64_t i = 0; i < n; i++) pack_pairs(h + i * r, r, hp + i * half);
    const uint16_t *b = (const uint16_t *)Bt;
    switch (n) {
    case 1: expand_bf16_n(y, ld_y, b, H_out, c0, c1, t, 1, off, r, hp); break;
    case 2: expand_bf16_n(y, ld_y, b, H_out, c0, c1, t, 2, off, r, hp); break;
    case 3: expand_bf16_n(y, ld_y, b, H_out, c0, c1, t, 3, off, r, hp); break;
    default: expand_bf16_n(y, ld_y, b, H_out, c0, c1, t, 4, off, r, hp); break;
    }
}
#endif

/* Bt row j of the block into L2 (its expansion follows the shrinkage). */
static inline void prefetch_row(const void *Bt, int64_t row_bytes, int64_t j) {
    prefetch_l2((const char *)Bt + j * row_bytes, row_bytes);
}

/* The rows of a block's n (<= 4) tokens from t as shrink_row takes them: the bf16 rows as they
 * are (rows, returned) with avx512_bf16 and 32 | H_in, else converted to float32 into xf
 * [4, H_in] (NULL returned). */
static inline const uint16_t *const *block_rows(const void *x, int64_t ld_x, int64_t H_in,
                                                int64_t t, int64_t n, int is_bf16,
                                                const uint16_t **rows, float *xf) {
#ifdef __AVX512BF16__
    if (is_bf16 && H_in % 32 == 0) {
        for (int64_t i = 0; i < 4; i++)
            rows[i] = (const uint16_t *)x + (t + (i < n ? i : 0)) * ld_x;
        return rows;
    }
#endif
    for (int64_t i = 0; i < n; i++)
        for (int64_t c = 0; c < H_in; c += 16)
            _mm512_storeu_ps(xf + i * H_in + c, load16(x, is_bf16, (t + i) * ld_x + c));
    return NULL;
}

/* h[i * r + j] = scale * (A[row j] . x[t + i]) for the n (<= 4) tokens of a block: bf16 pairs
 * multiplied and summed in float32 at once (xb: the tokens' rows), or float32 rows xf [4, H_in]. */
static inline __attribute__((always_inline)) void shrink_row(
    const void *A, int64_t H_in, int64_t row, int64_t n, int is_bf16, const uint16_t *const *xb,
    const float *xf, float scale, float *h, int64_t r, int64_t j) {
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
#ifdef __AVX512BF16__
    if (xb != NULL) {
        const uint16_t *a_row = (const uint16_t *)A + row * H_in;
        for (int64_t c = 0; c < H_in; c += 32) {
            __m512bh a = (__m512bh)_mm512_loadu_si512(a_row + c);
            s0 = _mm512_dpbf16_ps(s0, a, (__m512bh)_mm512_loadu_si512(xb[0] + c));
            if (n > 1) s1 = _mm512_dpbf16_ps(s1, a, (__m512bh)_mm512_loadu_si512(xb[1] + c));
            if (n > 2) s2 = _mm512_dpbf16_ps(s2, a, (__m512bh)_mm512_loadu_si512(xb[2] + c));
            if (n > 3) s3 = _mm512_dpbf16_ps(s3, a, (__m512bh)_mm512_loadu_si512(xb[3] + c));
        }
    } else
#endif
        for (int64_t c = 0; c < H_in; c += 16) {
            __m512 a = load16(A, is_bf16, row * H_in + c);
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
#endif

#endif
