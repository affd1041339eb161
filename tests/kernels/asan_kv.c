/* rc_move_slots and rc_copy_positions (kernels/native_kv_moves.c) over every KV cache shape vLLM
 * can pick, each result compared byte for byte with a plain copy over the whole cache; part of
 * the harness of asan_harness.c (asan_harness.h says what they share). */
#include "asan_harness.h"

typedef struct {
    int layout;
    int64_t elem, blocks, H, bs, D;
} kv_shape;

static inline int64_t page_bytes(kv_shape s) { return s.bs * 2 * s.D * s.elem; }
static int64_t cache_bytes(kv_shape s) { return s.blocks * s.H * page_bytes(s); }

/* the element of token t, dimension d, within a (block, head) page, from the page's shape:
 * vec keys [D][bs], values [bs][D]; amx keys [bs / 16][D / 2][16][2], values [D / 16][bs / 2][16][2] */
static inline int64_t at(kv_shape s, int value, int64_t t, int64_t d) {
    if (s.layout == AMX)
        return value ? s.bs * s.D + (((d / 16) * (s.bs / 2) + t / 2) * 16 + d % 16) * 2 + t % 2
                     : (((t / 16) * (s.D / 2) + d / 2) * 16 + t % 16) * 2 + d % 2;
    return value ? s.bs * s.D + t * s.D + d : d * s.bs + t;
}

static inline char *element(char *cache, kv_shape s, int64_t block, int64_t h, int value, int64_t t, int64_t d) {
    return cache + (block * s.H + h) * page_bytes(s) + at(s, value, t, d) * s.elem;
}

/* one element, in a fixed-size copy the compiler inlines (memcpy of a variable size is a call
 * ASan intercepts, which made the references most of the run) */
static inline void copy_elem(char *to, const char *from, int64_t elem) {
    switch (elem) {
    case 4: memcpy(to, from, 4); break;
    case 2: memcpy(to, from, 2); break;
    default: memcpy(to, from, 1);
    }
}

static void move_reference(char *cache, kv_shape s, const int64_t *src, const int64_t *dst, int64_t n) {
    const int64_t row = s.H * 2 * s.D * s.elem;
    char *moved = exact((size_t)(n * row));
    for (int pass = 0; pass < 2; pass++) /* every source read before any destination is written */
        for (int64_t i = 0; i < n; i++) {
            if (src[i] == dst[i]) continue;
            const int64_t slot = pass ? dst[i] : src[i], t = slot % s.bs;
            for (int64_t h = 0; h < s.H; h++) {
                char *page = element(cache, s, slot / s.bs, h, 0, 0, 0);
                for (int v = 0; v < 2; v++) {
                    char *m = moved + i * row + (h * 2 + v) * s.D * s.elem;
                    for (int64_t d = 0; d < s.D; d++) {
                        char *e = page + at(s, v, t, d) * s.elem;
                        if (pass) copy_elem(e, m + d * s.elem, s.elem);
                        else copy_elem(m + d * s.elem, e, s.elem);
                    }
                }
            }
        }
    free(moved);
}

