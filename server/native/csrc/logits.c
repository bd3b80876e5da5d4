/* One pass over a step's logits before sampling (server/engine/logits_scan.py): whether each
 * row is finite, and its greedy token.
 *
 * Semantics:
 *     for b in range(B):
 *         finite[b] = all(isfinite(logits[b, :V]))
 *         argmax[b] = the first v with logits[b, v] == max(logits[b, :V])   (torch.argmax)
 *
 * A row that is not finite gets argmax -1 (its request fails: model_runner.py). logits float32
 * [B, V], row stride ld. Rows are shared between threads when there are many. */
#include "native_api.h"
#include "common.h"

#if defined(__AVX512F__)
static void scan_row(const float *row, int64_t V, uint8_t *finite, int64_t *argmax) {
    __m512 best = _mm512_set1_ps(-INFINITY), zero = _mm512_setzero_ps();
    __m512i best_at = _mm512_setzero_si512(), at = _mm512_setr_epi32(
        0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __mmask16 ok = 0xFFFF;
    for (int64_t v = 0; v < V; v += 16, at = _mm512_add_epi32(at, _mm512_set1_epi32(16))) {
        __mmask16 in = V - v >= 16 ? 0xFFFF : (__mmask16)((1u << (V - v)) - 1);
        __m512 x = _mm512_mask_loadu_ps(zero, in, row + v);
        ok &= _mm512_cmp_ps_mask(_mm512_sub_ps(x, x), zero, _CMP_EQ_OQ); /* inf - inf: NaN */
        __mmask16 gt = _mm512_mask_cmp_ps_mask(in, x, best, _CMP_GT_OQ); /* strict: the first */
        best = _mm512_mask_blend_ps(gt, best, x);
        best_at = _mm512_mask_blend_epi32(gt, best_at, at);
    }
    float top = _mm512_reduce_max_ps(best);
    __mmask16 tops = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
    int64_t first = _mm512_mask_reduce_min_epi32(tops, best_at);
    *finite = ok == 0xFFFF;
    *argmax = *finite ? first : -1; /* a finite row's maximum is one of its entries */
}
#elif defined(__AVX2__)
static void scan_row(const float *row, int64_t V, uint8_t *finite, int64_t *argmax) {
    __m256 best = _mm256_set1_ps(-INFINITY), zero = _mm256_setzero_ps();
    __m256i best_at = _mm256_setzero_si256(), at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    int64_t v = 0;
    for (; v + 8 <= V; v += 8, at = _mm256_add_epi32(at, _mm256_set1_epi32(8))) {
        __m256 x = _mm256_loadu_ps(row + v);
        ok = _mm256_and_ps(ok, _mm256_cmp_ps(_mm256_sub_ps(x, x), zero, _CMP_EQ_OQ));
        __m256 gt = _mm256_cmp_ps(x, best, _CMP_GT_OQ); /* strict: the first */
        best = _mm256_blendv_ps(best, x, gt);
        best_at = _mm256_castps_si256(
            _mm256_blendv_ps(_mm256_castsi256_ps(best_at), _mm256_castsi256_ps(at), gt));
    }
    float lanes[8], top = -INFINITY;
    int32_t lane_at[8];
    int64_t first = 0, all = _mm256_movemask_ps(ok) == 0xFF;
    _mm256_storeu_ps(lanes, best);
    _mm256_storeu_si256((__m256i *)lane_at, best_at);
    for (int i = 0; i < 8; i++) /* the lanes' maxima, then the tail, in index order */
        if (lanes[i] > top || (lanes[i] == top && lane_at[i] < first))
            top = lanes[i], first = lane_at[i];
    for (; v < V; v++) {
        all &= (row[v] - row[v]) == 0.0f;
        if (row[v] > top) top = row[v], first = v;
    }
    *finite = (uint8_t)all;
    *argmax = all ? first : -1;
}
#else
static void scan_row(const float *row, int64_t V, uint8_t *finite, int64_t *argmax) {
    float top = -INFINITY;
    int64_t first = 0, ok = 1;
    for (int64_t v = 0; v < V; v++) {
        float x = row[v];
        ok &= (x - x) == 0.0f;
        if (x > top) top = x, first = v;
    }
    *finite = (uint8_t)ok;
    *argmax = ok ? first : -1;
}
#endif

int logits_scan(const float *logits, int64_t ld, int64_t B, int64_t V, uint8_t *finite,
                int64_t *argmax, int num_threads) {
    if (B < 0 || V < 1 || ld < V) return NATIVE_DECLINED;
#pragma omp parallel for num_threads(threads_for(B * V, num_threads)) schedule(static)
    for (int64_t b = 0; b < B; b++) scan_row(logits + b * ld, V, finite + b, argmax + b);
    return 0;
}

/* Each row's log-softmax value of one token, its rank and its top k, in two reads of the row
 * (server/sampling/logits.py; torch writes the row's log-softmax and reads it three times).
 *
 * Semantics, for b in range(R), x = logits[b, :V], t = ids[b]:
 *     m = max(x); s = log(sum(exp(x - m)))               (torch.log_softmax: x - m - s)
 *     own[b] = x[t] - m - s
 *     rank[b] = 1 + count(x > x[t])                      (log-softmax is monotone)
 *     top_ids[b, :k] = the k largest of x, descending, equal ones by index (the first first)
 *     top_lp[b, :k] = x[top_ids[b]] - m - s
 * 0 <= k <= min(V, LOGPROBS_TOP_MAX), 0 <= t < V (else declined, nothing written). A row with
 * NaN gets values that mean nothing but every output written. */

#define LOGPROBS_TOP_MAX 64 /* the most top entries a row (more: declined, torch's path) */

/* x at index `at` into the descending top list tv/ti of n of k entries (full: x > tv[k - 1]) */
static inline void top_insert(float *tv, int64_t *ti, int k, int *n, float x, int64_t at) {
    int i = *n < k ? (*n)++ : k - 1;
    for (; i > 0 && !(tv[i - 1] >= x); i--) tv[i] = tv[i - 1], ti[i] = ti[i - 1];
    tv[i] = x, ti[i] = at;
}

/* The first pass over row x: its maximum, how many entries are above `own`, its top k */
static void first_pass(const float *x, int64_t V, float own, int k, float *tv, int64_t *ti,
                       float *max_out, int64_t *above_out) {
    float mx = -INFINITY;
    int64_t above = 0, v = 0;
    int n = 0;
    for (; v < k; v++) { /* the first k fill the list */
        top_insert(tv, ti, k, &n, x[v], v);
        mx = x[v] > mx ? x[v] : mx;
        above += x[v] > own;
    }
    float th = k > 0 ? tv[k - 1] : INFINITY; /* what enters the list from here on */
#if defined(__AVX512F__)
    __m512 vmax = _mm512_set1_ps(mx), vown = _mm512_set1_ps(own);
    for (; v < V; v += 16) {
        __mmask16 in = V - v >= 16 ? 0xFFFF : (__mmask16)((1u << (V - v)) - 1);
        __m512 xs = _mm512_maskz_loadu_ps(in, x + v);
        vmax = _mm512_mask_max_ps(vmax, in, vmax, xs);
        above += __builtin_popcount(_mm512_mask_cmp_ps_mask(in, xs, vown, _CMP_GT_OQ));
        unsigned hi = _mm512_mask_cmp_ps_mask(in, xs, _mm512_set1_ps(th), _CMP_GT_OQ);
        for (; hi; hi &= hi - 1) {
            int64_t at = v + __builtin_ctz(hi);
            if (x[at] > th) top_insert(tv, ti, k, &n, x[at], at), th = tv[k - 1];
        }
    }
    mx = _mm512_reduce_max_ps(vmax);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 vmax = _mm256_set1_ps(mx), vown = _mm256_set1_ps(own);
    for (; v + 8 <= V; v += 8) {
        __m256 xs = _mm256_loadu_ps(x + v);
        vmax = _mm256_max_ps(vmax, xs);
        above += __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(xs, vown, _CMP_GT_OQ)));
        unsigned hi = _mm256_movemask_ps(_mm256_cmp_ps(xs, _mm256_set1_ps(th), _CMP_GT_OQ));
        for (; hi; hi &= hi - 1) {
            int64_t at = v + __builtin_ctz(hi);
            if (x[at] > th) top_insert(tv, ti, k, &n, x[at], at), th = tv[k - 1];
        }
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, vmax);
    for (int i = 0; i < 8; i++) mx = lanes[i] > mx ? lanes[i] : mx;
