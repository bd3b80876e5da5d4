/* A decode step's projection and its LoRA (native_api.h). Where an adapter's LoRA is small
 * beside a fork (one or two tokens: `lora_runs` then reads it on one thread, at what one core
 * streams), the GEMV's own threads share it (gpu_lora's lora_parts.c): each computes its rows of
 * the GEMV, its share of the A rows, waits for the others, and adds the expansion into the
 * columns it wrote. Results are bit for bit those of the GEMV followed by `lora_runs`: the GEMV's
 * rows are independent, and lora_parts.c sums as lora_runs does. */
#include "native_api.h"
#include "common.h"
#include <omp.h>

/* y [T, out] (row stride ld_y) = x [T, in] (row stride ld_x) @ W.T, then += bias rounded as
 * torch's in-place add rounds it. */
static int proj_gemv(const Proj *p, const void *x, int64_t ld_x, void *y, int64_t ld_y,
                     int64_t T, int is_bf16, int num_threads) {
    int failed;
    switch (p->kind) {
    case GEMV_F32:
        failed = gemv_f32(x, ld_x, p->w, p->out, p->in, y, ld_y, T, num_threads);
        break;
    case GEMV_BF16:
        failed = gemv_bf16(x, ld_x, p->w, p->out, p->in, y, ld_y, T, num_threads);
        break;
    case GEMV_BF16_TILES:
        failed = gemv_bf16_tiles(x, ld_x, p->w, p->out, p->in, y, ld_y, T, num_threads);
        break;
    case GEMV_F32_AVX2:
        failed = gemv_f32_avx2(x, ld_x, p->w, p->out, p->in, y, ld_y, T, num_threads);
        break;
    case GEMV_BF16_AVX2:
        failed = gemv_bf16_avx2(x, ld_x, p->w, p->out, p->in, y, ld_y, T, num_threads);
        break;
    case GEMV_INT8:
        failed = gemv_int8(x, ld_x, is_bf16, p->w, p->scale, p->out, p->in, y, ld_y, T, 0,
                           num_threads);
        break;
    case GEMV_INT4:
        failed = gemv_int4(x, ld_x, is_bf16, p->w, p->scale, p->offset, p->out, p->in, y, ld_y,
                           T, 0, num_threads);
        break;
    case GEMV_INT4_BF16:
        failed = is_bf16 ? gemv_int4_bf16(x, ld_x, p->w, (const uint32_t *)p->scale, p->out,
                                          p->in, y, ld_y, T, num_threads)
                         : NATIVE_DECLINED;
        break;
    default:
        return NATIVE_DECLINED;
    }
    if (failed || p->bias == NULL) return failed;
    for (int64_t t = 0; t < T; t++)
        for (int64_t o = 0; o < p->out; o++)
            st(y, is_bf16, t * ld_y + o,
               ld(y, is_bf16, t * ld_y + o) + ld(p->bias, is_bf16, o));
    return 0;
}

/* Rows r0 .. r1 of p (16 | both), and the bytes into its output those rows start at. */
static Proj proj_rows(const Proj *p, int64_t r0, int64_t r1, int is_bf16) {
    Proj s = *p;
    int64_t groups = p->in / 32, elem = is_bf16 ? 2 : 4;
    const char *w = p->w;
    switch (p->kind) {
    case GEMV_F32: case GEMV_F32_AVX2: s.w = w + r0 * p->in * 4; break;
    case GEMV_BF16: case GEMV_BF16_AVX2: case GEMV_BF16_TILES: s.w = w + r0 * p->in * 2; break;
    case GEMV_INT8: s.w = w + r0 * p->in, s.scale = p->scale + r0; break;
    case GEMV_INT4:
        s.w = w + r0 * p->in / 2, s.scale = p->scale + r0 * groups;
        s.offset = p->offset + r0 * groups;
        break;
    case GEMV_INT4_BF16: s.w = w + r0 * p->in / 2, s.scale = p->scale + r0 * groups; break;
    }
    if (p->bias != NULL) s.bias = (const char *)p->bias + r0 * elem;
    s.out = r1 - r0;
    return s;
}

