/* Every exported rc_* kernel (kernels/native.c, kernels/native_kv_moves.c) called over the shape
 * families vLLM can pick, under AddressSanitizer and UBSan (tests/kernels/test_native_asan.py
 * builds and runs this). Every buffer is a malloc of exactly the bytes the kernel may touch under
 * the contract native.py's wrappers keep, so a byte read or written past one is a
 * heap-buffer-overflow report. Beyond memory, each call's results are checked against a plain
 * loop here (the KV kernels byte for byte over the whole cache, which also catches a write into
 * a neighbouring page of the same buffer, invisible to ASan).
 *
 * -DRC_ASAN_PROBE=PROBE_<kernel> (asan_harness.h): only that kernel's cases, with one buffer it
 * writes (rc_copy_positions: its cache) RC_PROBE_SHORT bytes short, so the run must end in ASan's
 * report from inside that kernel; the harness's own reads and writes come after the kernel's
 * or keep to what was allocated.
 *
 * The KV kernels' cases are in asan_kv.c, what both files share in asan_harness.h. Prints one
 * summary line and exits 0, or 1 after reporting each mismatch. */
#include "asan_harness.h"

int failures;
long calls[5];

void *exact(size_t bytes) {
    void *p = malloc(bytes);
    if (!p && bytes) {
        perror("malloc");
        exit(2);
    }
    return p;
}

void *probed(size_t bytes, int kernel) {
    return exact(PROBING(kernel) && bytes >= RC_PROBE_SHORT ? bytes - RC_PROBE_SHORT : bytes);
}

static uint64_t rng = 0x9e3779b97f4a7c15u;
uint64_t next(void) { /* xorshift64* */
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    return rng * 0x2545f4914f6cdd1du;
}
int64_t below(int64_t n) { return n > 0 ? (int64_t)(next() % (uint64_t)n) : 0; }

void fill_random(void *p, size_t bytes) {
    for (size_t i = 0; i < bytes; i += 8) {
        const uint64_t r = next();
        memcpy((char *)p + i, &r, bytes - i < 8 ? bytes - i : 8);
    }
}

void *copy_of(const void *p, size_t bytes) {
    void *q = exact(bytes);
    if (bytes) memcpy(q, p, bytes);
    return q;
}

/* ---- rc_topk_update --------------------------------------------------------------------- */

