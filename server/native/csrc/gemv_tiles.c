/* The base model's bfloat16 projections at 1-32 rows on AMX's tile unit: y = x @ W.T over a
 * weight laid out in tiles (`pack_bf16_tiles`).
 *
 * At a decode step's rows a projection should only stream its weight, but gemv_bf16 (linear.c)
 * reads each block of W once per row from L1, so its time grows with the rows: SmolLM2's 30
 * layers took 16 / 20 / 27 ms at 1 / 2 / 4 rows on one core of an AMX Xeon, and oneDNN's packed
 * GEMM past 4 rows about as long. One TDPBF16PS multiplies a [T, 32] tile of x by a [32, 16]
 * tile of W^T for all T <= 16 rows at once, so here every row costs what one does: the same
 * stack took 14 ms at 1 to 16 rows (the weights' stream, ~15 GB/s; docs/benchmarks.md). At
 * 17-32 rows x takes two tiles and each W tile loaded serves both (17 ms at 32 rows).
 *
 * The layout: W [out, in] as out / 16 blocks of 16 rows, each block contiguous (16 * in values,
 * as in the plain layout: rows r0 .. r1 with 16 | r0 start at r0 * in, so callers slice it as
 * they slice a plain weight), each block as in / 32 tiles of 1 KiB: tile row r holds, for the 16
 * weight rows n in order, the pair W[n, 32 kb + 2r], W[n, 32 kb + 2r + 1] (AMX's B layout).
 *
 * gemv_bf16_tiles: y[t, o] = bf16(sum_i x[t, i] * W[o, i]) for t < T (1-32), o < out; x [T, in]
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

/* T <= 16: tiles 0-3 four blocks' [T, 16] float32 sums, 4 x's [T, 32], 5-6 W's [16 pairs,
 * 16 x 2]. T 17-32: tiles 0-1 one block's sums of rows 0-15 and 16.., 2-3 the next block's, 4-5
 * x's rows 0-15 and 16.., 6-7 the two blocks' W. */
static void configure_tiles(int64_t T) {
    TileConfig cfg __attribute__((aligned(64)));
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) cfg.colsb[i] = 64; /* tile 7 unused below 17 rows: none */
    if (T <= 16) {
        for (int i = 0; i < 5; i++) cfg.rows[i] = (uint8_t)T;
        cfg.rows[5] = cfg.rows[6] = 16;
        cfg.colsb[7] = 0;
    } else {
        uint8_t rest = (uint8_t)(T - 16);
        cfg.rows[0] = cfg.rows[2] = cfg.rows[4] = 16;
        cfg.rows[1] = cfg.rows[3] = cfg.rows[5] = rest;
        cfg.rows[6] = cfg.rows[7] = 16;
    }
    _tile_loadconfig(&cfg);
}

/* Block j of the group (its tile kb) times x's tile, into sum tile j, W through tile b. */
#define TILE_DOT(j, b)                                                                         \
    do {                                                                                       \
        _tile_loadd(b, w + ((j) * tiles + kb) * 512, 64);                                      \
        _tile_dpbf16ps(j, 4, b);                                                               \
    } while (0)

static inline void zero_sums(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

/* Sum tiles 0-3 into sums[0-3], each [16, 16] float32 (the rows their config gives). */
static inline void save_sums(float sums[4][16 * 16]) {
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    _tile_stored(2, sums[2], 64);
    _tile_stored(3, sums[3], 64);
}

/* Rows 0 .. rows of a [16, 16] float32 sum tile, rounded, into y's columns col ..col + 16. */
static void store_sums(const float *sums, int64_t rows, uint16_t *y, int64_t ld_y, int64_t col) {
    for (int64_t t = 0; t < rows; t++) store16(y, 1, t * ld_y + col, _mm512_load_ps(sums + t * 16));
}

/* Blocks of this thread's share, four at a time (four streams of W), x's T <= 16 rows. */
static void blocks_by_four(const uint16_t *x, int64_t ld_x, const uint16_t *P, int64_t blocks,
                           int64_t in, uint16_t *y, int64_t ld_y, int64_t T) {
    int64_t tiles = in / 32, groups = (blocks + 3) / 4;
    float sums[4][16 * 16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        int64_t b0 = g * 4, n = blocks - b0 < 4 ? blocks - b0 : 4;
        const uint16_t *w = P + b0 * 16 * in;
        zero_sums();
        for (int64_t kb = 0; kb < tiles; kb++) {
            _tile_loadd(4, x + kb * 32, ld_x * 2);
            TILE_DOT(0, 5);
            if (n > 1) TILE_DOT(1, 6);
            if (n > 2) TILE_DOT(2, 5);
            if (n > 3) TILE_DOT(3, 6);
        }
        save_sums(sums);
        for (int64_t j = 0; j < n; j++) store_sums(sums[j], T, y, ld_y, (b0 + j) * 16);
    }
}

/* Blocks of this thread's share, two at a time, x's 17-32 rows as two tiles: each W tile
 * loaded once serves both. */
static void blocks_by_two(const uint16_t *x, int64_t ld_x, const uint16_t *P, int64_t blocks,
                          int64_t in, uint16_t *y, int64_t ld_y, int64_t T) {
    int64_t tiles = in / 32, groups = (blocks + 1) / 2;
    const uint16_t *x_rest = x + 16 * ld_x;
    uint16_t *y_rest = y + 16 * ld_y;
    float sums[4][16 * 16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        int64_t b0 = g * 2, two = blocks - b0 > 1;
        const uint16_t *w = P + b0 * 16 * in;
        zero_sums();
        for (int64_t kb = 0; kb < tiles; kb++) {
            _tile_loadd(4, x + kb * 32, ld_x * 2);
            _tile_loadd(5, x_rest + kb * 32, ld_x * 2);
            _tile_loadd(6, w + kb * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 5, 6);
            if (two) {
                _tile_loadd(7, w + (tiles + kb) * 512, 64);
                _tile_dpbf16ps(2, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        save_sums(sums);
        for (int64_t j = 0; j <= two; j++) {
            store_sums(sums[2 * j], 16, y, ld_y, (b0 + j) * 16);
            store_sums(sums[2 * j + 1], T - 16, y_rest, ld_y, (b0 + j) * 16);
        }
    }
}
#endif

int gemv_bf16_tiles(const uint16_t *x, int64_t ld_x, const uint16_t *P, int64_t out, int64_t in,
                    uint16_t *y, int64_t ld_y, int64_t T, int num_threads) {
#ifdef HAS_TILES
    if (T < 1 || T > 32 || in % 32 != 0 || out % 16 != 0 || !tiles_permitted())
        return NATIVE_DECLINED;
#pragma omp parallel num_threads(threads_for(out * in, num_threads))
    {
        configure_tiles(T);
        if (T <= 16)
            blocks_by_four(x, ld_x, P, out / 16, in, y, ld_y, T);
        else
            blocks_by_two(x, ld_x, P, out / 16, in, y, ld_y, T);
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
