/* Whether int8 weights halve a bf16 decode step's GEMV time here: the int8 GEMV's compute
 * ceiling against the memory's rate, beside the bf16 GEMV's. A C probe (no JSON), with the inner
 * loops of server/native/csrc/gemv_int8.c (int8 widened to float32, FMA'd with float32 x) and
 * linear.c (bf16 pairs through vdpbf16ps) at one row, two ways:
 *
 *   warm: one [1024, 576] weight (590 KB int8, 1.2 MB bf16: in the two L2s) multiplied 2,000
 *         times, on 1 and 2 threads: weights per second the cores can take;
 *   cold: SmolLM2's 30 layers of projections (q/k/v, o, gate/up, down: 106 M weights, larger
 *         than L3) once, 36 times, int8 and bf16 in alternating order: the read rate reached.
 *
 * Needs AVX-512 with AVX512_BF16. Build and run from the repository root:
 *
 *   gcc -O3 -march=native -fopenmp -I gpu_lora/kernels/csrc bench/gemv_ceiling.c -o /tmp/gc
 *   /tmp/gc
 *
 * Measured on the project's 2-core AMD EPYC (docs/benchmarks.md, session 31). */
#include "common.h"
#include <omp.h>
#include <stdio.h>
#include <time.h>

#if !defined(__AVX512F__) || !defined(__AVX512BF16__)
#error "needs AVX-512 with AVX512_BF16 (-march=native on such a CPU)"
#endif

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static inline __m512 load16_i8(const int8_t *w, int64_t c) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + c))));
}

/* y = scale * (q @ xf) for one row, gemv_int8.c's AVX-512 loop; 32 | in. */
static void gemv_int8(const float *xf, const int8_t *q, const float *scale, int64_t out,
                      int64_t in, float *y, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t blk = 0; blk < out / 16; blk++) {
        __m512 part[16];
        for (int j = 0; j < 16; j++) {
            const int8_t *wj = q + (blk * 16 + j) * in;
            __m512 even = _mm512_setzero_ps(), odd = even;
            for (int64_t c = 0; c < in; c += 32) {
                even = _mm512_fmadd_ps(load16_i8(wj, c), _mm512_loadu_ps(xf + c), even);
                odd = _mm512_fmadd_ps(load16_i8(wj, c + 16), _mm512_loadu_ps(xf + c + 16), odd);
            }
            part[TRANSPOSED(j)] = _mm512_add_ps(even, odd);
        }
        __m512 s = _mm512_loadu_ps(scale + blk * 16);
        _mm512_storeu_ps(y + blk * 16, _mm512_mul_ps(s, reduce16(part)));
    }
}

/* y = W @ x for one row, linear.c's loop (with its next-block prefetch); 32 | in. */
static void gemv_bf16(const uint16_t *x, const uint16_t *W, int64_t out, int64_t in, uint16_t *y,
                      int threads) {
    int64_t blocks = out / 16;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
        const uint16_t *w = W + blk * 16 * in;
        __m512 part[16];
        for (int j = 0; j < 16; j++) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t c = 0; c < in; c += 32)
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w + j * in + c),
                                       (__m512bh)_mm512_loadu_si512(x + c));
            if (blk + 1 < blocks) prefetch_l2(w + (16 + j) * in, in * 2);
            part[TRANSPOSED(j)] = acc;
        }
        store16(y, 1, blk * 16, reduce16(part));
    }
}

#define LAYERS 30
static const int64_t SHAPES[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};

int main(void) {
    float *xf = aligned_alloc(64, 4096 * 4), *yf = aligned_alloc(64, 4096 * 4);
    float *scale = aligned_alloc(64, 4096 * 4);
    uint16_t *x = aligned_alloc(64, 4096 * 2), *y = aligned_alloc(64, 4096 * 2);
    for (int i = 0; i < 4096; i++) xf[i] = 1.0f, x[i] = 0x3f80, scale[i] = 0.01f;

    int64_t out = 1024, in = 576, calls = 2000;
    int8_t *q = aligned_alloc(64, out * in);
    uint16_t *w = aligned_alloc(64, out * in * 2);
    for (int64_t i = 0; i < out * in; i++) q[i] = (int8_t)(i * 7), w[i] = 0x3c00 + (i & 7);
    for (int threads = 1; threads <= 2; threads++)
        for (int rep = 0; rep < 3; rep++) {
            double t0 = now();
            for (int k = 0; k < calls; k++) gemv_int8(xf, q, scale, out, in, yf, threads);
            double t1 = now();
            for (int k = 0; k < calls; k++) gemv_bf16(x, w, out, in, y, threads);
            double t2 = now(), n = (double)out * in * calls;
            printf("warm, %d thread(s): int8 %.1f G weights/s, bf16 %.1f G weights/s\n", threads,
                   n / (t1 - t0) / 1e9, n / (t2 - t1) / 1e9);
        }

    int8_t *Q[LAYERS][4];
    uint16_t *W[LAYERS][4];
    double weights = 0, ratio = 0, rate8 = 0, rate16 = 0;
    for (int l = 0; l < LAYERS; l++)
        for (int p = 0; p < 4; p++) {
            int64_t n = SHAPES[p][0] * SHAPES[p][1];
            Q[l][p] = aligned_alloc(64, n);
            W[l][p] = aligned_alloc(64, n * 2);
            for (int64_t i = 0; i < n; i++)
                Q[l][p][i] = (int8_t)(i * 7), W[l][p][i] = 0x3c00 + (i & 7);
            weights += n;
        }
    int timed = 0;
    for (int rep = 0; rep < 40; rep++) {
        double t[2];
        for (int k = 0; k < 2; k++) {
            int int8 = (k + rep) % 2; /* alternate which goes first */
            double t0 = now();
            for (int l = 0; l < LAYERS; l++)
                for (int p = 0; p < 4; p++) {
                    if (int8)
                        gemv_int8(xf, Q[l][p], scale, SHAPES[p][0], SHAPES[p][1], yf, 2);
                    else
                        gemv_bf16(x, W[l][p], SHAPES[p][0], SHAPES[p][1], y, 2);
                }
            t[int8] = now() - t0;
        }
        if (rep < 4) continue; /* warm-up */
        ratio += t[1] / t[0], rate8 += weights / t[1] / 1e9, rate16 += 2 * weights / t[0] / 1e9;
        timed++;
    }
    printf("cold, 2 threads, %.0f M weights: int8 %.1f GB/s, bf16 %.1f GB/s; int8 / bf16 time "
           "%.3f (means of %d alternating pairs)\n",
           weights / 1e6, rate8 / timed, rate16 / timed, ratio / timed, timed);
    return 0;
}
