/* A decode step's LoRA shared between the threads that run its projection's GEMV
 * (server/native/csrc/decode_proj.c's `proj_lora`), one part per thread, in the GEMV's own
 * OpenMP region:
 *
 *     thread k:  y[:, cols_k] = x @ W[cols_k].T         (the GEMV's rows, its part)
 *                lora_shrink_part(k)                     (its share of the A rows -> h)
 *                barrier
 *                lora_expand_part(cols_k)                (y[:, cols_k] += h @ Bt[:, cols_k])
 *
 * `lora_runs` gives a step of one or two tokens to one thread, since its work is small beside a
 * fork: it then reads every A and Bt row on one core, at what one core streams, while the other
 * waits for the next GEMV. Here both read, in the fork the GEMV pays anyway, and each thread
 * adds the expansion into the columns its GEMV has just written. The arithmetic is lora_runs':
 * every h row and every output column is summed in the same order (lora_vec.h), so the result is
 * bit for bit the same.
 *
 * Runs (`lora_runs`' starts, offsets, scales, each projection's ranks) are cut into blocks of up
 * to 4 tokens of one run, in order; h [blocks, num_proj, 4, max_rank] float32 holds each block's
 * [n, r] sums per projection, blocks <= num_tokens. Compiled only with AVX-512 (without it the
 * symbols are absent and the caller keeps `lora_runs`). */
#include "lora_api.h"
#include "common.h"
#include "lora_vec.h"

#ifdef __AVX512F__
/* Whether the runs lie inside the tokens and every projection's pool (lora_runs' check). */
static int runs_valid(const LoraProj *proj, int64_t num_proj, int64_t num_tokens,
                      const int32_t *starts, const int32_t *offsets, int64_t num_runs) {
    for (int64_t g = 0; g < num_runs; g++) {
        if (starts[g] < 0 || starts[g] > starts[g + 1] || starts[g + 1] > num_tokens) return 0;
        for (int64_t p = 0; p < num_proj; p++) {
            int32_t r = proj[p].ranks[g];
            if (r < 0 || (r > 0 && (offsets[g] < 0 || offsets[g] + r > proj[p].pool_rows)))
                return 0;
        }
    }
    return 1;
}

static inline int64_t run_rank(const LoraProj *proj, int64_t num_proj, int64_t g) {
    int64_t r = 0;
    for (int64_t p = 0; p < num_proj; p++) r = proj[p].ranks[g] > r ? proj[p].ranks[g] : r;
    return r;
}

/* Part `part` of `parts` of the shrinkage: of the items (block, row j, projection), in that
 * order (the projections' A rows side by side, as lora_runs reads them), an even contiguous
 * share; h as above. x [num_tokens, H_in] (row stride ld_x), 16 | H_in; xf: 4 * H_in floats of
 * scratch. xf NULL: only ask for the part's A rows (into L2), nothing computed: a caller does
 * so before its GEMV so that the rows, short reads that one at a time wait on DRAM's latency,
 * arrive while the GEMV streams. Returns NATIVE_OUT_OF_RANGE, nothing written, when a run lies
 * outside the tokens or a pool. */
int lora_shrink_part(const void *x, int64_t ld_x, int64_t H_in, int64_t num_tokens,
                     const LoraProj *proj, int64_t num_proj, const int32_t *starts,
                     const int32_t *offsets, const float *scales, int64_t num_runs,
                     int is_bf16, int64_t max_rank, float *h, float *xf, int part, int parts) {
    if (!runs_valid(proj, num_proj, num_tokens, starts, offsets, num_runs))
        return NATIVE_OUT_OF_RANGE;
    int64_t total = 0;
    for (int64_t g = 0; g < num_runs; g++)
        total += (starts[g + 1] - starts[g] + 3) / 4 * run_rank(proj, num_proj, g) * num_proj;
    int64_t lo = total * part / parts, hi = total * (part + 1) / parts, item = 0, b = 0;
    for (int64_t g = 0; g < num_runs && item < hi; g++) {
        int64_t r_max = run_rank(proj, num_proj, g);
        if (r_max == 0) continue;
        for (int64_t t = starts[g]; t < starts[g + 1] && item < hi; t += 4, b++) {
            int64_t n = starts[g + 1] - t < 4 ? starts[g + 1] - t : 4;
            if (item + r_max * num_proj <= lo) { /* none of this block is ours */
                item += r_max * num_proj;
                continue;
            }
            if (xf == NULL) {
                for (int64_t j = 0; j < r_max; j++)
                    for (int64_t p = 0; p < num_proj; p++, item++)
                        if (item >= lo && item < hi && j < proj[p].ranks[g])
                            prefetch_row(proj[p].A, H_in * (is_bf16 ? 2 : 4), offsets[g] + j);
                continue;
            }
            const uint16_t *rows[4];
            const uint16_t *const *xb = block_rows(x, ld_x, H_in, t, n, is_bf16, rows, xf);
            for (int64_t j = 0; j < r_max; j++)
                for (int64_t p = 0; p < num_proj; p++, item++) {
                    int64_t r = proj[p].ranks[g];
                    if (item < lo || item >= hi || j >= r) continue;
                    shrink_row(proj[p].A, H_in, offsets[g] + j, n, is_bf16, xb, xf, scales[g],
                               h + (b * num_proj + p) * 4 * max_rank, r, j);
                }
        }
    }
    return NATIVE_OK;
}

/* Columns c0[p] .. c1[p] of each projection p (16 | both; 32 | both in bfloat16 when 32 |
 * H_out): y_p[t] += h @ Bt_p rows of each block; h as lora_shrink_part left it, every part
 * done. hp: 2 * max_rank + 4 uint32 of scratch. */
void lora_expand_part(const LoraProj *proj, int64_t num_proj, const int64_t *c0,
                      const int64_t *c1, const int32_t *starts, const int32_t *offsets,
                      int64_t num_runs, int is_bf16, int64_t max_rank, const float *h,
                      uint32_t *hp) {
    int64_t b = 0;
    for (int64_t g = 0; g < num_runs; g++) {
        if (run_rank(proj, num_proj, g) == 0) continue;
        for (int64_t t = starts[g]; t < starts[g + 1]; t += 4, b++) {
            int64_t n = starts[g + 1] - t < 4 ? starts[g + 1] - t : 4;
            for (int64_t p = 0; p < num_proj; p++) {
                const LoraProj *q = proj + p;
                int64_t r = q->ranks[g];
                if (r == 0 || c0[p] >= c1[p]) continue;
                const float *hq = h + (b * num_proj + p) * 4 * max_rank;
#ifdef __AVX512BF16__
                if (is_bf16 && q->H_out % 32 == 0) {
                    lora_expand_bf16(q->y, q->ld_y, q->Bt, q->H_out, c0[p], c1[p], t, n,
                                     offsets[g], r, hq, hp);
                    continue;
                }
#endif
                lora_expand(q->y, q->ld_y, q->Bt, q->H_out, c0[p], c1[p], t, n, offsets[g], r,
                            is_bf16, hq);
            }
        }
    }
}
#endif
