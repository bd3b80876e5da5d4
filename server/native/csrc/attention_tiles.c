/* Blocked (flash-style) causal attention of prompt segments over the token-level KV pool.
 *
 * Semantics, per segment s of t tokens after a past of P (its P + t slots at
 * index[idx_start:], the past's first, then its own, written before this runs), token r of it
 * (0 <= r < t) and query head n (kv head h = n / G, G = N / K):
 *     p[l] = softmax_l(scale * q[tok + r, n] . k[h, slots[l]]),  l <= P + r
 *     out[tok + r, n] = sum_l p[l] * v[h, slots[l]]
 * Arithmetic in float32 whatever the storage type; bf16 is rounded to nearest even on output.
 * Shapes: q [T, N, D] (row stride ld_q, heads contiguous); out [T, N, D] contiguous (only the
 * segments' rows written); k, v [K, S, D] contiguous (one layer of the pool);
 * segs [num_segs, 4] int64 rows of (tok, t, idx_start, P).
 *
 * attention.c's rows kernel reads a token's whole past once per query row: a chunk of t tokens
 * after P reads t x P key and value rows. Here a tile of BQ tokens x the G query heads of one
 * kv head streams the keys and values in blocks of BK, once per tile, with an online softmax
 * (running max and sum per query, FlashAttention's rescaling): t / BQ reads of the past, and
 * the products run as small register-blocked matrix products. The tile is held transposed
 * (queries across the vector lanes): scores are [BK, M] for M = G x BQ queries, so a query's
 * max, exponentials and sums over keys are lane-wise and each key or value element is one
 * broadcast against a vector of queries. Written with GCC vector extensions: 16-wide where
 * the CPU has AVX-512, 8-wide with AVX (AVX2), 4-wide otherwise, FMA
 * through intrinsics where the CPU has it (the build turns off contraction).
 */
#include "native_api.h"
#include "common.h"
#if defined(__AVX__)
#include <immintrin.h>
#endif

#ifdef __AVX512F__
#define VW 16 /* floats per vector */
#define JB 8  /* keys (values: head dims) per register block, x 2 vectors of queries */
#elif defined(__AVX__)
#define VW 8
#define JB 4
#else
#define VW 4
#define JB 4
#endif
#ifndef BQ
#define BQ 32 /* tokens per tile (a multiple of 2 x VW) */
#endif
#ifndef BK
#define BK 64 /* keys per block (a multiple of JB) */
#endif
#define NV (BQ / VW) /* vectors per head of a tile */

typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));

