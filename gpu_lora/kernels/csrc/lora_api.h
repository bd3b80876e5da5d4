/* The LoRA library's whole interface (lora.c, lora_parts.c): every function it exports, the
 * struct its callers fill and the status every native function of the project returns.
 *
 * Every .c file of the library includes it, so the compiler checks each definition against the
 * declaration here (and refuses, with -Werror=missing-prototypes, an exported function declared
 * nowhere); the engine's interface (server/native/csrc/native_api.h) includes it too, since its
 * one-call decode step reaches these functions through their addresses. The Python side
 * (gpu_lora/kernels/native.py's SIGNATURES and LoraProj, native_build.Status) is compared with
 * this file by tests/gpu_lora/test_native_abi.py, which reads it with native_abi.py: keep to the
 * declarations that parser takes (typedef'd structs and enums, prototypes, function types). */
#ifndef TOPPINGS_LORA_API_H
#define TOPPINGS_LORA_API_H
#include <stdint.h>

/* What every native function returns (an int; native_build.Status on the Python side). */
typedef enum {
    NATIVE_OK = 0,
    NATIVE_DECLINED = 1,         /* the shapes, the build or the CPU do not suit: nothing written,
                                    the caller takes its torch path */
    NATIVE_OUT_OF_RANGE = 2,     /* an index (a LoRA run, a KV slot, a token id, a position) lies
                                    outside its table: nothing written */
    NATIVE_NO_MEMORY = 3,        /* a scratch buffer could not be allocated */
    NATIVE_DECLINED_MID_STEP = 4 /* decode_layers: a kernel declined after the step wrote h (not
                                    to be redone op by op) */
} NativeStatus;

/* One projection of a `lora_runs` call: A [pool_rows, H_in] and Bt [pool_rows, H_out] rows, y
 * [T, H_out] (row stride ld_y) added into, ranks [num_runs] of each run in this projection. */
typedef struct {
    const void *A, *Bt;
    void *y;
    const int32_t *ranks; /* [num_runs] */
    int64_t ld_y, H_out, pool_rows;
} LoraProj;

/* The functions are declared through their types, which the engine's decode step also holds
 * pointers of (`LoraStep`): one signature for both. */

/* lora.c: every run of every projection that reads x (see there). Returns NATIVE_OUT_OF_RANGE
 * when a run lies outside y or a pool, NATIVE_NO_MEMORY. */
typedef int lora_runs_fn(const void *x, int64_t ld_x, int64_t H_in, int64_t num_tokens,
                         const LoraProj *proj, int64_t num_proj, const int32_t *starts,
                         const int32_t *offsets, const float *scales, int64_t num_runs,
                         int is_bf16, int num_threads);
lora_runs_fn lora_runs;

/* lora_parts.c: a decode step's LoRA split between a GEMV's threads (see there); defined only in
 * builds with AVX-512. */
typedef int lora_shrink_part_fn(const void *x, int64_t ld_x, int64_t H_in, int64_t num_tokens,
                                const LoraProj *proj, int64_t num_proj, const int32_t *starts,
                                const int32_t *offsets, const float *scales, int64_t num_runs,
                                int is_bf16, int64_t max_rank, float *h, float *xf, int part,
                                int parts);
lora_shrink_part_fn lora_shrink_part;
typedef void lora_expand_part_fn(const LoraProj *proj, int64_t num_proj, const int64_t *c0,
                                 const int64_t *c1, const int32_t *starts,
                                 const int32_t *offsets, int64_t num_runs, int is_bf16,
                                 int64_t max_rank, const float *h, uint32_t *hp);
lora_expand_part_fn lora_expand_part;

#endif
