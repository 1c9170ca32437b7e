/* Eight-float vectors with GCC/Clang vector extensions, shared by the kernels in this folder:
 * AVX2 with -march=native here, SSE or NEON elsewhere, from the same source. */
#ifndef TOKENMILL_VEC8_H
#define TOKENMILL_VEC8_H
#include <stdint.h>

typedef float vec8 __attribute__((vector_size(32)));
typedef float vec8u __attribute__((vector_size(32), aligned(4)));  /* for unaligned loads/stores */
#define LOAD(p) (*(const vec8u *)(p))

typedef int32_t vec8i __attribute__((vector_size(32)));
#ifdef __clang__
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (vec8i){__VA_ARGS__})
#endif

static inline float sum8(vec8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* The eight sums of s[0..7] as one vector (a transpose folded into the additions): one
 * horizontal sum per eight positions instead of one each. */
static inline vec8 sum8x8(const vec8 *s) {
    vec8 a[4], b[2];
    for (int i = 0; i < 4; i++)
        a[i] = SHUFFLE(s[2 * i], s[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               SHUFFLE(s[2 * i], s[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; i++)
        b[i] = SHUFFLE(a[2 * i], a[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               SHUFFLE(a[2 * i], a[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return SHUFFLE(b[0], b[1], 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE(b[0], b[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* mask ? a : b, lane by lane (casts between vector types keep the bits: no trip through memory). */
static inline vec8 select8(vec8i mask, vec8 a, vec8 b) {
    return (vec8)((mask & (vec8i)a) | (~mask & (vec8i)b));
}

/* e^x for x <= 0 (softmax scores minus their max, -|x| for a sigmoid), eight at a time: x = n·ln2 + r, e^r by its Taylor
 * polynomial to r^6 (|r| <= ln2/2: relative error ~2e-7), 2^n put into the exponent bits. */
static inline vec8 exp8(vec8 x) {
    const vec8 lo = (vec8){0} - 87.0f;
    x = select8(x < lo, lo, x);  /* below e^-87 the weight is 0 for softmax, and 2^n stays normal */
    const vec8 n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504f - 0.5f, vec8i), vec8);
    const vec8 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vec8 p = (vec8){0} + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return p * (vec8)((__builtin_convertvector(n, vec8i) + 127) << 23);
}

/* Caches of fp16 elements (EngineConfig.kv_cache_dtype): eight halves to floats and back, rounding
 * to nearest even as torch's .half() does. F16C's instructions where the CPU has them (GCC 12 turns
 * the portable form below into one conversion per element). */
#if defined(__F16C__)
#include <immintrin.h>
static inline vec8 load_half8(const uint16_t *p) {
    return (vec8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
static inline void store_half8(uint16_t *p, vec8 v) {
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#else
typedef _Float16 vec8h __attribute__((vector_size(16), aligned(2)));
static inline vec8 load_half8(const uint16_t *p) { return __builtin_convertvector(*(const vec8h *)p, vec8); }
static inline void store_half8(uint16_t *p, vec8 v) { *(vec8h *)p = __builtin_convertvector(v, vec8h); }
#endif

/* Eight cache elements from element i of p: fp16 when `half`, else fp32. Callers pass `half` as a
 * constant of an inlined specialisation, so the choice is made at compile time. */
static inline __attribute__((always_inline)) vec8 load_kv(const void *p, int64_t i, int half) {
    return half ? load_half8((const uint16_t *)p + i) : LOAD((const float *)p + i);
}

#endif
