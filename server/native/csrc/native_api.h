/* The engine library's whole interface (every .c file beside this one): every function it
 * exports, the structs and enums its callers fill, and through lora_api.h (gpu_lora's LoRA
 * library, whose functions the one-call decode step reaches through their addresses) the
 * `NativeStatus` every function returns.
 *
 * Every .c file of the library includes it, so the compiler checks each definition against the
 * declaration here (and refuses, with -Werror=missing-prototypes, an exported function declared
 * nowhere). The Python side (server/native/__init__.py's SIGNATURES, the ctypes structs and the
 * enums' tables of server/model/decode_structs.py and quant_gemv.py) is compared with this file by
 * tests/server/native/test_native_abi.py, which reads it with gpu_lora/kernels/native_abi.py:
 * keep to the declarations that parser takes (typedef'd structs and enums, prototypes, function
 * types). Each function's semantics and shapes are written where it is defined. */
#ifndef TOPPINGS_NATIVE_API_H
#define TOPPINGS_NATIVE_API_H
#include <stdint.h>
#include "lora_api.h"

/* ---- decode_proj.c, decode_layer.c: a decode step in one call (decode_path.py) ---- */

/* The GEMV that runs a projection (decode_structs.py's GEMV_KINDS, GEMV_INT8, ...). */
typedef enum {
    GEMV_F32 = 0,
    GEMV_BF16 = 1,
    GEMV_F32_AVX2 = 2,
    GEMV_BF16_AVX2 = 3,
    GEMV_INT8 = 4,
    GEMV_INT4 = 5,
    GEMV_INT4_BF16 = 6,
    GEMV_BF16_TILES = 7
} GemvKind;

/* One projection and the GEMV that runs it (decode_structs.py's `Proj`). */
typedef struct {
    int64_t kind;        /* a GemvKind */
    const void *w;       /* the plain weight [out, in], its tiles (GEMV_BF16_TILES), or int8
                            values / packed int4 values */
    const float *scale;  /* int8: [out]; int4: [out, in / 32]; int4 bf16: its uint32 scale-zero
                            pairs [out, in / 32]; else NULL */
    const float *offset; /* int4: [out, in / 32]; else NULL */
    const void *bias;    /* [out] in the activation dtype, or NULL */
    int64_t out, in;
} Proj;

/* One projection's adapter tables of a step (decode_structs.py's `LoraTable`): layer l's A rows
 * [pool_rows, H_in] at A0 + l * a_step bytes, its B rows [pool_rows, H_out] at B0 + l * b_step;
 * A0 NULL: no request of the step adapts the projection. */
typedef struct {
    const char *A0, *B0;
    int64_t a_step, b_step;
    const int32_t *ranks; /* [num_runs] */
    int64_t pool_rows;
} LoraTable;

/* The slots of LoraStep's tables (decode_structs.py's LORA_SLOTS). */
typedef enum {
    LORA_Q = 0,
    LORA_K = 1,
    LORA_V = 2,
    LORA_O = 3,
    LORA_GATE = 4,
    LORA_UP = 5,
    LORA_DOWN = 6,
    LORA_MODULES = 7
} LoraSlot;

/* The step's runs served from the host (gpu_lora's HostRuns; decode_structs.py's `LoraHost`):
 * adapters with no rows in the pool (every layer of theirs), or rows still loading. procs
 * [layers, LORA_MODULES, per_slot]: layer l's projection of a slot for each host segment, over
 * the adapter's own A and B^T (A NULL: that segment does not adapt it), with y and ld_y left to
 * the call (procs NULL: no runs on the host); runs: host segments' starts, offsets (0) and
 * scales, as lora_runs takes them. */
typedef struct {
    const LoraProj *procs;
    int64_t per_slot;
    const int32_t *starts, *offsets;
    const float *scales;
    int64_t num_runs;
} LoraHost;

/* The step's adapter runs (gpu_lora's RunsStep; decode_structs.py's `LoraStep`): tokens
 * starts[g] .. starts[g + 1] read rows offsets[g] .. offsets[g] + ranks[g] of each table, scaled
 * by scales[g]. shrink and expand: lora_parts.c's functions, NULL where the LoRA library has none
 * (no AVX-512). host: the runs served from the host (their ranks 0 in the tables). */
