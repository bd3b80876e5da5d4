/* A prompt's int4 weights for torch's GEMM (`--quantization int4`, rows past the packed
 * kernel's): torch's CPU int4 pack dequantized, a slice of output channels at a time, into the
 * transposed float weight W.T, which is the pack's own order (no transpose needed).
 *
 * dequant_int4_pack: for output rows o in [64 b0, 64 b1) and inputs i < in,
 *   wt[i, o - 64 b0] = (n[o, i] - 8) * s[i / 32, o] + z[i / 32, o]
 * computed as torch computes quant.py's dequantize (subtract, multiply, add: each rounded to
 * float32, no fused multiply-add), then rounded once to bf16 where wt_bf16.
 * packed: `_convert_weight_to_int4pack_for_cpu`'s [out / 64, in, 32] bytes, byte r of block b's
 * input i holding row 64 b + r in its low nibble and row 64 b + r + 32 in its high one;
 * sz [in / 32, out, 2] (scale, zero) pairs, float32 or bf16 (sz_bf16); out a multiple of 64
 * (the pack's padding included), 32 | in; wt [in, 64 (b1 - b0)] float32 or bf16 (row stride
 * ld_wt). Returns NATIVE_DECLINED where the shapes do not suit (nothing written). */
#include "native_api.h"
#include "common.h"

#define BLOCK 64
#define GROUP 32

__attribute__((optimize("fp-contract=off"))) static void dequant_group(
    const uint8_t *packed, const void *sz, int sz_bf16, int64_t in, int64_t out, int64_t b,
    int64_t g, int64_t b0, void *wt, int wt_bf16, int64_t ld_wt) {
    float s[BLOCK], z[BLOCK], w[BLOCK];
    for (int r = 0; r < BLOCK; r++) {
        int64_t pair = (g * out + b * BLOCK + r) * 2;
        s[r] = ld(sz, sz_bf16, pair);
        z[r] = ld(sz, sz_bf16, pair + 1);
    }
    for (int64_t i = g * GROUP; i < (g + 1) * GROUP; i++) {
        const uint8_t *bytes = packed + (b * in + i) * (BLOCK / 2);
#pragma omp simd
        for (int r = 0; r < BLOCK / 2; r++) {
            float lo = (float)(bytes[r] & 15) - 8.0f, hi = (float)(bytes[r] >> 4) - 8.0f;
            lo = lo * s[r];
            hi = hi * s[r + BLOCK / 2];
            w[r] = lo + z[r];
            w[r + BLOCK / 2] = hi + z[r + BLOCK / 2];
        }
        int64_t at = i * ld_wt + (b - b0) * BLOCK;
        if (wt_bf16) {
            uint16_t *dst = (uint16_t *)wt + at;
#pragma omp simd
            for (int r = 0; r < BLOCK; r++) dst[r] = bf16_store(w[r]);
        } else {
            memcpy((float *)wt + at, w, sizeof w);
        }
    }
}

int dequant_int4_pack(const uint8_t *packed, const void *sz, int sz_bf16, int64_t in, int64_t out,
                      int64_t b0, int64_t b1, void *wt, int wt_bf16, int64_t ld_wt,
                      int num_threads) {
    if (in % GROUP || out % BLOCK || b0 < 0 || b1 > out / BLOCK || b0 >= b1 ||
        ld_wt < (b1 - b0) * BLOCK)
        return NATIVE_DECLINED;
    int64_t groups = in / GROUP, items = (b1 - b0) * groups;
#pragma omp parallel for num_threads(threads_for(items * GROUP * BLOCK, num_threads)) \
    schedule(static)
    for (int64_t k = 0; k < items; k++)
        dequant_group(packed, sz, sz_bf16, in, out, b0 + k / groups, k % groups, b0, wt, wt_bf16,
                      ld_wt);
    return 0;
}
