/* Tree attention's AMX tile products (native_attention.c calls them; the page layouts are in
 * native_attention.h): the amx layout's bfloat16 pages multiplied as they are, 16 x 16 x 32 per
 * instruction, the arithmetic of vLLM's own AMX kernel (cpu_attn_amx.hpp): raw bfloat16 q and k,
 * fp32 sums, the scale applied to the scores, probabilities rounded to bfloat16 for P V. Up to 32
 * query rows (two blocks of 16), eight tiles of 16 rows x 64 bytes:
 *   S = Q K: A tiles 0, 1 (q rows, 32 dimensions), B tiles 2, 3 (a key group of 16 tokens is
 *     [D / 2, 16, 2]: D / 32 B tiles), C tiles 4-7 (2 row blocks x 2 token groups);
 *   O += P V: A tiles 0, 1 (p rows, 32 positions), B tiles 2, 3 (a value group of 16 dimensions
 *     is [bs / 2, 16, 2]: one B tile per 32 positions), C tiles 4-7 (2 row blocks x 2 dimension
 *     groups) loaded from and stored to acc.
 * Built without AMX (no __AMX_TILE__ / __AMX_BF16__), only rc_tree_attention_amx, answering 0. */
#define _GNU_SOURCE /* syscall */
#include "native_attention.h"

#if HAVE_AMX
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

struct tile_config {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static int amx_state = -1; /* -1 not asked yet, 0 refused, 1 granted */

/* Ask Linux for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), once
 * per process; torch and oneDNN ask the same, a grant is for every thread. */
static int amx_granted(void) {
    if (amx_state < 0) amx_state = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return amx_state;
}

/* Tiles 0-7: 16 rows x 64 bytes. A constant, not built on the stack: GCC 12's _tile_loadconfig
 * tells the compiler it reads only the first 8 bytes, so the stores of rows and colsb to a local
 * may be dropped as dead (they were once amx_configure was no longer inlined into its caller,
 * and ldtilecfg faulted on the garbage left there). */
static const struct tile_config tiles_16x64 = {
    .palette_id = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

void amx_configure(void) { _tile_loadconfig(&tiles_16x64); }

void amx_release(void) { _tile_release(); }

/* s[32, ls] = Q K for a page's token groups [0, groups); qb [32, D] bfloat16 */
void amx_scores(const uint16_t *qb, int64_t D, const uint16_t *kpage, int64_t groups, int two_blocks,
                float *s, int64_t ls) {
    const int64_t qs = D * 2, ss = ls * 4;
    for (int64_t g = 0; g < groups; g += 2) {
        const int pair = g + 1 < groups;
        _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
        for (int64_t kc = 0; kc < D / 32; kc++) {
            _tile_loadd(0, qb + kc * 32, qs);
            _tile_loadd(2, kpage + g * 16 * D + kc * 512, 64);
            _tile_dpbf16ps(4, 0, 2);
            if (pair) {
                _tile_loadd(3, kpage + (g + 1) * 16 * D + kc * 512, 64);
                _tile_dpbf16ps(5, 0, 3);
            }
            if (two_blocks) {
                _tile_loadd(1, qb + 16 * D + kc * 32, qs);
                _tile_dpbf16ps(6, 1, 2);
                if (pair) _tile_dpbf16ps(7, 1, 3);
            }
        }
        _tile_stored(4, s + g * 16, ss);
        if (pair) _tile_stored(5, s + (g + 1) * 16, ss);
        if (two_blocks) {
            _tile_stored(6, s + 16 * ls + g * 16, ss);
            if (pair) _tile_stored(7, s + 16 * ls + (g + 1) * 16, ss);
        }
    }
}

/* acc[32, D] += P V over a page's positions [0, n): pb [32, ls] bfloat16 (zero from n to the
 * next multiple of 32). The last 32 positions' value tiles, when they reach past n, are copied
 * to tail with the positions past n zeroed: whatever the cache holds there (NaN included) never
 * reaches acc. */
void amx_values(const uint16_t *pb, int64_t ls, const uint16_t *vpage, int64_t bs, int64_t D, int64_t n,
                int two_blocks, float *acc, uint16_t *tail) {
    const int64_t chunks = (n + 31) / 32, as = D * 4, ps = ls * 2;
    const int64_t cut = n % 32; /* positions of the last chunk that are real; 0: all 32 */
    if (cut)
        for (int64_t g = 0; g < D / 16; g++) {
            const uint16_t *src = vpage + g * bs * 16 + (chunks - 1) * 512;
            uint16_t *dst = tail + g * 512;
            for (int64_t u = 0; u < 16; u++)
                for (int64_t e = 0; e < 32; e++) dst[u * 32 + e] = 2 * u + e % 2 < cut ? src[u * 32 + e] : 0;
        }
    /* GCC's tile loads are asm that does not say it reads memory: the stores to tail must not
     * move past them */
    __asm__ volatile("" ::: "memory");
    for (int64_t g = 0; g < D / 16; g += 2) {
        _tile_loadd(4, acc + g * 16, as);
        _tile_loadd(5, acc + (g + 1) * 16, as);
        if (two_blocks) {
            _tile_loadd(6, acc + 16 * D + g * 16, as);
            _tile_loadd(7, acc + 16 * D + (g + 1) * 16, as);
        }
        for (int64_t c = 0; c < chunks; c++) {
            const int last = cut && c == chunks - 1;
            const uint16_t *b0 = last ? tail + g * 512 : vpage + g * bs * 16 + c * 512;
            const uint16_t *b1 = last ? tail + (g + 1) * 512 : vpage + (g + 1) * bs * 16 + c * 512;
            _tile_loadd(0, pb + c * 32, ps);
            _tile_loadd(2, b0, 64);
            _tile_loadd(3, b1, 64);
            _tile_dpbf16ps(4, 0, 2);
            _tile_dpbf16ps(5, 0, 3);
            if (two_blocks) {
                _tile_loadd(1, pb + 16 * ls + c * 32, ps);
                _tile_dpbf16ps(6, 1, 2);
                _tile_dpbf16ps(7, 1, 3);
            }
        }
        _tile_stored(4, acc + g * 16, as);
        _tile_stored(5, acc + (g + 1) * 16, as);
        if (two_blocks) {
            _tile_stored(6, acc + 16 * D + g * 16, as);
            _tile_stored(7, acc + 16 * D + (g + 1) * 16, as);
        }
    }
}
#endif

/* Whether tree attention multiplies the amx layout's bfloat16 pages with AMX tiles here (built
 * for an AMX CPU, and Linux grants the tile state); else those pages are converted to fp32. */
int rc_tree_attention_amx(void) {
#if HAVE_AMX
    return amx_granted();
#else
    return 0;
#endif
}
