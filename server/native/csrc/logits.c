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
