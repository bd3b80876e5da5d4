/* LoRA over runs of one adapter's tokens (MBGMV semantics; CPU prefill and decode steps), for
 * every projection that reads the same input in one call (q, k and v share theirs).
 *
 * lora_runs: for each projection p, each run g with r = proj[p].ranks[g] > 0 and each token t
 * in [starts[g], starts[g + 1]):
 *     h = A_p[off:off + r] @ x[t]               (off = offsets[g])
 *     y_p[t] += scales[g] * (h @ Bt_p[off:off + r])
 * x [T, H_in] (row stride ld_x); per projection (LoraProj) y [T, H_out] (row stride ld_y) in
 * place, A [pool_rows, H_in] and Bt [pool_rows, H_out] contiguous; all float32 or all bfloat16.
 * Arithmetic in float32, y rounded once; in bfloat16 with avx512_bf16 and 32 | H_out, h is
 * rounded to bfloat16 before the expansion, as PEFT's bf16 LoRA rounds its A output. Each token
 * is computed over its own adapter's rows only. Returns NATIVE_OUT_OF_RANGE, having written
 * nothing, when a run lies outside y or a pool; NATIVE_NO_MEMORY.
 *
 * A decode step reads every resident adapter's rows from DRAM once, and the reads, not the
 * arithmetic, set its time: one OpenMP region for all projections; work items of 4 tokens of
 * one run covering every projection, whose A rows are read side by side (several streams in
 * flight), largest ranks first so that the threads end together; the expansion rows prefetched
 * into L2 while the shrinkage reads A (prefetching A itself in software was slower); B read in
 * strips whose sums stay in registers (docs/benchmarks.md has the kernel's timings). */
#include "lora_api.h"
#include "common.h"
#include "lora_vec.h"

#ifdef __AVX512F__
/* Tokens t .. t + n (n <= 4) of run g, every projection p with r = ranks[g] > 0:
 * h_p = A_p[off:off + r] @ x[t] for each token, then y_p[t] += scale * h_p @ Bt_p[off:off + r],
 * each A and Bt row read once for the n tokens. The projections' A rows are read side by side
 * (row j of each in turn): several streams keep more memory reads in flight than one, and a
 * decode step's rows all come from DRAM. 16 | H_in and 16 | H_out; scratch: xf [4, H_in],
 * h [num_proj, 4, max_rank], hp [4, (max_rank + 1) / 2]. */