static float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint16_t float_to_bf16(float f) { /* truncation: any bfloat16 value will do */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

static float logit(const void *x, int bf16, int64_t i) {
    return bf16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

static int ranks_before(float va, int64_t ia, float vb, int64_t ib) { return va > vb || (va == vb && ia < ib); }

/* rows [num_rows, ld] (the last row only vocab long); ties: values from a few integers */
static void topk_case(int64_t vocab, int bf16, int64_t num_rows, int64_t ld, int64_t k, int ties) {
    const int64_t esize = bf16 ? 2 : 4, num_dest = 2, table_rows = 5, num_keys = 3;
    const int64_t n_logits = num_rows ? (num_rows - 1) * ld + vocab : 0;
    void *logits = exact((size_t)(n_logits * esize));
    for (int64_t i = 0; i < n_logits; i++) {
        float v = ties ? (float)(below(7) - 3) : (float)(below(2000001) - 1000000) * 1e-5f;
        if (bf16) ((uint16_t *)logits)[i] = float_to_bf16(v);
        else ((float *)logits)[i] = v;
    }
    /* the maximum at a row's last element (the block tail), and at its first */
    if (num_rows > 0) {
        if (bf16) ((uint16_t *)logits)[vocab - 1] = float_to_bf16(50.0f);
        else ((float *)logits)[vocab - 1] = 50.0f;
    }
    if (num_rows > 1) {
        if (bf16) ((uint16_t *)logits)[ld] = float_to_bf16(60.0f);
        else ((float *)logits)[ld] = 60.0f;
    }
    int64_t *dest = exact((size_t)(num_rows * num_dest * 8));
    for (int64_t i = 0; i < num_rows * num_dest; i++) dest[i] = below(table_rows + 1) - 1; /* -1: none */
    if (num_rows > 2) dest[0] = dest[2 * num_dest - 1] = table_rows - 1; /* a row written twice */
    const size_t table_bytes = (size_t)(table_rows * k * 4), probs_bytes = (size_t)(table_rows * k * 2);
    int32_t *table = exact(table_bytes);
    half_t *probs = exact(probs_bytes);
    int32_t *topk_out = exact((size_t)(num_rows * k * 4));
    half_t *probs_out = exact((size_t)(num_rows * k * 2));
    int32_t *keys = exact((size_t)(num_keys * 4));
    int64_t *key_index = exact((size_t)(num_rows * 8));
    int32_t *key_value = exact((size_t)(num_rows * 4));
    int64_t *argmax = probed((size_t)(num_rows * 8), PROBE_TOPK); /* written for every row */
    fill_random(table, table_bytes);
    memset(probs, 0, probs_bytes);
    for (int64_t i = 0; i < num_keys; i++) keys[i] = -1;
    for (int64_t t = 0; t < num_rows; t++) {
        key_index[t] = t == 0 ? num_keys - 1 : below(num_keys);
        key_value[t] = (int32_t)below(vocab);
    }
    int32_t *table_before = copy_of(table, table_bytes);

    /* with every output, then the bare minimum (no probabilities, no keys) */
    for (int full = 1; full >= 0; full--) {
        int rc = rc_topk_update(logits, bf16, num_rows, vocab, ld, k, dest, num_dest, table, table_rows,
                                full ? probs : 0, topk_out, full ? probs_out : 0, full ? keys : 0,
                                num_keys, full ? key_index : 0, full ? key_value : 0, argmax);
        calls[0]++;
        CHECK(rc == 0, "topk V=%lld k=%lld bf16=%d: rc %d", (long long)vocab, (long long)k, bf16, rc);
    }
    for (int64_t t = 0; t < num_rows; t++) {
        const void *x = (const char *)logits + t * ld * esize;
        const int32_t *ids = topk_out + t * k;
        int64_t best = 0;
        for (int64_t j = 1; j < vocab; j++)
            if (logit(x, bf16, j) > logit(x, bf16, best)) best = j;
        CHECK(argmax[t] == best && ids[0] == best, "topk V=%lld row %lld: argmax %lld / %d, want %lld",
              (long long)vocab, (long long)t, (long long)argmax[t], ids[0], (long long)best);
        int ordered = 1;
        for (int64_t i = 0; i < k; i++) {
            ordered &= ids[i] >= 0 && ids[i] < vocab;
            if (ordered && i > 0)
                ordered &= ranks_before(logit(x, bf16, ids[i - 1]), ids[i - 1], logit(x, bf16, ids[i]), ids[i]);
        }
        CHECK(ordered, "topk V=%lld k=%lld row %lld: ids out of order or range", (long long)vocab, (long long)k,
              (long long)t);
        if (!ordered) continue;
        /* the list is the top k: exactly k - 1 elements rank before its last */
        const float last = logit(x, bf16, ids[k - 1]);
        int64_t ahead = 0;
        for (int64_t j = 0; j < vocab; j++) ahead += ranks_before(logit(x, bf16, j), j, last, ids[k - 1]);
        CHECK(ahead == k - 1, "topk V=%lld k=%lld row %lld: %lld ahead of the k-th", (long long)vocab,
              (long long)k, (long long)t, (long long)ahead);
        for (int64_t i = 0; i < k; i++)
            CHECK(probs_out[t * k + i] >= 0 && probs_out[t * k + i] <= 1, "topk: probability out of [0, 1]");
    }
    /* each destination row holds its last writer's list */
    for (int64_t row = 0; row < table_rows; row++) {
        int64_t writer = -1;
        for (int64_t i = 0; i < num_rows * num_dest; i++)
            if (dest[i] == row) writer = i / num_dest;
        const int32_t *want = writer >= 0 ? topk_out + writer * k : table_before + row * k;
        CHECK(memcmp(table + row * k, want, (size_t)(k * 4)) == 0, "topk: table row %lld", (long long)row);
    }
    if (num_rows > 0) {
        CHECK(keys[key_index[num_rows - 1]] == key_value[num_rows - 1], "topk: overlay key not written");
        /* refusals, with nothing written */
        int32_t *table_after = copy_of(table, table_bytes);
        int64_t saved_dest = dest[num_rows * num_dest - 1], saved_key = key_index[num_rows - 1];
        dest[num_rows * num_dest - 1] = table_rows;
        int rc = rc_topk_update(logits, bf16, num_rows, vocab, ld, k, dest, num_dest, table, table_rows, probs,
                                topk_out, probs_out, 0, 0, 0, 0, argmax);
        CHECK(rc == -2, "topk: destination past the table: rc %d", rc);
        dest[num_rows * num_dest - 1] = saved_dest;
        const int64_t bad_keys[] = {-1, num_keys};
        for (int b = 0; b < 2; b++) {
            key_index[num_rows - 1] = bad_keys[b];
            rc = rc_topk_update(logits, bf16, num_rows, vocab, ld, k, dest, num_dest, table, table_rows, probs,
                                topk_out, probs_out, keys, num_keys, key_index, key_value, argmax);
            CHECK(rc == -2, "topk: key index %lld: rc %d", (long long)bad_keys[b], rc);
        }
        key_index[num_rows - 1] = saved_key;
        const int64_t bad_k[] = {0, MAX_K + 1, vocab + 1};
        for (int b = 0; b < 3; b++) {
            rc = rc_topk_update(logits, bf16, num_rows, vocab, ld, bad_k[b], dest, num_dest, table, table_rows,
                                0, 0, 0, 0, 0, 0, 0, argmax);
            CHECK(rc == -1, "topk: k = %lld: rc %d", (long long)bad_k[b], rc);
        }
        calls[0] += 6;
        CHECK(memcmp(table, table_after, table_bytes) == 0, "topk: a refused call wrote the table");
        free(table_after);
    }
    free(logits), free(dest), free(table), free(probs), free(topk_out), free(probs_out), free(keys);
    free(key_index), free(key_value), free(argmax), free(table_before);
}

static void topk_cases(void) {
    const int64_t vocabs[] = {1, 5, 16, 255, 256, 257, 1000, 49152, 151936};
    const int64_t ks[] = {1, 8, 64};
    for (int v = 0; v < 9; v++)
        for (int bf16 = 0; bf16 <= 1; bf16++)
            for (int ki = 0; ki < 3; ki++) {
                const int64_t vocab = vocabs[v], k = ks[ki];
                if (k > vocab) continue;
                const int64_t rows = vocab > 50000 ? 2 : 3;
                topk_case(vocab, bf16, rows, vocab, k, 0);           /* rows back to back */
                topk_case(vocab, bf16, rows, vocab + 3, k, ki == 1); /* padded rows, ties */
            }
    topk_case(1000, 0, 0, 1000, 8, 0); /* no rows */
    topk_case(1000, 1, 1, 1000, 1, 1);
}

/* ---- rc_draft --------------------------------------------------------------------------- */

/* scope 0: one shared matrix; 1: a matrix per request (row_base); 2: shared plus an overlay of
 * `size` entries per request */
static void draft_case(int64_t batch, int64_t num_nodes, int64_t k, int scope, int64_t size, int with_probs) {
    const int64_t V = 50;
    const int64_t matrix_rows = scope == 1 ? (batch ? batch : 1) * V : V;
    const int64_t entries = scope == 2 ? batch * size : 0, table_rows = matrix_rows + entries;
    int32_t *table = exact((size_t)(table_rows * k * 4));
    half_t *probs = with_probs ? exact((size_t)(table_rows * k * 2)) : 0;
    for (int64_t i = 0; i < table_rows * k; i++) {
        table[i] = (int32_t)below(V);
        if (probs) probs[i] = (half_t)((float)below(1000) / 1000.0f);
    }
    int64_t *roots = exact((size_t)(batch * 8)), *parent = exact((size_t)(num_nodes * 8));
    int64_t *rank = exact((size_t)(num_nodes * 8));
    int64_t *row_base = scope == 1 ? exact((size_t)(batch * 8)) : 0;
    int32_t *keys = scope == 2 ? exact((size_t)(entries * 4)) : 0;
    int64_t *key_base = scope == 2 ? exact((size_t)(batch * 8)) : 0;
    for (int64_t b = 0; b < batch; b++) {
        roots[b] = b == 0 ? V - 1 : below(V);
        if (row_base) row_base[b] = b * V;
        if (key_base) key_base[b] = b * size;
    }
    for (int64_t e = 0; e < entries; e++) { /* a token whose entry this is, or -1 (empty) */
        int32_t t = (int32_t)(below(V / size + 1) * size + e % size);
        keys[e] = below(3) == 0 || t >= V ? -1 : t;
    }
    for (int64_t i = 0; i < num_nodes; i++) {
        parent[i] = i ? below(i) : -1;
        rank[i] = i ? below(k) : 0;
    }
    int32_t *tokens = probed((size_t)(batch * num_nodes * 4), PROBE_DRAFT); /* every node written */
    float *conf = with_probs ? exact((size_t)(batch * num_nodes * 4)) : 0;
    const int64_t offset = matrix_rows;
    int rc = rc_draft(table, table_rows, k, probs, roots, batch, parent, rank, num_nodes, row_base, keys,
                      key_base, offset, size, tokens, conf);
    calls[1]++;
    CHECK(rc == 0, "draft B=%lld N=%lld: rc %d", (long long)batch, (long long)num_nodes, rc);
    for (int64_t b = 0; b < batch; b++) {
        const int32_t *tok = tokens + b * num_nodes;
        CHECK(tok[0] == roots[b] && (!conf || conf[b * num_nodes] == 1.0f), "draft: root of request %lld",
              (long long)b);
        for (int64_t i = 1; i < num_nodes; i++) {
            const int64_t t = tok[parent[i]];
            int64_t row = (row_base ? row_base[b] : 0) + t;
            if (keys && keys[key_base[b] + t % size] == t) row = offset + key_base[b] + t % size;
            CHECK(tok[i] == table[row * k + rank[i]], "draft: request %lld node %lld", (long long)b, (long long)i);
            if (conf)
                CHECK(conf[b * num_nodes + i] == (float)probs[row * k + rank[i]], "draft: conf of node %lld",
                      (long long)i);
        }
    }
    if (batch > 0 && num_nodes > 1 && scope != 2) { /* a token past the table: refused */
        const int64_t saved = roots[batch - 1];
        roots[batch - 1] = table_rows - (row_base ? row_base[batch - 1] : 0);
        rc = rc_draft(table, table_rows, k, probs, roots, batch, parent, rank, num_nodes, row_base, keys,
                      key_base, offset, size, tokens, conf);
        CHECK(rc == -2, "draft: a row past the table: rc %d", rc);
        roots[batch - 1] = -1 - (row_base ? row_base[batch - 1] : 0);
        rc = rc_draft(table, table_rows, k, probs, roots, batch, parent, rank, num_nodes, row_base, keys,
                      key_base, offset, size, tokens, conf);
        CHECK(rc == -2, "draft: row -1: rc %d", rc);
        roots[batch - 1] = saved;
        calls[1] += 2;
    }
    free(table), free(probs), free(roots), free(parent), free(rank), free(row_base), free(keys);
    free(key_base), free(tokens), free(conf);
}

static void draft_cases(void) {
    const int64_t batches[] = {0, 1, 3}, nodes[] = {1, 2, 7, 40}, ks[] = {1, 4, 8}, sizes[] = {1, 4, 8};
    for (int b = 0; b < 3; b++)
        for (int n = 0; n < 4; n++)
            for (int ki = 0; ki < 3; ki++)
                for (int scope = 0; scope < 3; scope++)
                    for (int with_probs = 0; with_probs <= 1; with_probs++)
                        draft_case(batches[b], nodes[n], ks[ki], scope, scope == 2 ? sizes[ki] : 0, with_probs);
}

/* ---- rc_context_match ------------------------------------------------------------------- */

static void context_case(int64_t batch, int64_t ld, int64_t min_n, int64_t max_n, int64_t length, int alphabet) {
    const int64_t R = 3;
    int32_t *hist = exact((size_t)(R * ld * 4));
    for (int64_t i = 0; i < R * ld; i++) hist[i] = alphabet ? (int32_t)below(alphabet) : (int32_t)(i % 5);
    int64_t *rows = exact((size_t)(batch * 8)), *num_tokens = exact((size_t)(batch * 8));
    const int64_t lens[] = {0, 1, 2, 3, ld - 1, ld};
    for (int64_t b = 0; b < batch; b++) {
        rows[b] = b == 0 ? R - 1 : below(R); /* the last row, to its last element */
        num_tokens[b] = b == 0 ? ld : lens[below(6)];
        if (num_tokens[b] > ld) num_tokens[b] = ld; /* a history is at most its row */
    }
    const int64_t lps_n = max_n > 1 ? max_n : 1; /* native.py: max(max_n, 1) */
    int64_t *lps = exact((size_t)(lps_n * 8)), *out = exact((size_t)(batch * length * 8));
    int64_t *match_len = probed((size_t)(batch * 8), PROBE_CONTEXT); /* every request's */
    int rc = rc_context_match(hist, ld, rows, num_tokens, batch, min_n, max_n, length, lps, out, match_len);
    calls[2]++;
    CHECK(rc == 0, "context: rc %d", rc);
    for (int64_t b = 0; b < batch; b++) { /* the longest n, then the most recent occurrence */
        const int32_t *h = hist + rows[b] * ld;
        const int64_t N = num_tokens[b];
        int64_t want_n = 0, start = 0;
        for (int64_t n = (max_n < N - 1 ? max_n : N - 1); n >= min_n && !want_n; n--)
            for (int64_t s = N - 1 - n; s >= 0; s--)
                if (memcmp(h + s, h + N - n, (size_t)(n * 4)) == 0) {
                    want_n = n;
                    start = s + n;
                    break;
                }
        CHECK(match_len[b] == want_n, "context: request %lld: n %lld, want %lld", (long long)b,
              (long long)match_len[b], (long long)want_n);
        for (int64_t j = 0; j < length; j++) {
            const int64_t want = want_n && start + j < N ? h[start + j] : -1;
            CHECK(out[b * length + j] == want, "context: request %lld token %lld", (long long)b, (long long)j);
        }
    }
    rc = rc_context_match(hist, ld, rows, num_tokens, batch, 0, max_n, length, lps, out, match_len);
    CHECK(rc == -1, "context: min_n 0: rc %d", rc);
    rc = rc_context_match(hist, ld, rows, num_tokens, batch, min_n, 0, length, lps, out, match_len);
    CHECK(rc == -1, "context: max_n 0: rc %d", rc);
    calls[2] += 2;
    free(hist), free(rows), free(num_tokens), free(lps), free(out), free(match_len);
}

static void context_cases(void) {
    const int64_t lds[] = {1, 2, 3, 8, 33, 200};
    const int64_t ns[][2] = {{1, 1}, {1, 3}, {2, 5}, {3, 2}, {1, 64}, {4, 250}};
    const int64_t lengths[] = {0, 1, 5};
    for (int l = 0; l < 6; l++)
        for (int n = 0; n < 6; n++)
            for (int len = 0; len < 3; len++)
                for (int alphabet = 0; alphabet < 3; alphabet++) /* periodic, 1 token, 2 tokens */
                    for (int64_t batch = 0; batch <= 4; batch += 2)
                        context_case(batch, lds[l], ns[n][0], ns[n][1], lengths[len], alphabet);
}

int main(void) {
    if (RUNS(PROBE_TOPK)) topk_cases();
    if (RUNS(PROBE_DRAFT)) draft_cases();
    if (RUNS(PROBE_CONTEXT)) context_cases();
    if (RUNS(PROBE_MOVE) || RUNS(PROBE_COPY)) kv_cases();
    printf("asan harness: %ld topk_update, %ld draft, %ld context_match, %ld move_slots, %ld copy_positions "
           "calls, %d mismatches\n",
           calls[0], calls[1], calls[2], calls[3], calls[4], failures);
    return failures ? 1 : 0;
}
