/* The accepted tree nodes' KV moves in C, every layer's cache in one call (see native.py for how
 * this is built; cpu_attention.move_slots, PyTorch, is the same per layer). The page layouts,
 * key_at and value_at are in native_kv_layout.h. */
#include "native_kv_layout.h"

/* The accepted tree nodes' keys and values moved to their positions' slots, in every layer's
 * cache at once: caches[l] is layer l's [num_blocks, H, bs, 2 D] cache of elem-byte elements in
 * `layout` (native_kv_layout.h); slot src[i] is copied to slot dst[i], every source read before
 * any destination is written (a layer's moved rows go through the scratch buffer [n, H, 2, D]);
 * a pair with src[i] == dst[i] is skipped. Returns -2 for a slot outside the caches. */
int rc_move_slots(const int64_t *caches, int64_t num_layers, int64_t num_blocks, int64_t H,
                  int64_t bs, int64_t D, int64_t elem, int layout, const int64_t *src,
                  const int64_t *dst, int64_t n, void *scratch) {
    const int64_t slots = num_blocks * bs;
    for (int64_t i = 0; i < n; i++)
        if (src[i] < 0 || src[i] >= slots || dst[i] < 0 || dst[i] >= slots) return -2;
    const int64_t page = bs * 2 * D * elem; /* bytes of one (block, head) page */
    char *tmp = (char *)scratch;
    for (int64_t l = 0; l < num_layers; l++) {
        char *cache = (char *)(intptr_t)caches[l];
        for (int64_t i = 0; i < n; i++) {
            if (src[i] == dst[i]) continue; /* a pair that moves nothing */
            const int64_t blk = src[i] / bs, off = src[i] % bs;
            for (int64_t h = 0; h < H; h++) {
                const char *p = cache + (blk * H + h) * page;
                char *t = tmp + (i * H + h) * 2 * D * elem;
                for (int64_t d = 0; d < D; d++) {
                    memcpy(t + d * elem, p + key_at(layout, bs, D, off, d) * elem, elem);
                    memcpy(t + (D + d) * elem, p + (bs * D + value_at(layout, bs, D, off, d)) * elem, elem);
                }
            }
        }
        for (int64_t i = 0; i < n; i++) {
            if (src[i] == dst[i]) continue;
            const int64_t blk = dst[i] / bs, off = dst[i] % bs;
            for (int64_t h = 0; h < H; h++) {
                char *p = cache + (blk * H + h) * page;
                const char *t = tmp + (i * H + h) * 2 * D * elem;
                for (int64_t d = 0; d < D; d++) {
                    memcpy(p + key_at(layout, bs, D, off, d) * elem, t + d * elem, elem);
                    memcpy(p + (bs * D + value_at(layout, bs, D, off, d)) * elem, t + (D + d) * elem, elem);
                }
            }
        }
    }
    return 0;
}

/* The first count[i] positions of block src[i] copied to block dst[i] in one layer's cache
 * (cache: [num_blocks, H, bs, 2 D] of elem-byte elements in `layout`, native_kv_layout.h), keys
 * and values, in runs of consecutive elements: vec keys are D runs of count, vec values one run
 * of count * D; amx keys whole groups of 16 tokens (count rounded up to 16), amx values D / 16
 * runs of pairs of tokens (count rounded up to 2). The positions past count that a rounded-up
 * run also copies are past what a tree pass reads before writing them. Returns -2 for a block
 * outside the cache or a count above bs (nothing is copied). */
int rc_copy_positions(void *cache, int64_t num_blocks, int64_t H, int64_t bs, int64_t D, int64_t elem, int layout,
                      const int64_t *src, const int64_t *dst, const int64_t *count, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (src[i] < 0 || src[i] >= num_blocks || dst[i] < 0 || dst[i] >= num_blocks || count[i] < 0 ||
            count[i] > bs)
            return -2;
    const int64_t page = bs * 2 * D * elem; /* bytes of one (block, head) page */
    for (int64_t i = 0; i < n; i++) {
        const int64_t c = count[i];
        if (c == 0 || src[i] == dst[i]) continue;
        for (int64_t h = 0; h < H; h++) {
            const char *from = (const char *)cache + (src[i] * H + h) * page;
            char *to = (char *)cache + (dst[i] * H + h) * page;
            const int64_t values = bs * D * elem; /* the values follow the keys */
            if (layout == LAYOUT_AMX) {
                const int64_t groups = (c + 15) / 16, pairs = (c + 1) / 2;
                memcpy(to, from, groups * 16 * D * elem);
                for (int64_t g = 0; g < D / 16; g++)
                    memcpy(to + values + g * bs * 16 * elem, from + values + g * bs * 16 * elem, pairs * 32 * elem);
            } else {
                for (int64_t d = 0; d < D; d++) memcpy(to + d * bs * elem, from + d * bs * elem, c * elem);
                memcpy(to + values, from + values, c * D * elem);
            }
        }
    }
    return 0;
}
