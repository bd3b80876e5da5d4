/* A decode step's projections (decode_layer.c, decode_proj.c): one GEMV each and the LoRA of the
 * modules it computes. The structs are decode_path.py's ctypes structs, field for field. */
#ifndef TOPPINGS_DECODE_PROJ_H
#define TOPPINGS_DECODE_PROJ_H
#include "common.h"
#include "lora_runs.h" /* LoraProj and the LoRA library's functions, as lora.c defines them */

/* One projection and the GEMV that runs it (decode_path.py's `Proj`). */
enum { GEMV_F32, GEMV_BF16, GEMV_F32_AVX2, GEMV_BF16_AVX2, GEMV_INT8, GEMV_INT4, GEMV_INT4_BF16 };
typedef struct {
    int64_t kind;        /* one of the GEMV_* above */
    const void *w;       /* the plain weight [out, in], or int8 values / packed int4 values */
    const float *scale;  /* int8: [out]; int4: [out, in / 32]; int4 bf16: its uint32 scale-zero
                            pairs [out, in / 32]; else NULL */
    const float *offset; /* int4: [out, in / 32]; else NULL */
    const void *bias;    /* [out] in the activation dtype, or NULL */
    int64_t out, in;
} Proj;

/* One projection's adapter tables of a step (decode_path.py's `LoraTable`): layer l's A rows
 * [pool_rows, H_in] at A0 + l * a_step bytes, its B rows [pool_rows, H_out] at B0 + l * b_step;
 * A0 NULL: no request of the step adapts the projection. */
typedef struct {
    const char *A0, *B0;
    int64_t a_step, b_step;
    const int32_t *ranks; /* [num_runs] */
    int64_t pool_rows;
} LoraTable;

enum { LORA_Q, LORA_K, LORA_V, LORA_O, LORA_GATE, LORA_UP, LORA_DOWN, LORA_MODULES };

/* The step's adapter runs (gpu_lora's RunsStep): tokens starts[g] .. starts[g + 1] read rows
 * offsets[g] .. offsets[g] + ranks[g] of each table, scaled by scales[g]. shrink and expand:
 * lora_parts.c's functions, NULL where the LoRA library has none (no AVX-512). */
typedef struct {
    lora_runs_fn run;
    lora_shrink_part_fn shrink;
    lora_expand_part_fn expand;
    const int32_t *starts, *offsets;
    const float *scales;
    int64_t num_runs;
    LoraTable tables[LORA_MODULES];
} LoraStep;

/* The LoRA a projection's output gets at layer l: modules first .. first + count of lora's
 * tables, each into columns col[i] .. col[i] + width[i] of the output, from its input. */
typedef struct {
    const LoraStep *lora;
    int64_t l;
    int first, count;
    const int64_t *col, *width;
} LoraAt;

/* y [T, out] (row stride ld_y) = x [T, in] (row stride ld_x) @ W.T (+ bias), then its LoRA
 * (at NULL: none) added from the same x. Returns 0; 1 where the GEMV declined (nothing
 * written); 2 when a LoRA run lies outside the pool; 4 when the LoRA could not allocate. */
int proj_lora(const Proj *p, const void *x, int64_t ld_x, void *y, int64_t ld_y, int64_t T,
              int is_bf16, int num_threads, const LoraAt *at);

#endif