/* n slots moved in the first `layers` of the caches; want: the caches as they should be */
static void move_case(kv_shape s, int64_t n, int64_t layers, int64_t *caches, char **want) {
    const int64_t slots = s.blocks * s.bs, bytes = cache_bytes(s);
    /* the first and last slot of the cache, of its first and last block, then any */
    const int64_t edges[] = {0, s.bs - 1, slots - 1, (s.blocks - 1) * s.bs, s.bs};
    int64_t *src = exact((size_t)(n * 8)), *dst = exact((size_t)(n * 8));
    for (int64_t i = 0; i < n; i++) {
        src[i] = i < 5 ? edges[i] : below(slots);
        dst[i] = i < 5 ? edges[4 - i] : below(slots);
    }
    if (n > 6) dst[6] = src[6]; /* a pair that moves nothing */
    for (int64_t l = 0; l < layers; l++) move_reference(want[l], s, src, dst, n);
    /* native.py's need, filled whole by the sources of a move */
    void *scratch = probed((size_t)(n * s.H * 2 * s.D * s.elem), PROBE_MOVE);
    int rc = rc_move_slots(caches, layers, s.blocks, s.H, s.bs, s.D, s.elem, s.layout, src, dst, n, scratch);
    calls[3]++;
    CHECK(rc == 0, "move: rc %d", rc);
    if (n > 0) { /* a slot outside the caches: refused, nothing written */
        const int64_t bad[] = {-1, slots};
        for (int b = 0; b < 2; b++)
            for (int which = 0; which < 2; which++) {
                int64_t *side = which ? dst : src, saved = side[n - 1];
                side[n - 1] = bad[b];
                rc = rc_move_slots(caches, layers, s.blocks, s.H, s.bs, s.D, s.elem, s.layout, src, dst, n, scratch);
                CHECK(rc == -2, "move: slot %lld: rc %d", (long long)bad[b], rc);
                side[n - 1] = saved;
                calls[3]++;
            }
    }
    for (int64_t l = 0; l < layers; l++)
        CHECK(memcmp((char *)(intptr_t)caches[l], want[l], (size_t)bytes) == 0,
              "move layout %d elem %lld bs %lld D %lld H %lld n %lld: layer %lld differs", s.layout,
              (long long)s.elem, (long long)s.bs, (long long)s.D, (long long)s.H, (long long)n, (long long)l);
    free(scratch), free(src), free(dst);
}

static void copy_reference(char *cache, kv_shape s, const int64_t *src, const int64_t *dst, const int64_t *count,
                           int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        if (count[i] == 0 || src[i] == dst[i]) continue;
        /* amx copies whole groups of 16 tokens of keys and pairs of tokens of values */
        const int64_t upto[2] = {s.layout == AMX ? (count[i] + 15) / 16 * 16 : count[i],
                                 s.layout == AMX ? (count[i] + 1) / 2 * 2 : count[i]};
        for (int64_t h = 0; h < s.H; h++) {
            char *to = element(cache, s, dst[i], h, 0, 0, 0), *from = element(cache, s, src[i], h, 0, 0, 0);
            for (int v = 0; v < 2; v++)
                for (int64_t t = 0; t < upto[v]; t++)
                    for (int64_t d = 0; d < s.D; d++) {
                        const int64_t e = at(s, v, t, d) * s.elem;
                        copy_elem(to + e, from + e, s.elem);
                    }
        }
    }
}

/* n block copies in `cache` (held bytes of it allocated); want: the cache as it should be */
static void copy_case(kv_shape s, int64_t n, char *cache, int64_t held, char *want) {
    const int64_t counts[] = {s.bs, 0, 1, 15, 16, 17, s.bs - 1, 2, 31};
    int64_t *src = exact((size_t)(n * 8)), *dst = exact((size_t)(n * 8)), *count = exact((size_t)(n * 8));
    for (int64_t i = 0; i < n; i++) {
        /* the first: block 0 whole into the last block, to the cache's last byte */
        src[i] = i == 0 ? 0 : i == 1 ? s.blocks - 1 : below(s.blocks);
        dst[i] = i == 0 ? s.blocks - 1 : i == 1 ? 0 : below(s.blocks);
        count[i] = counts[i % 9] <= s.bs ? counts[i % 9] : s.bs;
    }
    copy_reference(want, s, src, dst, count, n);
    int rc = rc_copy_positions(cache, s.blocks, s.H, s.bs, s.D, s.elem, s.layout, src, dst, count, n);
    calls[4]++;
    CHECK(rc == 0, "copy: rc %d", rc);
    if (n > 0) { /* a block outside the cache, or a count outside [0, bs]: refused, nothing copied */
        const int64_t bad[][2] = {{-1, 1}, {s.blocks, 1}, {0, -1}, {0, s.bs + 1}};
        for (int b = 0; b < 4; b++)
            for (int which = 0; which < 2; which++) {
                int64_t *side = b >= 2 ? count : which ? dst : src, saved = side[n - 1];
                side[n - 1] = b >= 2 ? bad[b][1] : bad[b][0];
                rc = rc_copy_positions(cache, s.blocks, s.H, s.bs, s.D, s.elem, s.layout, src, dst, count, n);
                CHECK(rc == -2, "copy: bad argument %d: rc %d", b, rc);
                side[n - 1] = saved;
                calls[4]++;
            }
    }
    CHECK(memcmp(cache, want, (size_t)held) == 0, "copy layout %d elem %lld bs %lld D %lld H %lld n %lld: differs",
          s.layout, (long long)s.elem, (long long)s.bs, (long long)s.D, (long long)s.H, (long long)n);
    free(src), free(dst), free(count);
}

