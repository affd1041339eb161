/* What tests/kernels/asan_harness.c and asan_kv.c share: the exported rc_* kernels' prototypes,
 * the layouts, the probe's shortfall, the mismatch counter and the exact-size allocations. */
#ifndef RC_ASAN_HARNESS_H
#define RC_ASAN_HARNESS_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef _Float16 half_t;

int rc_topk_update(const void *logits, int bf16, int64_t num_rows, int64_t vocab, int64_t ld, int64_t k,
                   const int64_t *dest, int64_t num_dest, int32_t *table, int64_t table_rows,
                   half_t *probs, int32_t *topk_out, half_t *probs_out, int32_t *keys,
                   int64_t num_keys, const int64_t *key_index, const int32_t *key_value,
                   int64_t *argmax);
int rc_draft(const int32_t *table, int64_t table_rows, int64_t k, const half_t *probs,
             const int64_t *roots, int64_t batch, const int64_t *parent, const int64_t *rank,
             int64_t num_nodes, const int64_t *row_base, const int32_t *keys,
             const int64_t *key_base, int64_t offset, int64_t size, int32_t *tokens, float *conf);
int rc_context_match(const int32_t *hist, int64_t ld, const int64_t *rows, const int64_t *num_tokens,
                     int64_t batch, int64_t min_n, int64_t max_n, int64_t length, int64_t *lps,
                     int64_t *out, int64_t *match_len);
int rc_move_slots(const int64_t *caches, int64_t num_layers, int64_t num_blocks, int64_t H,
                  int64_t bs, int64_t D, int64_t elem, int layout, const int64_t *src,
                  const int64_t *dst, int64_t n, void *scratch);
int rc_copy_positions(void *cache, int64_t num_blocks, int64_t H, int64_t bs, int64_t D, int64_t elem, int layout,
                      const int64_t *src, const int64_t *dst, const int64_t *count, int64_t n);

#define MAX_K 64 /* native.c */
enum { VEC = 0, AMX = 1 }; /* native_kv_layout.h: LAYOUT_VEC, LAYOUT_AMX */

/* -DRC_ASAN_PROBE=PROBE_<kernel>: that kernel's cases alone, one buffer it touches to its last
 * byte allocated RC_PROBE_SHORT bytes short (``probed``), so the run must end in ASan's report
 * from inside that kernel: the proof that this kernel's cases run under ASan with exact buffers */
enum { PROBE_NONE, PROBE_TOPK, PROBE_DRAFT, PROBE_CONTEXT, PROBE_MOVE, PROBE_COPY };
#ifndef RC_ASAN_PROBE
#define RC_ASAN_PROBE PROBE_NONE
#endif
#define RC_PROBE_SHORT 4 /* bytes */
#define PROBING(kernel) (RC_ASAN_PROBE == (kernel))
#define RUNS(kernel) (RC_ASAN_PROBE == PROBE_NONE || PROBING(kernel)) /* its cases run in this build */

extern int failures;
extern long calls[5]; /* topk, draft, context, move, copy */

#define CHECK(cond, ...)                                                 \
    do {                                                                 \
        if (!(cond)) {                                                   \
            if (failures++ < 20) {                                       \
                fprintf(stderr, "MISMATCH %s:%d: ", __FILE__, __LINE__); \
                fprintf(stderr, __VA_ARGS__);                            \
                fputc('\n', stderr);                                     \
            }                                                            \
        }                                                                \
    } while (0)

/* exactly `bytes`: ASan poisons everything after them (malloc(0) included) */
void *exact(size_t bytes);
/* exactly `bytes`, RC_PROBE_SHORT fewer (where it has that many) in the build probing `kernel` */
void *probed(size_t bytes, int kernel);
uint64_t next(void);     /* xorshift64*, one stream for the whole run */
int64_t below(int64_t n); /* 0 .. n-1; 0 for n <= 0 */
void fill_random(void *p, size_t bytes);
void *copy_of(const void *p, size_t bytes);

/* asan_kv.c: rc_move_slots and rc_copy_positions over every cache shape */
void kv_cases(void);

#endif