static void lora_block(const void *x, int64_t ld_x, const LoraProj *proj, int64_t num_proj,
                       int64_t H_in, int64_t t, int64_t n, int64_t g, int64_t off, float scale,
                       int64_t max_rank, int is_bf16, float *xf, float *h, uint32_t *hp) {
    const uint16_t *rows[4];
    const uint16_t *const *xb = block_rows(x, ld_x, H_in, t, n, is_bf16, rows, xf);
    int64_t r_max = 0;
    for (int64_t p = 0; p < num_proj; p++)
        r_max = proj[p].ranks[g] > r_max ? proj[p].ranks[g] : r_max;
    for (int64_t j = 0; j < r_max; j++)
        for (int64_t p = 0; p < num_proj; p++) {
            int64_t r = proj[p].ranks[g];
            if (j >= r) continue;
            int64_t b_row = proj[p].H_out * (is_bf16 ? 2 : 4);
            prefetch_row((const char *)proj[p].Bt + off * b_row, b_row, j);
            shrink_row(proj[p].A, H_in, off + j, n, is_bf16, xb, xf, scale,
                       h + p * 4 * max_rank, r, j);
        }
    for (int64_t p = 0; p < num_proj; p++) {
        const LoraProj *q = proj + p;
        int64_t r = q->ranks[g];
        if (r <= 0) continue;
        float *hq = h + p * 4 * max_rank;
#ifdef __AVX512BF16__
        if (is_bf16 && q->H_out % 32 == 0) {
            lora_expand_bf16(q->y, q->ld_y, q->Bt, q->H_out, 0, q->H_out, t, n, off, r, hq,
                             hp);
            continue;
        }
#endif
        lora_expand(q->y, q->ld_y, q->Bt, q->H_out, 0, q->H_out, t, n, off, r, is_bf16, hq);
    }
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

/* The largest rank of pair k (see lora_runs: a run when grouped, else a projection's run). */
static inline int64_t pair_rank(const LoraProj *proj, int64_t num_proj, int64_t num_runs,
                                int vector, int64_t k) {
    int64_t r = 0;
    if (!vector) return proj[k / num_runs].ranks[k % num_runs];
    for (int64_t p = 0; p < num_proj; p++) r = proj[p].ranks[k] > r ? proj[p].ranks[k] : r;
    return r;
}

int lora_runs(const void *x, int64_t ld_x, int64_t H_in, int64_t num_tokens,
              const LoraProj *proj, int64_t num_proj, const int32_t *starts,
              const int32_t *offsets, const float *scales, int64_t num_runs, int is_bf16,
              int num_threads) {
    int64_t max_rank = 0, max_out = 0, work = 0, tokens = starts[num_runs] - starts[0];
    int vector = H_in % 16 == 0, failed = NATIVE_OK;
    for (int64_t g = 0; g < num_runs; g++) /* nothing done */
        if (starts[g] < 0 || starts[g] > starts[g + 1] || starts[g + 1] > num_tokens)
            return NATIVE_OUT_OF_RANGE;
    for (int64_t p = 0; p < num_proj; p++) {
        const int32_t *ranks = proj[p].ranks;
        for (int64_t g = 0; g < num_runs; g++) {
            if (ranks[g] < 0 || (ranks[g] > 0 && (offsets[g] < 0 ||
                                                  offsets[g] + ranks[g] > proj[p].pool_rows)))
                return NATIVE_OUT_OF_RANGE;
            max_rank = ranks[g] > max_rank ? ranks[g] : max_rank;
        }
        max_out = proj[p].H_out > max_out ? proj[p].H_out : max_out;
        vector &= proj[p].H_out % 16 == 0;
        work += tokens * (H_in + proj[p].H_out);
    }
#ifndef __AVX512F__
    vector = 0;
#endif
    /* Pairs: on the vector path run k, an item 4 of its tokens for every projection; on the
     * scalar path k = p * num_runs + g, an item one token of run g in projection p. When the
     * vector path has fewer items than threads (a decode step of one or two requests), its
     * items are split by projection as the scalar path's are (`split`), so that the threads
     * share them: each projection's arithmetic is the same either way.
     * items[k]: the work items before the k-th pair of order that have an adapter (rank > 0). */
    int split = 0;
    if (vector && num_proj > 1) {
        int64_t blocks = 0;
        for (int64_t g = 0; g < num_runs; g++)
            if (pair_rank(proj, num_proj, num_runs, 1, g) > 0)
                blocks += (starts[g + 1] - starts[g] + 3) / 4;
        split = blocks < num_threads;
    }
    int grouped = vector && !split; /* a pair covers every projection */
    int64_t per = vector ? 4 : 1, num_pairs = grouped ? num_runs : num_proj * num_runs;
    int64_t *items = malloc(sizeof(int64_t) * (size_t)(3 * num_pairs + 1));
    if (items == NULL) return NATIVE_NO_MEMORY;
    int64_t *order = items + num_pairs + 1, *rank = order + num_pairs;
    /* order: the pairs by decreasing largest rank, so that the threads end on small items */
    for (int64_t k = 0; k < num_pairs; k++) {
        int64_t at = k;
        rank[k] = pair_rank(proj, num_proj, num_runs, grouped, k);
        for (; at > 0 && rank[order[at - 1]] < rank[k]; at--) order[at] = order[at - 1];
        order[at] = k;
    }
    items[0] = 0;
    for (int64_t k = 0; k < num_pairs; k++) {
        int64_t g = order[k] % num_runs, n = starts[g + 1] - starts[g];
        items[k + 1] = items[k] + (rank[order[k]] > 0 ? (n + per - 1) / per : 0);
    }
    int threads = threads_for(work * max_rank, num_threads);
    if (threads > items[num_pairs]) threads = items[num_pairs] > 1 ? (int)items[num_pairs] : 1;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        size_t floats = 4 * H_in + max_out + 4 * num_proj * max_rank + 2 * max_rank + 4;
        float *buf = malloc(sizeof(float) * floats);
        if (buf == NULL) {
            failed = NATIVE_NO_MEMORY;
        } else {
            float *xf = buf, *acc = buf + 4 * H_in, *h = acc + max_out;
            uint32_t *hp = (uint32_t *)(h + 4 * num_proj * max_rank);
#pragma omp for schedule(dynamic, 1)
            for (int64_t w = 0; w < items[num_pairs]; w++) {
                int64_t lo = 0, hi = num_pairs; /* the pair k with items[k] <= w < items[k + 1] */
                while (hi - lo > 1) {
                    int64_t mid = (lo + hi) / 2;
                    if (items[mid] <= w) lo = mid; else hi = mid;
                }
                int64_t pair = order[lo], g = pair % num_runs;
                int64_t t = starts[g] + per * (w - items[lo]);
                int64_t n = starts[g + 1] - t < per ? starts[g + 1] - t : per;
#ifdef __AVX512F__
                if (vector) {
                    const LoraProj *first = grouped ? proj : proj + pair / num_runs;
                    lora_block(x, ld_x, first, grouped ? num_proj : 1, H_in, t, n, g, offsets[g],
                               scales[g], max_rank, is_bf16, xf, h, hp);
                    continue;
                }
#endif
                const LoraProj *p = proj + pair / num_runs;
                lora_token(x, ld_x, p, H_in, t, offsets[g], p->ranks[g], scales[g], is_bf16, xf,
                           acc, h);
            }
            free(buf);
        }
    }
    free(items);
    return failed;
}
