/* Vector helpers of the matrix update's C kernel (native.c): GCC / Clang vector extensions of
 * LANES floats, any ISA; -march=native picks the instructions. */
#ifndef RC_NATIVE_SIMD_H
#define RC_NATIVE_SIMD_H

#include <stdint.h>
#include <string.h>
#include <math.h>
#include <stdlib.h>

#define LANES 16   /* one vector of the scan: GCC / Clang vector extensions, any ISA */

typedef _Float16 half_t;
typedef float vf __attribute__((vector_size(LANES * 4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4)));

static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }

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

#endif
