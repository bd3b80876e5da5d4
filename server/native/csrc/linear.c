/* The base model's projections at a few rows (batch-1 to batch-4 decode): y = x @ W.T over a
 * plain weight, bfloat16 with avx512_bf16 dot products (gemv_bf16) or float32 with AVX-512 FMAs
 * (gemv_f32).
 *
 * gemv_bf16: y[t, o] = bf16(sum_i x[t, i] * W[o, i]) for t < T (1-4), o < out; x [T, in] (row
 * stride ld_x), W [out, in] contiguous, y [T, out] (row stride ld_y); 32 | in, 16 | out.
 * Products of bf16 pairs are exact in float32 and summed in float32, y rounded once (what
 * torch's bf16 linear does up to summation order). Returns NATIVE_DECLINED where the shapes or
 * the CPU do not suit it (nothing written): the caller takes oneDNN's path.
 *
 * At these rows a projection only streams its weight: oneDNN's packed bf16 GEMM read SmolLM2's
 * weights at about 17 GB/s on two threads at one row (12 on one); this reads each 16-row block
 * of W in order, once per token, one sequential stream per thread (25 and 18 GB/s), and asks L2
 * for the next block while it sums this one. */
#include "native_api.h"
#include "common.h"

int gemv_bf16(const uint16_t *x, int64_t ld_x, const uint16_t *W, int64_t out, int64_t in,
              uint16_t *y, int64_t ld_y, int64_t T, int num_threads) {
#ifdef __AVX512BF16__
    if (T < 1 || T > 4 || in % 32 != 0 || out % 16 != 0) return NATIVE_DECLINED;
    int64_t blocks = out / 16;
#pragma omp parallel for num_threads(threads_for(out * in, num_threads)) schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
        const uint16_t *w = W + blk * 16 * in; /* rows o0 .. o0 + 16 */
        for (int64_t t = 0; t < T; t++) {
            const uint16_t *xt = x + t * ld_x;
            __m512 part[16];
            for (int j = 0; j < 16; j++) { /* the block's rows in order: one stream */
                __m512 acc = _mm512_setzero_ps();
                for (int64_t c = 0; c < in; c += 32)
                    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w + j * in + c),
                                           (__m512bh)_mm512_loadu_si512(xt + c));
                if (t == 0 && blk + 1 < blocks) prefetch_l2(w + (16 + j) * in, in * 2);
                part[TRANSPOSED(j)] = acc;
            }
            store16(y, 1, t * ld_y + blk * 16, reduce16(part));
        }
    }
    return 0;
#else
    (void)x, (void)ld_x, (void)W, (void)out, (void)in, (void)y, (void)ld_y, (void)T;
    (void)num_threads;
    return NATIVE_DECLINED;
#endif
}

/* gemv_f32: y[t, o] = sum_i x[t, i] * W[o, i] in float32 for t < T (1-4), o < out; x [T, in]
 * (row stride ld_x), W [out, in] contiguous, y [T, out] (row stride ld_y); 16 | in, 16 | out.
 * Returns NATIVE_DECLINED where the shapes or the CPU do not suit it (nothing written): the
 * caller takes oneDNN's path. Each W row is read once for all T rows, in order (one stream per
 * thread), two partial sums per row so that the FMA chain's latency does not bound the read. */
int gemv_f32(const float *x, int64_t ld_x, const float *W, int64_t out, int64_t in, float *y,
             int64_t ld_y, int64_t T, int num_threads) {
#ifdef __AVX512F__
    if (T < 1 || T > 4 || in % 16 != 0 || out % 16 != 0) return NATIVE_DECLINED;
    int64_t blocks = out / 16;
#pragma omp parallel for num_threads(threads_for(out * in, num_threads)) schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
        const float *w = W + blk * 16 * in; /* rows o0 .. o0 + 16 */
        __m512 part[4][16];
        for (int j = 0; j < 16; j++) {
            const float *wj = w + j * in;
            __m512 even[4], odd[4];
            for (int64_t t = 0; t < T; t++) even[t] = odd[t] = _mm512_setzero_ps();
            int64_t c = 0;
            for (; c + 32 <= in; c += 32) {
                __m512 w0 = _mm512_loadu_ps(wj + c), w1 = _mm512_loadu_ps(wj + c + 16);
                for (int64_t t = 0; t < T; t++) {
                    even[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + t * ld_x + c), even[t]);
                    odd[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + t * ld_x + c + 16), odd[t]);
                }
            }
            if (c < in) { /* in % 32 == 16: the last 16 columns */
                __m512 w0 = _mm512_loadu_ps(wj + c);
                for (int64_t t = 0; t < T; t++)
                    even[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + t * ld_x + c), even[t]);
            }
            if (blk + 1 < blocks) prefetch_l2(wj + 16 * in, in * 4);
            for (int64_t t = 0; t < T; t++) part[t][TRANSPOSED(j)] = _mm512_add_ps(even[t], odd[t]);
        }
        for (int64_t t = 0; t < T; t++) store16(y, 0, t * ld_y + blk * 16, reduce16(part[t]));
    }
    return 0;
#else
    (void)x, (void)ld_x, (void)W, (void)out, (void)in, (void)y, (void)ld_y, (void)T;
    (void)num_threads;
    return NATIVE_DECLINED;
#endif
}
