/* lora.c's `lora_runs` as its callers see it: the LoRA library's own entry and the engine's
 * one-call decode step (server/native/csrc/decode_layer.c), which reaches it through its address
 * (the two are separate libraries). On the include path of every native build
 * (`native_build.COMMON_HEADERS`), so that both compile against one struct and one signature. */
#ifndef TOPPINGS_LORA_RUNS_H
#define TOPPINGS_LORA_RUNS_H
#include <stdint.h>

/* One projection of a `lora_runs` call: A [pool_rows, H_in] and Bt [pool_rows, H_out] rows, y
 * [T, H_out] (row stride ld_y) added into, ranks [num_runs] of each run in this projection. */
typedef struct {
    const void *A, *Bt;
    void *y;
    const int32_t *ranks; /* [num_runs] */
    int64_t ld_y, H_out, pool_rows;
} LoraProj;

int lora_runs(const void *x, int64_t ld_x, int64_t H_in, int64_t num_tokens,
              const LoraProj *proj, int64_t num_proj, const int32_t *starts,
              const int32_t *offsets, const float *scales, int64_t num_runs, int is_bf16,
              int num_threads);
typedef int (*lora_runs_fn)(const void *x, int64_t ld_x, int64_t H_in, int64_t num_tokens,
                            const LoraProj *proj, int64_t num_proj, const int32_t *starts,
                            const int32_t *offsets, const float *scales, int64_t num_runs,
                            int is_bf16, int num_threads);

/* lora_parts.c's split of a decode step's LoRA between a GEMV's threads (see there). */
typedef int (*lora_shrink_part_fn)(const void *x, int64_t ld_x, int64_t H_in, int64_t num_tokens,
                                   const LoraProj *proj, int64_t num_proj, const int32_t *starts,
                                   const int32_t *offsets, const float *scales, int64_t num_runs,
                                   int is_bf16, int64_t max_rank, float *h, float *xf, int part,
                                   int parts);
typedef void (*lora_expand_part_fn)(const LoraProj *proj, int64_t num_proj, const int64_t *c0,
                                    const int64_t *c1, const int32_t *starts,
                                    const int32_t *offsets, int64_t num_runs, int is_bf16,
                                    int64_t max_rank, const float *h, uint32_t *hp);

#endif