/* at's projections (at most 3) as lora_runs takes them, for x [T, H_in]; returns how many. */
static int64_t lora_procs(const LoraAt *at, void *y, int is_bf16, LoraProj *procs, int64_t *cols) {
    const LoraStep *lora = at->lora;
    int64_t n = 0, elem = is_bf16 ? 2 : 4;
    for (int i = 0; i < at->count; i++) {
        const LoraTable *t = &lora->tables[at->first + i];
        if (t->A0 == NULL) continue;
        cols[n] = at->col[i];
        procs[n++] = (LoraProj){t->A0 + at->l * t->a_step, t->B0 + at->l * t->b_step,
                                (char *)y + at->col[i] * elem, t->ranks, 0, at->width[i],
                                t->pool_rows};
    }
    return n;
}

/* Columns c0 .. c1 of p's Bt rows of every run into L2 (prefetches do not fault: the runs are
 * checked after, by the shrinkage). */
static void prefetch_cols(const LoraProj *p, int64_t c0, int64_t c1, const int32_t *offsets,
                          int64_t num_runs, int64_t elem) {
    for (int64_t g = 0; g < num_runs && c1 > c0; g++)
        for (int64_t j = 0; j < p->ranks[g]; j++) {
            const char *row = (const char *)p->Bt + ((int64_t)offsets[g] + j) * p->H_out * elem;
            prefetch_l2(row + c0 * elem, (c1 - c0) * elem);
        }
}

/* The GEMV in `parts` row ranges of 32, each thread its range's LoRA expansion after all the
 * shrinkage (see the file's doc). */
static int proj_lora_parts(const Proj *p, const void *x, int64_t ld_x, void *y, int64_t ld_y,
                           int64_t T, int is_bf16, int parts, const LoraStep *lora,
                           LoraProj *procs, const int64_t *cols, int64_t n) {
    int64_t max_rank = 0, blocks = p->out / 32, elem = is_bf16 ? 2 : 4;
    for (int64_t i = 0; i < n; i++)
        for (int64_t g = 0; g < lora->num_runs; g++)
            max_rank = procs[i].ranks[g] > max_rank ? procs[i].ranks[g] : max_rank;
    int64_t h_len = T * n * 4 * max_rank, xf_len = 4 * p->in, hp_len = 2 * max_rank + 4;
    float *h = malloc(sizeof(float) * (size_t)(h_len + parts * (xf_len + hp_len)));
    if (h == NULL) return NATIVE_NO_MEMORY;
    int failed = NATIVE_OK;
#pragma omp parallel num_threads(parts) reduction(max : failed)
    {
        int k = omp_get_thread_num(), got = omp_get_num_threads();
        int64_t r0 = blocks * k / got * 32, r1 = blocks * (k + 1) / got * 32;
        float *xf = h + h_len + k * (xf_len + hp_len);
        int64_t c0[3], c1[3]; /* r0 .. r1 in each projection's own columns */
        for (int64_t i = 0; i < n; i++) {
            int64_t lo = r0 - cols[i], hi = r1 - cols[i], w = procs[i].H_out;
            c0[i] = lo < 0 ? 0 : lo > w ? w : lo;
            c1[i] = hi < 0 ? 0 : hi > w ? w : hi;
            prefetch_cols(&procs[i], c0[i], c1[i], lora->offsets, lora->num_runs, elem);
        }
        lora->shrink(x, ld_x, p->in, T, procs, n, lora->starts, lora->offsets, lora->scales,
                     lora->num_runs, is_bf16, max_rank, h, NULL, k, got);
        Proj rows = proj_rows(p, r0, r1, is_bf16);
        failed = r1 > r0 ? proj_gemv(&rows, x, ld_x, (char *)y + r0 * elem, ld_y, T, is_bf16, 1)
                         : NATIVE_OK;
        int shrunk = lora->shrink(x, ld_x, p->in, T, procs, n, lora->starts, lora->offsets,
                                  lora->scales, lora->num_runs, is_bf16, max_rank, h, xf, k, got);
        failed = failed > shrunk ? failed : shrunk;
#pragma omp barrier
        if (!failed)
            lora->expand(procs, n, c0, c1, lora->starts, lora->offsets, lora->num_runs, is_bf16,
                         max_rank, h, (uint32_t *)(xf + xf_len));
    }
    free(h);
    return failed;
}

