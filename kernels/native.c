/* The matrix update on the CPU: top-k, argmax and probabilities of each verification row,
 * written into the adjacency matrix, in one C call (see native.py for the rules and
 * how this is built; topk_update.py's reference defines the results).
 *
 * Per logits row t (fp32 or bfloat16, unit stride, rows ld elements apart):
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
#include "native_simd.h"

#define BLOCK 256  /* the top-k scan looks at a block element by element only on a hit */
#define MAX_K 64

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

/* Element j of a logits row of fp32 (bf16 = 0) or bfloat16 (bf16 = 1) values, and LANES of them. */
static inline float elem(const void *x, int64_t j, int bf16) {
    if (!bf16) return ((const float *)x)[j];
    uint32_t u = (uint32_t)((const uint16_t *)x)[j] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline vf elems(const void *x, int64_t j, int bf16) {
    if (!bf16) return load((const float *)x + j);
    typedef uint16_t vh __attribute__((vector_size(LANES * 2)));
    typedef uint32_t vu __attribute__((vector_size(LANES * 4)));
    vh h;
    memcpy(&h, (const uint16_t *)x + j, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
}

static void row_topk(const void *x, int bf16, int64_t vocab, int k, float *vals, int32_t *ids) {
    for (int i = 0; i < k; i++) {
        vals[i] = elem(x, i, bf16);
        ids[i] = i;
    }
    int w = worst_of(vals, ids, k);
    float worst = vals[w];
    for (int64_t j = k; j < vocab;) {
        int64_t end = j + BLOCK - j % BLOCK;
        if (end > vocab) end = vocab;
        if (j % BLOCK == 0 && end - j == BLOCK) { /* a whole block: one vector max first */
            vf m = elems(x, j, bf16);
            for (int64_t l = LANES; l < BLOCK; l += LANES) m = vmax(m, elems(x, j + l, bf16));
            float top = m[0];
            for (int l = 1; l < LANES; l++) top = m[l] > top ? m[l] : top;
            if (!(top > worst)) {
                j = end;
                continue;
            }
        }
        for (; j < end; j++) {
            float v = elem(x, j, bf16);
            if (v > worst) {
                vals[w] = v;
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

static float row_sum_exp(const void *x, int bf16, int64_t vocab, float max) {
    vf acc = splat(0.0f), shift = splat(max);
    int64_t j = 0;
    for (; j + LANES <= vocab; j += LANES) acc += vexp_nonpositive(elems(x, j, bf16) - shift);
    float z = 0.0f;
    for (; j < vocab; j++) z += exp_nonpositive(elem(x, j, bf16) - max);
    for (int l = 0; l < LANES; l++) z += acc[l];
    return z;
}

/* Returns 0; -1 when k is out of range, -2 when a destination row or key index is out of
 * range (nothing written then). */
int rc_topk_update(const void *logits, int bf16, int64_t num_rows, int64_t vocab, int64_t ld, int64_t k,
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
        const void *x = (const char *)logits + t * ld * (bf16 ? 2 : 4);
        row_topk(x, bf16, vocab, (int)k, vals, ids);
        argmax[t] = ids[0];
        if (want_probs) {
            float z = row_sum_exp(x, bf16, vocab, vals[0]);
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