typedef struct {
    lora_runs_fn *run;
    lora_shrink_part_fn *shrink;
    lora_expand_part_fn *expand;
    const int32_t *starts, *offsets;
    const float *scales;
    int64_t num_runs;
    LoraTable tables[LORA_MODULES];
    LoraHost host;
} LoraStep;

/* The LoRA a projection's output gets at layer l: modules first .. first + count of lora's
 * tables, each into columns col[i] .. col[i] + width[i] of the output, from its input (C only). */
typedef struct {
    const LoraStep *lora;
    int64_t l;
    int first, count;
    const int64_t *col, *width;
} LoraAt;

/* One layer's weights and its layer of the KV pool (decode_structs.py's `DecodeLayer`). */
typedef struct {
    const void *input_norm, *post_norm; /* [H] */
    const Proj *qkv, *o, *gate_up, *down;
    void *kc, *vc; /* [K, S, D] */
} DecodeLayer;

/* The step (decode_structs.py's `DecodeStep`): its tokens, buffers and shapes, and its two ends
 * where the caller leaves them to decode_layers (NULL pointers: the caller's); see
 * decode_layer.c. */
typedef struct {
    void *h; /* [T, H]: the residual stream, added into in place */
    void *x, *qkv, *attn, *out, *gate_up, *act, *residual; /* the layers' buffers, contiguous */
    void *cos, *sin;                                        /* [T, D] */
    const int64_t *slots, *index, *lengths;                 /* [T], [T, L], [T] */
    int64_t L, S, T, H, N, K, D, I;
    float eps, scale;
    const void *embed, *cos_table, *sin_table, *final_norm;
    const int64_t *ids, *positions; /* [T] */
    const Proj *lm_head;
    void *normed, *logits;          /* [T, H], [T, V] contiguous */
    int64_t embed_rows, table_rows; /* the rows of embed and of cos_table / sin_table */
    float *logits_f32;              /* [T, V] contiguous */
    uint8_t *finite;                /* [T] */
    int64_t *argmax;                /* [T] */
} DecodeStep;

int proj_lora(const Proj *p, const void *x, int64_t ld_x, void *y, int64_t ld_y, int64_t T,
              int is_bf16, int num_threads, const LoraAt *at);
int norm_proj(void *h, const void *delta, const void *norm, void *x, const Proj *p, void *y,
              int64_t T, int64_t ld_h, int64_t ld_delta, float eps, int is_bf16,
              int num_threads);
int attend_proj(void *qkv, const void *cos_t, const void *sin_t, void *kc, void *vc,
                const int64_t *slots, const int64_t *index, const int64_t *lengths, int64_t L,
                int64_t S, void *a, const Proj *o, void *y, int64_t T, int64_t N, int64_t K,
                int64_t D, float scale, int is_bf16, int num_threads);
int act_proj(const void *gate_up, void *a, const Proj *down, void *y, int64_t T, int is_bf16,
             int num_threads);
int decode_layers(const DecodeStep *s, const DecodeLayer *layers, int64_t num_layers,
                  const LoraStep *lora, int is_bf16, int num_threads);

/* ---- attention.c, attention_tiles.c: attention over the token-level KV pool ---- */

int decode_attention_f32(const float *q, const float *k, const float *v, float *out,
                         const int64_t *index, const int64_t *lengths, int B, int N, int K, int D,
                         int64_t ld_index, int64_t slots_per_head, int64_t ld_q, float scale,
                         int num_threads);
int decode_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out,
                          const int64_t *index, const int64_t *lengths, int B, int N, int K,
                          int D, int64_t ld_index, int64_t slots_per_head, int64_t ld_q,
                          float scale, int num_threads);
int attention_rows(const void *q, const void *k, const void *v, void *out, const int64_t *index,
                   const int64_t *row_start, const int64_t *lengths, int B, int N, int K, int D,
                   int64_t slots_per_head, int64_t ld_q, float scale, int is_bf16,
                   int num_threads);