/* y += the host runs' deltas of at's projections (at->lora->host; none: nothing), after the
 * pool's: the runs are disjoint, so each row gets one delta whatever the order. HOST_BATCH
 * projections a lora_runs call. */
#define HOST_BATCH 8
static int host_runs(const LoraAt *at, const void *x, int64_t ld_x, int64_t H_in, int64_t T,
                     const LoraProj *procs, int64_t n, int is_bf16, int num_threads) {
    const LoraHost *host = &at->lora->host;
    return n == 0 ? NATIVE_OK
                  : at->lora->run(x, ld_x, H_in, T, procs, n, host->starts, host->offsets,
                                  host->scales, host->num_runs, is_bf16, num_threads);
}

static int host_lora(const LoraAt *at, const void *x, int64_t ld_x, int64_t H_in, void *y,
                     int64_t ld_y, int64_t T, int is_bf16, int num_threads) {
    const LoraHost *host = &at->lora->host;
    if (host->procs == NULL) return NATIVE_OK;
    LoraProj procs[HOST_BATCH];
    int64_t n = 0, elem = is_bf16 ? 2 : 4;
    for (int i = 0; i < at->count; i++) {
        const LoraProj *slot = host->procs + (at->l * LORA_MODULES + at->first + i) * host->per_slot;
        for (int64_t k = 0; k < host->per_slot; k++) {
            if (slot[k].A == NULL) continue;
            procs[n] = slot[k];
            procs[n].y = (char *)y + at->col[i] * elem;
            procs[n++].ld_y = ld_y;
            if (n < HOST_BATCH) continue;
            int failed = host_runs(at, x, ld_x, H_in, T, procs, n, is_bf16, num_threads);
            if (failed) return failed;
            n = 0;
        }
    }
    return host_runs(at, x, ld_x, H_in, T, procs, n, is_bf16, num_threads);
}

int proj_lora(const Proj *p, const void *x, int64_t ld_x, void *y, int64_t ld_y, int64_t T,
              int is_bf16, int num_threads, const LoraAt *at) {
    LoraProj procs[3];
    int64_t cols[3], n = at == NULL ? 0 : lora_procs(at, y, is_bf16, procs, cols);
    for (int64_t i = 0; i < n; i++) procs[i].ld_y = ld_y;
    int parts = threads_for(p->out * p->in, num_threads), split = n > 0 && parts > 1;
    split = split && at->lora->shrink != NULL && at->lora->expand != NULL && T <= 4 &&
            p->out % 32 == 0 && p->in % 16 == 0;
    for (int64_t i = 0; split && i < n; i++) split = cols[i] % 32 == 0 && procs[i].H_out % 32 == 0;
    int failed;
    if (split) {
        failed = proj_lora_parts(p, x, ld_x, y, ld_y, T, is_bf16, parts, at->lora, procs, cols, n);
    } else {
        failed = proj_gemv(p, x, ld_x, y, ld_y, T, is_bf16, num_threads);
        if (failed || at == NULL) return failed;
        const LoraStep *lora = at->lora;
        if (n > 0)
            failed = lora->run(x, ld_x, p->in, T, procs, n, lora->starts, lora->offsets,
                               lora->scales, lora->num_runs, is_bf16, num_threads);
    }
    if (failed) return failed;
    return host_lora(at, x, ld_x, p->in, y, ld_y, T, is_bf16, num_threads);
}
