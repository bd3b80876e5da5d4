/* LoRA over runs of one adapter's tokens (MBGMV semantics; CPU prefill and decode steps), for
 * every projection that reads the same input in one call (q, k and v share theirs).
 *
 * lora_runs: for each projection p, each run g with r = proj[p].ranks[g] > 0 and each token t
 * in [starts[g], starts[g + 1]):
 *     h = A_p[off:off + r] @ x[t]               (off = offsets[g])
 *     y_p[t] += scales[g] * (h @ Bt_p[off:off + r])
 * x [T, H_in] (row stride ld_x); per projection (LoraProj) y [T, H_out] (row stride ld_y) in
 * place, A [pool_rows, H_in] and Bt [pool_rows, H_out] contiguous; all float32 or all bfloat16
 * (float32 arithmetic, y rounded once). Each token is computed over its own adapter's rows only.
 * Returns 2, having written nothing, when a run lies outside y or a pool; 1 when out of memory.
 *
 * A decode step reads every resident adapter's rows from DRAM once (16 adapters of ranks 8-64
 * on SmolLM2's q/k/v: 2.6 MB a layer), so the kernel is bound by that stream: one OpenMP region
 * for all projections, work in blocks of 4 tokens of one run and projection, the expansion
 * rows prefetched into L2 while the shrinkage reads A (A itself is read in order and left to
 * the hardware prefetcher: prefetching it ahead in software was slower), and B read in
 * 64-column strips whose sums stay in registers. Measured on that decode step (30 layers, bf16,
 * 1 / 2 threads): 9.1 / 5.2 ms with one call per projection, 16-column strips and A prefetched
 * 2 rows ahead; 6.1 / 3.6 ms now. */
#include "common.h"

typedef struct {
    const void *A, *Bt;
    void *y;
    const int32_t *ranks; /* [num_runs] */
    int64_t ld_y, H_out, pool_rows;
} LoraProj;

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

/* y[t + i] += h[i] @ Bt[off:off + r] for the n (<= 4) tokens of a block, h [n, r] float32. */
static inline __attribute__((always_inline)) void expand_n(void *y, int64_t ld_y, const void *Bt,
                                                            int64_t H_out, int64_t t, int n,
                                                            int64_t off, int64_t r, int is_bf16,
                                                            const float *h) {
    int64_t c = 0;
    for (; c + 64 <= H_out; c += 64)
        expand_strip(y, ld_y, Bt, H_out, t, n, 4, c, off, r, is_bf16, h);
    switch ((H_out - c) / 16) {
    case 3: expand_strip(y, ld_y, Bt, H_out, t, n, 3, c, off, r, is_bf16, h); break;
    case 2: expand_strip(y, ld_y, Bt, H_out, t, n, 2, c, off, r, is_bf16, h); break;
    case 1: expand_strip(y, ld_y, Bt, H_out, t, n, 1, c, off, r, is_bf16, h); break;
    }
}

static void lora_expand(void *y, int64_t ld_y, const void *Bt, int64_t H_out, int64_t t,
                        int64_t n, int64_t off, int64_t r, int is_bf16, const float *h) {
    switch (n) {
    case 1: expand_n(y, ld_y, Bt, H_out, t, 1, off, r, is_bf16, h); break;
    case 2: expand_n(y, ld_y, Bt, H_out, t, 2, off, r, is_bf16, h); break;
    case 3: expand_n(y, ld_y, Bt, H_out, t, 3, off, r, is_bf16, h); break;
    default: expand_n(y, ld_y, Bt, H_out, t, 4, off, r, is_bf16, h); break;
    }
}