#endif
    for (; v < V; v++) { /* the tail, or every entry without AVX */
        mx = x[v] > mx ? x[v] : mx;
        above += x[v] > own;
        if (x[v] > th) top_insert(tv, ti, k, &n, x[v], v), th = tv[k - 1];
    }
    *max_out = mx, *above_out = above;
}

/* log(sum(exp(x - mx))) over row x: float sums of blocks of EXP_BLOCK entries (a few terms a
 * lane), their total in double, so that 128k terms sum to about float's rounding */
#define EXP_BLOCK 256
static float log_sum_exp(const float *x, int64_t V, float mx) {
    double total = 0.0;
    for (int64_t v = 0; v < V;) {
        int64_t end = V - v > EXP_BLOCK ? v + EXP_BLOCK : V;
        float sum = 0.f;
#if defined(__AVX512F__)
        __m512 acc = _mm512_setzero_ps(), vmx = _mm512_set1_ps(mx);
        for (; v < end; v += 16) {
            __mmask16 in = end - v >= 16 ? 0xFFFF : (__mmask16)((1u << (end - v)) - 1);
            __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, x + v), vmx));
            acc = _mm512_mask_add_ps(acc, in, acc, e);
        }
        sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
        __m256 acc = _mm256_setzero_ps(), vmx = _mm256_set1_ps(mx);
        for (; v + 8 <= end; v += 8)
            acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + v), vmx)));
        float lanes[8];
        _mm256_storeu_ps(lanes, acc);
        for (int i = 0; i < 8; i++) sum += lanes[i];
#endif
        for (; v < end; v++) sum += expf(x[v] - mx);
        total += sum;
    }
    return (float)log(total);
}

int logits_logprobs(const float *logits, int64_t ld, int64_t R, int64_t V, const int64_t *ids,
                    int k, float *own, int64_t *rank, int64_t *top_ids, float *top_lp,
                    int num_threads) {
    if (R < 0 || V < 1 || ld < V || k < 0 || k > LOGPROBS_TOP_MAX || k > V)
        return NATIVE_DECLINED;
    for (int64_t b = 0; b < R; b++)
        if (ids[b] < 0 || ids[b] >= V) return NATIVE_DECLINED;
#pragma omp parallel for num_threads(threads_for(R * V, num_threads)) schedule(static)
    for (int64_t b = 0; b < R; b++) {
        const float *x = logits + b * ld;
        float tv[LOGPROBS_TOP_MAX], mx;
        int64_t above;
        first_pass(x, V, x[ids[b]], k, tv, top_ids + b * k, &mx, &above);
        float s = log_sum_exp(x, V, mx);
        own[b] = x[ids[b]] - mx - s;
        rank[b] = above + 1;
        for (int i = 0; i < k; i++) top_lp[b * k + i] = tv[i] - mx - s;
    }
    return 0;
}