static inline vf fma_v(vf a, vf b, vf c) { /* a * b + c */
#ifdef __AVX512F__
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

static inline vf splat(float x) { /* a broadcast (0 + x would be computed first) */
#ifdef __AVX512F__
    return (vf)_mm512_set1_ps(x);
#elif defined(__AVX__)
    return (vf)_mm256_set1_ps(x);
#else
    return (vf){x, x, x, x};
#endif
}
static inline vf sel(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }
static inline vf vmax(vf a, vf b) { return sel(a > b, a, b); }

/* 2^x lane-wise, to about 1 ulp; 0 below -126 (and for -inf). */
static inline vf exp2_v(vf x) {
    vi tiny = x < splat(-126.f);
    x = vmax(x, splat(-126.f));
    const float magic = 12582912.f; /* 1.5 x 2^23: adding it rounds to an integer */
    vf big = x + splat(magic);
    vf n = big - splat(magic);
    vf r = x - n; /* [-0.5, 0.5] */
    vi ni = (vi)big - (vi)splat(magic);
    /* 2^r = e^(r ln 2), Taylor to degree 7 */
    vf p = splat(1.5252733804059840e-5f);
    p = fma_v(p, r, splat(1.5403530393381606e-4f));
    p = fma_v(p, r, splat(1.3333558146428443e-3f));
    p = fma_v(p, r, splat(9.6181291076284772e-3f));
    p = fma_v(p, r, splat(5.5504108664821580e-2f));
    p = fma_v(p, r, splat(2.4022650695910071e-1f));
    p = fma_v(p, r, splat(6.9314718055994531e-1f));
    p = fma_v(p, r, splat(1.f));
    vf pow2n = (vf)((ni + 127) << 23);
    return (vf)((vi)(p * pow2n) & ~tiny);
}

static inline vf ldv(const float *p) { return *(const vf *)p; } /* 64-byte aligned */
static inline void stv(float *p, vf x) { *(vf *)p = x; }

/* Rows slots[0:nb] of one kv head's [S, D] matrix as float32 into dst [BK, D], rows nb up to
 * the next multiple of JB zero. */
static inline void gather_block(const void *src, int is_bf16, const int64_t *slots, int nb,
                                int nb_pad, int D, float *dst) {
    load_rows(src, is_bf16, slots, nb, D, dst);
    memset(dst + (size_t)nb * D, 0, sizeof(float) * (size_t)(nb_pad - nb) * D);
}

/* One tile: rows r0 .. r0 + nr of segment (tok, P) for kv head h. Scratch, each 64-byte
 * aligned: qt, ot [D, M]; sc [BK, M]; kb, vb [BK, D]; m, l [M], M = G x BQ. Query j of head
 * g of the tile is lane g x BQ + j. */
static inline __attribute__((always_inline)) void tile(
    const void *q, const void *k, const void *v, void *out, const int64_t *slots, int64_t tok,
    int64_t P, int r0, int nr, int h, int N, int G, int D, int64_t ld_q, float scale,
    int is_bf16, float *qt, float *ot, float *sc, float *kb, float *vb, float *m, float *l) {
    const int M = G * BQ;
    const float qscale = scale * 1.4426950408889634f; /* scores in log2 units: exp2 */
    for (int g = 0; g < G; g++)
        for (int j = 0; j < BQ; j++) {
            int64_t base = (tok + r0 + j) * ld_q + (int64_t)(h * G + g) * D;
            for (int d = 0; d < D; d++)
                qt[(size_t)d * M + g * BQ + j] =
                    j < nr ? ld(q, is_bf16, base + d) * qscale : 0.f;
        }
    for (int i = 0; i < M; i += VW) {
        stv(m + i, splat(-INFINITY));
        stv(l + i, splat(0.f));
    }
    memset(ot, 0, sizeof(float) * (size_t)D * M);
    vi iota;
    for (int c = 0; c < VW; c++) iota[c] = c;
    int64_t num_keys = P + r0 + nr; /* what the tile's last row sees */
    for (int64_t k0 = 0; k0 < num_keys; k0 += BK) {
        int nb = (int)(num_keys - k0 < BK ? num_keys - k0 : BK);
        int nb_pad = (nb + JB - 1) / JB * JB;
        gather_block(k, is_bf16, slots + k0, nb, nb_pad, D, kb);
        gather_block(v, is_bf16, slots + k0, nb, nb_pad, D, vb);
        /* sc[j, i] = kb[j] . qt[:, i] */
        for (int i0 = 0; i0 < M; i0 += 2 * VW)
            for (int j0 = 0; j0 < nb_pad; j0 += JB) {
                vf a0[JB], a1[JB];
                for (int jj = 0; jj < JB; jj++) a0[jj] = a1[jj] = splat(0.f);
                for (int d = 0; d < D; d++) {
                    vf x0 = ldv(qt + (size_t)d * M + i0), x1 = ldv(qt + (size_t)d * M + i0 + VW);
                    for (int jj = 0; jj < JB; jj++) {
                        vf b = splat(kb[(size_t)(j0 + jj) * D + d]);
                        a0[jj] = fma_v(b, x0, a0[jj]);
                        a1[jj] = fma_v(b, x1, a1[jj]);
                    }
                }
                for (int jj = 0; jj < JB; jj++) {
                    stv(sc + (size_t)(j0 + jj) * M + i0, a0[jj]);
                    stv(sc + (size_t)(j0 + jj) * M + i0 + VW, a1[jj]);
                }
            }
        /* causal mask: key k0 + j is seen by tile rows j' >= k0 + j - P - r0; padding by none */
        for (int j = 0; j < nb_pad; j++) {
            int64_t first = j < nb ? k0 + j - P - r0 : BQ;
            if (first <= 0) continue;
            for (int i = 0; i < M; i += VW) {
                vi row = iota + (i % BQ);
                vi hidden = row < (vi){0} + (int32_t)(first < BQ ? first : BQ);
                float *row_j = sc + (size_t)j * M + i;
                stv(row_j, sel(hidden, splat(-INFINITY), ldv(row_j)));
            }
        }
        /* online softmax: new running max, the old sums and outputs rescaled */
        for (int i = 0; i < M; i += VW) {
            vf mx = ldv(m + i);
            for (int j = 0; j < nb_pad; j++) mx = vmax(mx, ldv(sc + (size_t)j * M + i));
            vf alpha = exp2_v(ldv(m + i) - mx), sum = splat(0.f);
            for (int j = 0; j < nb_pad; j++) {
                vf p = exp2_v(ldv(sc + (size_t)j * M + i) - mx);
                stv(sc + (size_t)j * M + i, p);
                sum += p;
            }
            stv(m + i, mx);
            stv(l + i, ldv(l + i) * alpha + sum);
            for (int d = 0; d < D; d++)
                stv(ot + (size_t)d * M + i, ldv(ot + (size_t)d * M + i) * alpha);
        }
        /* ot[d, i] += sum_j vb[j, d] sc[j, i]: JB head dims at a time, then one at a time */
        for (int i0 = 0; i0 < M; i0 += 2 * VW) {
            int d0 = 0;
            for (; d0 + JB <= D; d0 += JB) {
                vf a0[JB], a1[JB];
                for (int dd = 0; dd < JB; dd++) {
                    a0[dd] = ldv(ot + (size_t)(d0 + dd) * M + i0);
                    a1[dd] = ldv(ot + (size_t)(d0 + dd) * M + i0 + VW);
                }
                for (int j = 0; j < nb_pad; j++) {
                    vf p0 = ldv(sc + (size_t)j * M + i0), p1 = ldv(sc + (size_t)j * M + i0 + VW);
                    for (int dd = 0; dd < JB; dd++) {
                        vf b = splat(vb[(size_t)j * D + d0 + dd]);
                        a0[dd] = fma_v(b, p0, a0[dd]);
                        a1[dd] = fma_v(b, p1, a1[dd]);
                    }
                }
                for (int dd = 0; dd < JB; dd++) {
                    stv(ot + (size_t)(d0 + dd) * M + i0, a0[dd]);
                    stv(ot + (size_t)(d0 + dd) * M + i0 + VW, a1[dd]);
                }
            }
            for (; d0 < D; d0++) {
                vf a0 = ldv(ot + (size_t)d0 * M + i0), a1 = ldv(ot + (size_t)d0 * M + i0 + VW);
                for (int j = 0; j < nb_pad; j++) {
                    vf b = splat(vb[(size_t)j * D + d0]);
                    a0 = fma_v(b, ldv(sc + (size_t)j * M + i0), a0);
                    a1 = fma_v(b, ldv(sc + (size_t)j * M + i0 + VW), a1);
                }
                stv(ot + (size_t)d0 * M + i0, a0);
                stv(ot + (size_t)d0 * M + i0 + VW, a1);
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int j = 0; j < nr; j++) {
            float inv = 1.f / l[g * BQ + j];
            int64_t base = ((tok + r0 + j) * N + (int64_t)(h * G + g)) * D;
            for (int d = 0; d < D; d++)
                st(out, is_bf16, base + d, ot[(size_t)d * M + g * BQ + j] * inv);
        }
}

/* segs [num_segs, 4]: (tok, t, idx_start, P); see the top of the file. */
int attention_tiles(const void *q, const void *k, const void *v, void *out, const int64_t *index,
                    const int64_t *segs, int num_segs, int N, int K, int D,
                    int64_t slots_per_head, int64_t ld_q, float scale, int is_bf16,
                    int num_threads) {
    int G = N / K, M = G * BQ, failed = NATIVE_OK;
    int64_t num_items = 0, work = 0;
    for (int s = 0; s < num_segs; s++) {
        int64_t t = segs[4 * s + 1];
        num_items += (t + BQ - 1) / BQ * K;
        work += t * (segs[4 * s + 3] + t);
    }
    int64_t *items = malloc(sizeof(int64_t) * 2 * (size_t)(num_items ? num_items : 1));
    if (items == NULL) return NATIVE_NO_MEMORY;
    int64_t n = 0;
    for (int s = 0; s < num_segs; s++) /* the last tiles of a segment (the most keys) first */
        for (int64_t r0 = (segs[4 * s + 1] - 1) / BQ * BQ; r0 >= 0; r0 -= BQ)
            for (int h = 0; h < K; h++) {
                items[2 * n] = s;
                items[2 * n + 1] = r0 * K + h;
                n++;
            }
    if (work * N * D < (1 << 18)) num_threads = 1;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        size_t floats = 2 * (size_t)D * M + (size_t)BK * M + 2 * (size_t)BK * D + 2 * (size_t)M;
        float *buf = aligned_alloc(64, (sizeof(float) * floats + 63) / 64 * 64);
        if (buf == NULL) {
            failed = NATIVE_NO_MEMORY;
        } else {
            float *qt = buf, *ot = qt + (size_t)D * M, *sc = ot + (size_t)D * M;
            float *kb = sc + (size_t)BK * M, *vb = kb + (size_t)BK * D, *m = vb + (size_t)BK * D;
            float *l = m + M;
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < num_items; it++) {
                const int64_t *seg = segs + 4 * items[2 * it];
                int64_t r0 = items[2 * it + 1] / K, t = seg[1];
                int h = (int)(items[2 * it + 1] % K);
                int nr = (int)(t - r0 < BQ ? t - r0 : BQ);
                size_t head = (size_t)h * slots_per_head * D;
                const void *kh = is_bf16 ? (const void *)((const uint16_t *)k + head)
                                         : (const void *)((const float *)k + head);
                const void *vh = is_bf16 ? (const void *)((const uint16_t *)v + head)
                                         : (const void *)((const float *)v + head);
                const int64_t *slots = index + seg[2];
                if (D == 64)
                    tile(q, kh, vh, out, slots, seg[0], seg[3], (int)r0, nr, h, N, G, 64, ld_q,
                         scale, is_bf16, qt, ot, sc, kb, vb, m, l);
                else if (D == 128)
                    tile(q, kh, vh, out, slots, seg[0], seg[3], (int)r0, nr, h, N, G, 128, ld_q,
                         scale, is_bf16, qt, ot, sc, kb, vb, m, l);
                else
                    tile(q, kh, vh, out, slots, seg[0], seg[3], (int)r0, nr, h, N, G, D, ld_q,
                         scale, is_bf16, qt, ot, sc, kb, vb, m, l);
            }
            free(buf);
        }
    }
    free(items);
    return failed;
}
