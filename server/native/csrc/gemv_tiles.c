/* The base model's bfloat16 projections at 1-16 rows on AMX's tile unit: y = x @ W.T over a
 * weight laid out in tiles (`pack_bf16_tiles`).
 *
 * At a decode step's rows a projection should only stream its weight, but gemv_bf16 (linear.c)
 * reads each block of W once per row from L1, so its time grows with the rows: SmolLM2's 30
 * layers took 16 / 20 / 27 ms at 1 / 2 / 4 rows on one core of an AMX Xeon, and oneDNN's packed
 * GEMM past 4 rows about as long. One TDPBF16PS multiplies a [T, 32] tile of x by a [32, 16]
 * tile of W^T for all T <= 16 rows at once, so here every row costs what one does: the same
 * stack took 14 ms at 1 to 16 rows (the weights' stream, ~15 GB/s; docs/benchmarks.md).
 *
 * The layout: W [out, in] as out / 16 blocks of 16 rows, each block contiguous (16 * in values,
 * as in the plain layout: rows r0 .. r1 with 16 | r0 start at r0 * in, so callers slice it as
 * they slice a plain weight), each block as in / 32 tiles of 1 KiB: tile row r holds, for the 16
 * weight rows n in order, the pair W[n, 32 kb + 2r], W[n, 32 kb + 2r + 1] (AMX's B layout).
 *
 * gemv_bf16_tiles: y[t, o] = bf16(sum_i x[t, i] * W[o, i]) for t < T (1-16), o < out; x [T, in]
 * (row stride ld_x), P the packed W, y [T, out] (row stride ld_y); 32 | in, 16 | out. Products
 * of bf16 pairs are exact in float32 and summed in float32 (the tile unit treats subnormal
 * inputs as zero, as the AVX-512 bf16 dot products do), y rounded once to nearest even. Returns
 * NATIVE_DECLINED where the shapes, the CPU or the kernel (no AMX permission) do not allow it:
 * nothing written. Each thread configures the tiles for its work and releases them after, so the
 * tile state oneDNN's AMX kernels set for themselves is not assumed either way. */
#define _GNU_SOURCE /* syscall() under -std=c11 */
#include "native_api.h"
#include "common.h"
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define HAS_TILES 1

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Whether this process may use the tile registers (Linux asks each process to request them). */
static int tiles_permitted(void) {
    static int state = 0; /* 0: not asked yet, 1: granted, -1: refused */
    if (state == 0) {
        long failed = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
        state = failed ? -1 : 1;
    }
    return state > 0;
}

/* Tiles 0-3: four [T, 16] float32 sums; 4: x's [T, 32]; 5-6: W's [16 pairs, 16 x 2]. */
static void configure_tiles(int64_t T) {
    TileConfig cfg __attribute__((aligned(64)));
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 5; i++) cfg.rows[i] = (uint8_t)T, cfg.colsb[i] = 64;
    for (int i = 5; i < 7; i++) cfg.rows[i] = 16, cfg.colsb[i] = 64;
    _tile_loadconfig(&cfg);
}

/* Block j of the group (its tile kb) times x's tile, into sum tile j, W through tile b. */
#define TILE_DOT(j, b)                                                                         \
    do {                                                                                       \
        _tile_loadd(b, w + ((j) * tiles + kb) * 512, 64);                                      \
        _tile_dpbf16ps(j, 4, b);                                                               \
    } while (0)
#endif

int gemv_bf16_tiles(const uint16_t *x, int64_t ld_x, const uint16_t *P, int64_t out, int64_t in,
                    uint16_t *y, int64_t ld_y, int64_t T, int num_threads) {
#ifdef HAS_TILES
    if (T < 1 || T > 16 || in % 32 != 0 || out % 16 != 0 || !tiles_permitted())
        return NATIVE_DECLINED;
    int64_t blocks = out / 16, tiles = in / 32, groups = (blocks + 3) / 4;
#pragma omp parallel num_threads(threads_for(out * in, num_threads))
    {
        float sums[4][16 * 16] __attribute__((aligned(64)));
        configure_tiles(T);
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) { /* four blocks of 16 rows: four streams */
            int64_t b0 = g * 4, n = blocks - b0 < 4 ? blocks - b0 : 4;
            const uint16_t *w = P + b0 * 16 * in;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t kb = 0; kb < tiles; kb++) {
                _tile_loadd(4, x + kb * 32, ld_x * 2);
                TILE_DOT(0, 5);
                if (n > 1) TILE_DOT(1, 6);
                if (n > 2) TILE_DOT(2, 5);
                if (n > 3) TILE_DOT(3, 6);
            }
            _tile_stored(0, sums[0], 64);
            _tile_stored(1, sums[1], 64);
            _tile_stored(2, sums[2], 64);
            _tile_stored(3, sums[3], 64);
            for (int64_t j = 0; j < n; j++)
                for (int64_t t = 0; t < T; t++)
                    store16(y, 1, t * ld_y + (b0 + j) * 16, _mm512_load_ps(sums[j] + t * 16));
        }
        _tile_release();
    }
    return NATIVE_OK;
#else
    (void)x, (void)ld_x, (void)P, (void)out, (void)in, (void)y, (void)ld_y, (void)T;
    (void)num_threads;
    return NATIVE_DECLINED;
#endif
}

/* P = W [out, in] (contiguous) in gemv_bf16_tiles' layout (the file's doc); 32 | in, 16 | out,
 * else NATIVE_DECLINED and nothing written. */
int pack_bf16_tiles(const uint16_t *W, int64_t out, int64_t in, uint16_t *P) {
    if (out < 16 || in < 32 || in % 32 != 0 || out % 16 != 0) return NATIVE_DECLINED;
    int64_t tiles = in / 32;
    for (int64_t blk = 0; blk < out / 16; blk++)
        for (int64_t kb = 0; kb < tiles; kb++) {
            uint16_t *tile = P + (blk * tiles + kb) * 512;
            for (int64_t n = 0; n < 16; n++) {
                const uint16_t *row = W + (blk * 16 + n) * in + kb * 32;
                for (int64_t r = 0; r < 16; r++) {
                    tile[r * 32 + n * 2] = row[2 * r];
                    tile[r * 32 + n * 2 + 1] = row[2 * r + 1];
                }
            }
        }
    return NATIVE_OK;
}