/* Bt row j of the block into L2 (its expansion follows the shrinkage). */
static inline void prefetch_row(const void *Bt, int64_t row_bytes, int64_t j) {
    const char *p = (const char *)Bt + j * row_bytes;
    for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

/* Tokens t .. t + n (n <= 4) of one run: h = A[off:off + r] @ x[t] for each, then
 * y[t] += scale * h @ Bt[off:off + r], each A and Bt row read once for the n tokens.
 * 16 | H_in and 16 | H_out; xf [4, H_in] and h [4, r] are the caller's scratch. */
static void lora_block(const void *x, int64_t ld_x, const LoraProj *p, int64_t H_in, int64_t t,
                       int64_t n, int64_t off, int64_t r, float scale, int is_bf16, float *xf,
                       float *h) {
    int64_t b_row = p->H_out * (is_bf16 ? 2 : 4);
    const char *b0 = (const char *)p->Bt + off * b_row;
#ifdef __AVX512BF16__
    if (is_bf16 && H_in % 32 == 0) { /* bf16 pairs multiplied and summed in float32 at once */
        const uint16_t *xb[4];
        for (int64_t i = 0; i < 4; i++) xb[i] = (const uint16_t *)x + (t + (i < n ? i : 0)) * ld_x;
        for (int64_t j = 0; j < r; j++) {
            __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
            const uint16_t *row = (const uint16_t *)p->A + (off + j) * H_in;
            prefetch_row(b0, b_row, j);
            for (int64_t c = 0; c < H_in; c += 32) {
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
        lora_expand(p->y, p->ld_y, p->Bt, p->H_out, t, n, off, r, is_bf16, h);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++)
        for (int64_t c = 0; c < H_in; c += 16)
            _mm512_storeu_ps(xf + i * H_in + c, load16(x, is_bf16, (t + i) * ld_x + c));
    for (int64_t j = 0; j < r; j++) {
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        int64_t row = (off + j) * H_in;
        prefetch_row(b0, b_row, j);
        for (int64_t c = 0; c < H_in; c += 16) {
            __m512 a = load16(p->A, is_bf16, row + c);
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
    lora_expand(p->y, p->ld_y, p->Bt, p->H_out, t, n, off, r, is_bf16, h);
}
#endif

/* One token of one run, any H: the scalar path. xf [H_in], acc [H_out], h [r] scratch. */
static void lora_token(const void *x, int64_t ld_x, const LoraProj *p, int64_t H_in, int64_t t,
                       int64_t off, int64_t r, float scale, int is_bf16, float *xf, float *acc,
                       float *h) {
    int64_t H_out = p->H_out;
    for (int64_t i = 0; i < H_in; i++) xf[i] = ld(x, is_bf16, t * ld_x + i);
    for (int64_t j = 0; j < r; j++) {
        float s = 0.f;
        if (is_bf16) {
            const uint16_t *a = (const uint16_t *)p->A + (off + j) * H_in;
#pragma omp simd reduction(+ : s)
            for (int64_t i = 0; i < H_in; i++) s += xf[i] * bf16_load(a[i]);
        } else {
            const float *a = (const float *)p->A + (off + j) * H_in;
#pragma omp simd reduction(+ : s)
            for (int64_t i = 0; i < H_in; i++) s += xf[i] * a[i];
        }
        h[j] = s * scale;
    }
    for (int64_t o = 0; o < H_out; o++) acc[o] = 0.f;
    for (int64_t j = 0; j < r; j++) {
        float hj = h[j];
        if (is_bf16) {
            const uint16_t *b = (const uint16_t *)p->Bt + (off + j) * H_out;
#pragma omp simd
            for (int64_t o = 0; o < H_out; o++) acc[o] += hj * bf16_load(b[o]);
        } else {
            const float *b = (const float *)p->Bt + (off + j) * H_out;
#pragma omp simd
            for (int64_t o = 0; o < H_out; o++) acc[o] += hj * b[o];
        }
    }
    for (int64_t o = 0; o < H_out; o++)
        st(p->y, is_bf16, t * p->ld_y + o, ld(p->y, is_bf16, t * p->ld_y + o) + acc[o]);
}

int lora_runs(const void *x, int64_t ld_x, int64_t H_in, int64_t num_tokens,
              const LoraProj *proj, int64_t num_proj, const int32_t *starts,
              const int32_t *offsets, const float *scales, int64_t num_runs, int is_bf16,
              int num_threads) {
    int64_t max_rank = 0, max_out = 0, work = 0, tokens = starts[num_runs] - starts[0];
    int vector = H_in % 16 == 0, failed = 0;
    for (int64_t g = 0; g < num_runs; g++) /* 2: arguments outside the tensors, nothing done */
        if (starts[g] < 0 || starts[g] > starts[g + 1] || starts[g + 1] > num_tokens) return 2;
    for (int64_t p = 0; p < num_proj; p++) {
        const int32_t *ranks = proj[p].ranks;
        for (int64_t g = 0; g < num_runs; g++) {
            if (ranks[g] < 0 || (ranks[g] > 0 && (offsets[g] < 0 ||
                                                  offsets[g] + ranks[g] > proj[p].pool_rows)))
                return 2;
            max_rank = ranks[g] > max_rank ? ranks[g] : max_rank;
        }
        max_out = proj[p].H_out > max_out ? proj[p].H_out : max_out;
        vector &= proj[p].H_out % 16 == 0;
        work += tokens * (H_in + proj[p].H_out);
    }
#ifndef __AVX512F__
    vector = 0;
#endif
    /* items[k]: the work items (4-token blocks, or tokens on the scalar path) of the (projection,
     * run) pairs before k = p * num_runs + g that have an adapter (rank > 0). */
    int64_t num_pairs = num_proj * num_runs, per = vector ? 4 : 1;
    int64_t *items = malloc(sizeof(int64_t) * (size_t)(num_pairs + 1));
    if (items == NULL) return 1;
    items[0] = 0;
    for (int64_t k = 0; k < num_pairs; k++) {
        int64_t g = k % num_runs, n = starts[g + 1] - starts[g];
        items[k + 1] = items[k] + (proj[k / num_runs].ranks[g] > 0 ? (n + per - 1) / per : 0);
    }
#pragma omp parallel num_threads(threads_for(work * max_rank, num_threads)) reduction(| : failed)
    {
        float *buf = malloc(sizeof(float) * (size_t)(4 * H_in + max_out + 4 * max_rank + 1));
        if (buf == NULL) {
            failed = 1;
        } else {
            float *xf = buf, *acc = buf + 4 * H_in, *h = acc + max_out;
#pragma omp for schedule(dynamic, 1)
            for (int64_t w = 0; w < items[num_pairs]; w++) {
                int64_t lo = 0, hi = num_pairs; /* the pair k with items[k] <= w < items[k + 1] */
                while (hi - lo > 1) {
                    int64_t mid = (lo + hi) / 2;
                    if (items[mid] <= w) lo = mid; else hi = mid;
                }
                const LoraProj *p = proj + lo / num_runs;
                int64_t g = lo % num_runs, t = starts[g] + per * (w - items[lo]);
                int64_t n = starts[g + 1] - t < per ? starts[g + 1] - t : per;
#ifdef __AVX512F__
                if (vector) {
                    lora_block(x, ld_x, p, H_in, t, n, offsets[g], p->ranks[g], scales[g],
                               is_bf16, xf, h);
                    continue;
                }
#endif
                lora_token(x, ld_x, p, H_in, t, offsets[g], p->ranks[g], scales[g], is_bf16, xf,
                           acc, h);
            }
            free(buf);
        }
    }
    free(items);
    return failed;
}