int attention_tiles(const void *q, const void *k, const void *v, void *out, const int64_t *index,
                    const int64_t *segs, int num_segs, int N, int K, int D,
                    int64_t slots_per_head, int64_t ld_q, float scale, int is_bf16,
                    int num_threads);

/* ---- elementwise.c: RMSNorm with the residual add, RoPE, silu * up, the KV write ---- */

int add_rms_norm(void *h, const void *delta, const void *w, void *out, int64_t T, int64_t H,
                 int64_t ld_h, int64_t ld_delta, int64_t ld_out, float eps, int is_bf16,
                 int num_threads);
int rope(void *x, const void *cos_t, const void *sin_t, int64_t T, int64_t heads, int64_t D,
         int64_t ld_x, int is_bf16, int num_threads);
int silu_mul_takes(int64_t I); /* 1 where silu_mul takes I (not a status) */
int silu_mul(const void *gu, int64_t ld_gu, void *out, int64_t T, int64_t I, int is_bf16,
             int num_threads);
int kv_write(const void *k, const void *v, int64_t ld, void *kc, void *vc, const int64_t *slots,
             int64_t T, int64_t K, int64_t D, int64_t S, int64_t elem_bytes, int num_threads);

/* ---- linear.c, gemv_tiles.c, gemv_int8.c, gemv_int4_bf16.c: GEMVs of a few rows ---- */

/* gemv_int8's and gemv_int4's `isa` (quant_gemv.py's GEMV_ISA). */
typedef enum { ISA_BEST = 0, ISA_AVX2 = 1, ISA_C = 2, ISA_AVX512 = 512 } GemvIsa;

int gemv_bf16(const uint16_t *x, int64_t ld_x, const uint16_t *W, int64_t out, int64_t in,
              uint16_t *y, int64_t ld_y, int64_t T, int num_threads);
int gemv_f32(const float *x, int64_t ld_x, const float *W, int64_t out, int64_t in, float *y,
             int64_t ld_y, int64_t T, int num_threads);
int gemv_bf16_tiles(const uint16_t *x, int64_t ld_x, const uint16_t *P, int64_t out, int64_t in,
                    uint16_t *y, int64_t ld_y, int64_t T, int num_threads);
int pack_bf16_tiles(const uint16_t *W, int64_t out, int64_t in, uint16_t *P);
int gemv_f32_avx2(const float *x, int64_t ld_x, const float *W, int64_t out, int64_t in, float *y,
                  int64_t ld_y, int64_t T, int num_threads);
int gemv_bf16_avx2(const uint16_t *x, int64_t ld_x, const uint16_t *W, int64_t out, int64_t in,
                   uint16_t *y, int64_t ld_y, int64_t T, int num_threads);
int gemv_int8(const void *x, int64_t ld_x, int x_is_bf16, const int8_t *q, const float *scale,
              int64_t out, int64_t in, void *y, int64_t ld_y, int64_t T, int isa,
              int num_threads);
int gemv_int4(const void *x, int64_t ld_x, int x_is_bf16, const uint8_t *q, const float *scale,
              const float *offset, int64_t out, int64_t in, void *y, int64_t ld_y, int64_t T,
              int isa, int num_threads);
int gemv_int4_bf16(const uint16_t *x, int64_t ld_x, const uint8_t *q, const uint32_t *sz,
                   int64_t out, int64_t in, uint16_t *y, int64_t ld_y, int64_t T,
                   int num_threads);

/* ---- dequant_int4.c, logits.c ---- */

int dequant_int4_pack(const uint8_t *packed, const void *sz, int sz_bf16, int64_t in, int64_t out,
                      int64_t b0, int64_t b1, void *wt, int wt_bf16, int64_t ld_wt,
                      int num_threads);
int logits_scan(const float *logits, int64_t ld, int64_t B, int64_t V, uint8_t *finite,
                int64_t *argmax, int num_threads);
int logits_logprobs(const float *logits, int64_t ld, int64_t R, int64_t V, const int64_t *ids,
                    int k, float *own, int64_t *rank, int64_t *top_ids, float *top_lp,
                    int num_threads);

#endif
