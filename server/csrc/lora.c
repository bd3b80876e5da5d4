/* LoRA over runs of one adapter's tokens (MBGMV semantics; CPU prefill and decode steps).
 *
 * lora_runs: for each run g with ranks[g] > 0 and each token t in [starts[g], starts[g + 1]):
 *     h = A[off:off + r] @ x[t]                 (r = ranks[g], off = offsets[g])
 *     y[t] += scales[g] * (h @ Bt[off:off + r])
 * x [T, H_in] (row stride ld_x), y [T, H_out] (row stride ld_y) in place, A [C, H_in] and
 * Bt [C, H_out] contiguous pool rows (C = pool_rows); all float32 or all bfloat16 (float32
 * arithmetic, y rounded once). Each token is computed over its own adapter's rows only.
 * Returns 2, having written nothing, when a run lies outside y or the pool. */
#include "common.h"

#ifdef __AVX512F__
/* y[t + i] += h[i] @ Bt[off:off + r] for the n (<= 4) tokens of a block, h [n, r] float32. */
static inline void lora_expand(void *y, int64_t ld_y, const void *Bt, int64_t H_out, int64_t t,
                               int64_t n, int64_t off, int64_t r, int is_bf16, const float *h) {
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

#ifdef __AVX512F__
/* Tokens t .. t + n (n <= 4) of one run: h = A[off:off + r] @ x[t] for each, then
 * y[t] += scale * h @ Bt[off:off + r], each A and Bt row read once for the n tokens.
 * 16 | H_in and 16 | H_out; xf [4, H_in] and h [4, r] are the caller's scratch. */
static void lora_block(const void *x, int64_t ld_x, void *y, int64_t ld_y, const void *A,
                       const void *Bt, int64_t H_in, int64_t H_out, int64_t t, int64_t n,
                       int64_t off, int64_t r, float scale, int is_bf16, float *xf, float *h) {
#ifdef __AVX512BF16__
    if (is_bf16 && H_in % 32 == 0) { /* bf16 pairs multiplied and summed in float32 at once */
        const uint16_t *xb[4];
        for (int64_t i = 0; i < 4; i++) xb[i] = (const uint16_t *)x + (t + (i < n ? i : 0)) * ld_x;
        for (int64_t j = 0; j < r; j++) {
            __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
            const uint16_t *row = (const uint16_t *)A + (off + j) * H_in;
            for (int64_t c = 0; c < H_in; c += 32) {
                _mm_prefetch((const char *)(row + 2 * H_in + c), _MM_HINT_T0); /* 2 rows on */
                __m512bh a = (__m512bh)_mm512_loadu_si512(row + c);
                s0 = _mm512_dpbf16_ps(s0, a, (__m512bh)_mm512_loadu_si512(xb[0] + c));
                if (n > 1) s1 = _mm512_dpbf16_ps(s1, a, (__m512bh)_mm512_loadu_si512(xb[1] + c));
                if (n > 2) s2 = _mm512_dpbf16_ps(s2, a, (__m512bh)_mm512_loadu_si512(xb[2] + c));
                if (n > 3) s3 = _mm512_dpbf16_ps(s3, a, (__m512bh)_mm512_loadu_si512(xb[3] + c));
            }
            h[j] = _mm512_reduce_add_ps(s0) * scale;
            if (n > 1) h[r + j] = _mm512_reduce_add_ps(s1) * scale;
            if (n > 2) h[2 * r + j] = _mm512_reduce_add_ps(s2) * scale;
            if (n > 3) h[3 * r + j] = _mm512_reduce_add_ps(s3) * scale;
        }
        lora_expand(y, ld_y, Bt, H_out, t, n, off, r, is_bf16, h);
        return;
    }
#endif
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
    lora_expand(y, ld_y, Bt, H_out, t, n, off, r, is_bf16, h);
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