/* one cache shape: moves of n slots (two layers for odd cases), then copies of n blocks, the
 * counts of positions cycling through copy_case's list (n = 9: all of them), each call on the
 * caches as the previous calls left them */
static void kv_shape_cases(kv_shape s) {
    const int64_t bytes = cache_bytes(s), layers = 2;
    int64_t caches[2];
    char *want[2];
    for (int64_t l = 0; l < layers; l++) {
        char *c = exact((size_t)bytes);
        fill_random(c, (size_t)bytes);
        caches[l] = (int64_t)(intptr_t)c;
        want[l] = copy_of(c, (size_t)bytes);
    }
    int64_t *caches_arg = exact((size_t)(layers * 8)); /* the pointer array, exact too */
    memcpy(caches_arg, caches, sizeof caches);
    const int64_t moves[] = {0, 1, 15, 16, 17, s.bs};
    for (int i = 0; i < 6 && RUNS(PROBE_MOVE); i++) move_case(s, moves[i], i % 2 ? 2 : 1, caches_arg, want);
    for (int64_t l = 0; l < layers; l++) free((char *)(intptr_t)caches[l]);
    free(caches_arg);
    /* the copy probe's cache is RC_PROBE_SHORT bytes short; the harness touches only what it holds */
    const int64_t held = bytes - (PROBING(PROBE_COPY) ? RC_PROBE_SHORT : 0);
    char *cache = exact((size_t)held);
    memcpy(cache, want[0], (size_t)held);
    const int64_t copies[] = {0, 1, 2, 9};
    for (int i = 0; i < 4 && RUNS(PROBE_COPY); i++) copy_case(s, copies[i], cache, held, want[0]);
    free(cache), free(want[0]), free(want[1]);
}

void kv_cases(void) {
    const int64_t elems[] = {4, 2, 1}; /* float32; bfloat16 / float16; fp8 (vec only) */
    const int64_t block_sizes[] = {16, 32, 64, 128};
    const int64_t dims[] = {32, 64, 80, 96, 112, 128, 256, 512};
    const int64_t heads[] = {1, 3};
    for (int layout = VEC; layout <= AMX; layout++)
        for (int e = 0; e < 3; e++)
            for (int b = 0; b < 4; b++)
                for (int d = 0; d < 8; d++)
                    for (int h = 0; h < 2; h++) {
                        const kv_shape s = {layout, elems[e], 3, heads[h], block_sizes[b], dims[d]};
                        /* amx: vLLM picks it for 16-bit caches in blocks of a multiple of 32
                         * and head sizes of a multiple of 32 (else vec16); 4-byte amx pages
                         * are run too, the kernels being element-size blind */
                        if (layout == AMX && (s.elem == 1 || s.bs % 32 || s.D % 32)) continue;
                        if (s.D == 512 && s.H > 1) continue; /* time: one head is enough there */
                        kv_shape_cases(s);
                    }
}
