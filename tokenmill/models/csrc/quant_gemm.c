/* y = x · Wᵀ (+ bias) with W kept quantised in blocks of 32 along K (CPU: AVX2, or AVX-512 VNNI).
 *
 * Why this exists: dequantised to fp32, the embedded 4-bit model is 5x larger in memory, and a
 * decode step reads all of it; here a step reads the 4- or 8-bit blocks. The activations are
 * quantised to int8 per row and per block of 32 on the way in (as llama.cpp does), so the inner
 * loop is integer dot products (`maddubs`), which also beat fp32 FMA on compute at prefill size.
 *
 * Weight layouts (built by tokenmill/models/quant.py, `pack_q4`, `pack_q5`, `pack_q6`, `pack_q8`), for each group
 * of 8 output columns and each block of 32 along K:
 *   q8: int8  [N/8][K/32][8 vectors][8 cols][4 k]    value = scale · q,  q in [-127, 127]
 *   q4: uint8 [N/8][K/32][4 vectors][8 cols][4 k]    two nibbles per byte: vector p holds k-group p
 *       in its low nibbles and k-group p+4 in its high ones;  value = scale · q + min,  q in [0, 15],
 *       or, for a layer without minimums (llama.cpp's Q4_0: 4.5 bits a weight, where a min that
 *       is always -8 · scale took 5), value = scale · (q - Q4_OFFSET)
 *   q5: uint8 [N/8][K/32][160]   q4's 128 bytes of low nibbles, then a 32-byte plane of fifth bits
 *       (bit j of byte i: k-group j's, at byte i of its vector);  value = scale · (q - 16),  q in [0, 31]
 *       (llama.cpp's Q5_0: 5.5 bits a weight where 8-bit blocks would take 8.5)
 *   q6: uint8 [N/8][K/32][192]   q4's 128 bytes of low nibbles, then two 32-byte planes of the high
 *       two bits: bits 2j, 2j+1 of byte i of the first plane are k-group j's (j < 4), of the second
 *       k-group 4 + j's;  value = scale · (q - Q6_OFFSET),  q in [0, 63], with a scale for each
 *       half of the block (k-groups 0-3, 4-7: low nibbles, high ones) (llama.cpp's Q6_K: 6.5625 bits
 *       a weight where the 8-bit blocks it was requantised to took 9). With Q6_K's factors, each
 *       half's int32 dot (less 32 · the half's Σ x_q) times its int8 multiple is summed in int32,
 *       exactly, and converted once a block; the same in every tile, so a row gets the same bits
 *       at any batch size
 *   scale, min: fp32 or fp16 [N/8][K/32][8 cols], at 6 bits [N/8][K/16][8 cols] (fp16 where that holds them exactly: a GGUF's
 *               blocks carry fp16 ones, and 4 bytes fewer per block is 17% less to read at 4 bits),
 *               or, for 4 and 6 bits, the k-quants' factors (SCALES_SUPER_BLOCKS: llama.cpp's Q4_K
 *               holds a block's scale and min as an fp16 per super-block of 256 times a 6-bit
 *               integer per block, Q6_K a half block's scale as one times an int8, products fp16
 *               cannot hold): [N/8][K/256] super-blocks of SUPER_BLOCK_BYTES(bits), each the 8
 *               columns' fp16 factors, then [8 blocks or 16 halves][8 cols] multiples (u8 at 4
 *               bits, int8 at 6); 1.25 bytes per block and column where fp32 takes 4
 * A 32-byte vector is 8 columns × 4 consecutive k: one maddubs against the row's 4 int8
 * activations broadcast gives each column's partial dot product in its own 32-bit lane, so no
 * horizontal sums are needed.
 *
 * Activations: x fp32 [M, K] is quantised into scratch of the calling thread: xq int8 [M, K],
 * xs (scale) and xsum (scale · Σq, the rounded block's sum, for the q4 min term) fp32 [M, K/32],
 * xqsum, the block's sum of int8 values (int32 [M, K/32]), for the q4, q5 and q6 offsets and the
 * VNNI path's q8 one, and xqhalf, the sum of its first 16 (int32 [M, K/32]), for q6's halves;
 * on the AMX path xs and xsum again by block ([K/32, M]).
 *
 * Three instruction paths over the same layouts:
 * - AVX2: `maddubs` (u8 × s8 pairs summed into int16) then `madd` to widen: three instructions per
 *   32 MACs, one tile of up to 4 rows × 8 columns.
 * - AVX-512 VNNI (Zen 4, Ice Lake and later): u8 × s8 products summed straight into int32 lanes
 *   by 512-bit `vpdpbusd`, one instruction per 64 MACs. A tile is up to 4 rows × 16 columns: a
 *   zmm holds a 32-byte vector of each of two groups side by side, so each weight vector loaded
 *   serves 4 rows, and the per-block epilogue (convert, scale, add) is paid once for 16 columns.
 *   8-bit weights are signed; flipping their top bit makes them u8 (w + 128), and the block's
 *   128 · Σ x_q is taken off the int32 sum, exactly. A lone last group takes the AVX2 tile.
 * - AMX (Sapphire Rapids and later), for whole tiles of 16 rows: the tile unit's int8 products
 *   over a panel of each pair of groups unpacked once a chunk, the same dot products and epilogue
 *   as the VNNI tile (amx_tile); the VNNI tile takes the rows left over.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "team.h"

/* A buffer of one thread (engines on several Python threads each have their own), grown as
 * needed and kept, so a step allocates nothing; 64-byte aligned. */
typedef struct {
    void *data;
    size_t bytes;
} ThreadBuffer;

/* The buffer grown to at least `bytes` (its contents are not kept); NULL when out of memory. */
static void *grown(ThreadBuffer *buffer, size_t bytes) {
    if (bytes > buffer->bytes) {
        free(buffer->data);
        buffer->data = aligned_alloc(64, (bytes + 63) / 64 * 64);
        buffer->bytes = buffer->data ? bytes : 0;
    }
    return buffer->data;
}

/* Scratch for the quantised activations (and decode_layers.c's buffers). */
static __thread ThreadBuffer scratch;

int8_t *thread_scratch(size_t bytes) { return grown(&scratch, bytes); }

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

/* The 6-bit AVX2 tile (one row: a batch-1 step) sums its dot products with 256-bit vpdpbusd where
 * the CPU has it: one instruction where maddubs, its add and the widening madd took three
 * (measured 8-12% faster streaming at one row; the 4-bit tile measured no faster with it). */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define ROW_VNNI 1
#else
#define ROW_VNNI 0
#endif

#define BLOCK 32
#define ROW_TILE 4    /* rows per micro-kernel call: accumulators stay in the 16 ymm registers */
#define Q4_ROW_TILE 3 /* 4 spills there (the nibble unpacking needs registers of its own) */
/* Rows whose quantised activations stay in L2 while the weights stream past them: the weights
 * are read once a chunk, so the more rows the fewer passes (up to 256, measured 5-10% faster than
 * 64 at d = 2,048), while the chunk's int8 activations take at most CHUNK_BYTES. */
#define CHUNK_BYTES (512 * 1024)
#define MIN_ROW_CHUNK 64
#define MAX_ROW_CHUNK 256

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* Each block of 32: scale = max|x| / 127, q = round-to-nearest-even(x / scale), and the sum of the
 * rounded values, scale · Σq (llama.cpp's Q8_1 sum). Why not x's exact sum: a 4-bit row is
 * scale · q + min with q in [0, 15] and min ~ -8 · scale, so against the rounded x (x̂) the
 * layer computes Σ w·x̂ exactly, whose error Σ w·(x - x̂) has centred weights; the exact sum leaves
 * Σ (w - min)·(x - x̂), weights 0..15 · scale, ~3.6x the error variance. Measured on the same tokens as
 * llama-perplexity (36 windows of 512): SmolLM2 +0.77% over llama.cpp with the exact sum, +0.05%
 * with this one. */
static void quantize_row(const float *x, int8_t *q, float *scale, float *sum, int32_t *qsum, int32_t *qhalf,
                         int K) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < K / BLOCK; b++) {
        const float *xb = x + b * BLOCK;
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        }
        const float d = hmax(amax) / 127.f;
        const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
        __m256i n[4];
        for (int i = 0; i < 4; i++) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  /* MXCSR: to nearest even */
        /* int32 -> int8, in order: packs interleave the 128-bit lanes, the permute undoes it. */
        const __m256i n16 = _mm256_packs_epi32(n[0], n[1]), m16 = _mm256_packs_epi32(n[2], n[3]);
        const __m256i n8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(n16, m16),
                                                       _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + b * BLOCK), n8);
        scale[b] = d;
        /* |n| <= 127 (x / (max|x| / 127)): the packs above saturate nothing, so this is q's sum. */
        const __m256i first = _mm256_add_epi32(n[0], n[1]);
        qhalf[b] = (int32_t)hsum(_mm256_cvtepi32_ps(first));  /* |sum| <= 4064: exact in fp32 */
        qsum[b] = qhalf[b] + (int32_t)hsum(_mm256_cvtepi32_ps(_mm256_add_epi32(n[2], n[3])));
        sum[b] = d * (float)qsum[b];
    }
}

/* Sub-blocks (SUB_BLOCK(bits) k values, one block value a column) in a block of 32, and in a
 * super-block. */
#define SUBS_PER_BLOCK(bits) (BLOCK / SUB_BLOCK(bits))
/* Bytes of one 8-column group's block of 32 weights at `bits` (4, 5, 6 or 8): the layouts above. */
#define BLOCK_BYTES(bits) (32 * (bits))
#define SUBS_PER_SUPER(bits) (SUPER_BLOCK / SUB_BLOCK(bits))

/* Bytes of one 8-column group's block values (scales, or minimums) for K / 32 = KB blocks. */
static inline int64_t group_value_bytes(int format, int bits, int KB) {
    if (format == SCALES_SUPER_BLOCKS) return (int64_t)KB / 8 * SUPER_BLOCK_BYTES(bits);
    return (int64_t)KB * SUBS_PER_BLOCK(bits) * 8 * (format == SCALES_F16 ? 2 : 4);
}

/* Super-blocks: where sub-block sb's multiples (8 bytes, one a column) lie in the group's values at p. */
static inline const uint8_t *multiples_at(const void *p, int sb, const int bits) {
    return (const uint8_t *)p + (int64_t)(sb / SUBS_PER_SUPER(bits)) * SUPER_BLOCK_BYTES(bits) + 16 +
           8 * (sb % SUBS_PER_SUPER(bits));
}

/* Super-blocks: the eight columns' fp16 factors of the super-block holding block kb, as fp32. A
 * tile loads them once a super-block, not once a block (measured 10% of the GEMM at 256 rows). */
static inline __attribute__((always_inline)) __m256 super_factors(const void *p, int kb, const int bits) {
    const uint8_t *super = (const uint8_t *)p + (int64_t)(kb / 8) * SUPER_BLOCK_BYTES(bits);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)super));
}

/* Sub-block sb's eight values (one a column) of the group whose values start at p. Super-blocks
 * (4 bits: 6-bit ones are read as integers, load_multiples): the super-block's `factors` times the
 * block's multiples, exact in fp32 (11 + 6 significant bits). */
static inline __attribute__((always_inline)) __m256 load_values(const void *p, int sb, const int format,
                                                                __m256 factors) {
    if (format == SCALES_SUPER_BLOCKS)
        return _mm256_mul_ps(factors, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                          _mm_loadl_epi64((const __m128i *)multiples_at(p, sb, 4)))));
    return format == SCALES_F16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + 8 * sb)))
                                : _mm256_loadu_ps((const float *)p + 8 * sb);
}

/* Super-blocks at 6 bits: sub-block sb's eight int8 multiples (one a column), as int32. */
static inline __attribute__((always_inline)) __m256i load_multiples(const void *p, int sb) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)multiples_at(p, sb, 6)));
}

/* One row (a batch-1 step) streams each weight once: each tile asks for the bytes ROW_PREFETCH
 * ahead of the block it reads (the next group's, past its own end), which the hardware prefetchers
 * alone left short of what the memory gives. ROW_PREFETCH=0 turns it off (how it is timed). */
#ifndef ROW_PREFETCH
#define ROW_PREFETCH 4096
#endif
static inline __attribute__((always_inline)) void prefetch_ahead(const void *block, int bytes) {
    for (int offset = 0; ROW_PREFETCH && offset < bytes; offset += 64)
        _mm_prefetch((const char *)block + ROW_PREFETCH + offset, _MM_HINT_T0);
}

/* (acc + bias) into y, or added to y: the sum a residual add after the layer would give. */
static inline __attribute__((always_inline)) void store_tile(
    const __m256 *acc, const float *bias, float *y, int ldy, int accumulate, const int R) {
    for (int r = 0; r < R; r++) {
        __m256 out = bias ? _mm256_add_ps(acc[r], _mm256_loadu_ps(bias)) : acc[r];
        if (accumulate) out = _mm256_add_ps(_mm256_loadu_ps(y + (int64_t)r * ldy), out);
        _mm256_storeu_ps(y + (int64_t)r * ldy, out);
    }
}

static inline __m256i broadcast4(const int8_t *p) {
    int32_t four;
    memcpy(&four, p, 4);
    return _mm256_set1_epi32(four);
}

/* R rows (<= ROW_TILE) × one 8-column group of 4-bit weights: Σ q·x, then + min · Σ x (the
 * block's rounded sum) or, without minimums (wm NULL), less Q4_OFFSET · Σ x_q in int32. */
static inline __attribute__((always_inline)) void q4_tile(
    const int8_t *xq, const float *xs, const float *xsum, const int32_t *xqsum, const uint8_t *w,
    const void *ws, const void *wm, const float *bias, float *y, int K, int ldy, int accumulate, const int format,
    const int R) {
    const int KB = K / BLOCK;
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[ROW_TILE], scale_factors = _mm256_setzero_ps(), min_factors = _mm256_setzero_ps();
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int kb = 0; kb < KB; kb++) {
        if (format == SCALES_SUPER_BLOCKS && kb % 8 == 0)
            scale_factors = super_factors(ws, kb, 4), min_factors = super_factors(wm, kb, 4);
        const uint8_t *wp = w + (int64_t)kb * BLOCK_BYTES(4);
        if (R == 1) prefetch_ahead(wp, BLOCK_BYTES(4));
        __m256i sums[ROW_TILE];
        for (int r = 0; r < R; r++) sums[r] = _mm256_setzero_si256();
        for (int p = 0; p < 4; p++) {
            const __m256i packed = _mm256_loadu_si256((const __m256i *)(wp + 32 * p));
            const __m256i lo = _mm256_and_si256(packed, low);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
            for (int r = 0; r < R; r++) {
                const int8_t *xr = xq + (int64_t)r * K + kb * BLOCK;
                /* 15 · 127 · 2 per lane and step, eight steps: fits int16 (30480). */
                sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(lo, broadcast4(xr + 4 * p)));
                sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(hi, broadcast4(xr + 4 * p + 16)));
            }
        }
        const __m256 scale = load_values(ws, kb, format, scale_factors);
        const __m256 min = wm ? load_values(wm, kb, format, min_factors) : _mm256_setzero_ps();
        for (int r = 0; r < R; r++) {
            __m256i dot = _mm256_madd_epi16(sums[r], ones);
            if (!wm) dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(Q4_OFFSET * xqsum[r * KB + kb]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(scale, _mm256_set1_ps(xs[r * KB + kb])),
                                     acc[r]);
            if (wm) acc[r] = _mm256_fmadd_ps(min, _mm256_set1_ps(xsum[r * KB + kb]), acc[r]);
        }
    }
    store_tile(acc, bias, y, ldy, accumulate, R);
}

/* R rows × one 8-column group of 8-bit weights: maddubs needs one unsigned side, so |w| against
 * x carrying w's sign (the product is unchanged). */
static inline __attribute__((always_inline)) void q8_tile(
    const int8_t *xq, const float *xs, const int8_t *w, const void *ws, const float *bias,
    float *y, int K, int ldy, int accumulate, const int format, const int R) {
    const int KB = K / BLOCK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[ROW_TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int kb = 0; kb < KB; kb++) {
        const int8_t *wp = w + (int64_t)kb * BLOCK_BYTES(8);
        if (R == 1) prefetch_ahead(wp, BLOCK_BYTES(8));
        __m256i sums[ROW_TILE];
        for (int r = 0; r < R; r++) sums[r] = _mm256_setzero_si256();
        for (int v = 0; v < 8; v++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(wp + 32 * v));
            const __m256i wabs = _mm256_sign_epi8(wv, wv);
            for (int r = 0; r < R; r++) {
                const __m256i xv = _mm256_sign_epi8(broadcast4(xq + (int64_t)r * K + kb * BLOCK + 4 * v), wv);
                /* 127 · 127 · 2 fits int16 once; widen before adding. */
                sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, xv), ones));
            }
        }
        const __m256 scale = load_values(ws, kb, format, _mm256_setzero_ps());
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]),
                                     _mm256_mul_ps(scale, _mm256_set1_ps(xs[r * KB + kb])), acc[r]);
    }
    store_tile(acc, bias, y, ldy, accumulate, R);
}

/* The fifth bits of k-group j (0..7) from a q5 block's plane, as 0x10 or 0 in each byte. */
static inline __attribute__((always_inline)) __m256i fifth_bits(__m256i plane, const int j) {
    const __m256i at_bit_4 = j < 4 ? _mm256_slli_epi16(plane, 4 - j) : j > 4 ? _mm256_srli_epi16(plane, j - 4) : plane;
    return _mm256_and_si256(at_bit_4, _mm256_set1_epi8(0x10));
}

/* Vector p of a q5 block as two vectors of q in [0, 31]: k-group p's and k-group p+4's. */
static inline __attribute__((always_inline)) void q5_vectors(const uint8_t *wp, __m256i plane, const int p,
                                                             __m256i *lo, __m256i *hi) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i packed = _mm256_loadu_si256((const __m256i *)(wp + 32 * p));
    *lo = _mm256_or_si256(_mm256_and_si256(packed, low), fifth_bits(plane, p));
    *hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(packed, 4), low), fifth_bits(plane, p + 4));
}

/* R rows (<= Q4_ROW_TILE) × one 8-column group of 5-bit weights: Σ q·x, less 16 · Σ x_q. */
static inline __attribute__((always_inline)) void q5_tile(
    const int8_t *xq, const float *xs, const int32_t *xqsum, const uint8_t *w, const void *ws,
    const float *bias, float *y, int K, int ldy, int accumulate, const int format, const int R) {
    const int KB = K / BLOCK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[ROW_TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int kb = 0; kb < KB; kb++) {
        const uint8_t *wp = w + (int64_t)kb * BLOCK_BYTES(5);
        if (R == 1) prefetch_ahead(wp, BLOCK_BYTES(5));
        const __m256i plane = _mm256_loadu_si256((const __m256i *)(wp + 128));
        __m256i sums[ROW_TILE];
        for (int r = 0; r < R; r++) sums[r] = _mm256_setzero_si256();
        for (int pair = 0; pair < 2; pair++) {
            /* 31 · 127 · 2 per lane and maddubs, four of them: fits int16 (31496), then widened. */
            __m256i s16[ROW_TILE];
            for (int r = 0; r < R; r++) s16[r] = _mm256_setzero_si256();
            for (int p = 2 * pair; p < 2 * pair + 2; p++) {
                __m256i lo, hi;
                q5_vectors(wp, plane, p, &lo, &hi);
                for (int r = 0; r < R; r++) {
                    const int8_t *xr = xq + (int64_t)r * K + kb * BLOCK;
                    s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(lo, broadcast4(xr + 4 * p)));
                    s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(hi, broadcast4(xr + 4 * p + 16)));
                }
            }
            for (int r = 0; r < R; r++) sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(s16[r], ones));
        }
        const __m256 scale = load_values(ws, kb, format, _mm256_setzero_ps());
        for (int r = 0; r < R; r++) {
            const __m256i dot = _mm256_sub_epi32(sums[r], _mm256_set1_epi32(16 * xqsum[r * KB + kb]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(scale, _mm256_set1_ps(xs[r * KB + kb])),
                                     acc[r]);
        }
    }
    store_tile(acc, bias, y, ldy, accumulate, R);
}

/* The high two bits of k-group j (0..3 of a plane's four) from a q6 block's plane, at bits 4-5 of each byte. */
static inline __attribute__((always_inline)) __m256i high_pair(__m256i plane, const int j) {
    const __m256i at_bit_4 = j < 2 ? _mm256_slli_epi16(plane, 4 - 2 * j)
                             : j > 2 ? _mm256_srli_epi16(plane, 2 * j - 4) : plane;
    return _mm256_and_si256(at_bit_4, _mm256_set1_epi8(0x30));
}

/* Vector p of a q6 block as two vectors of q in [0, 63]: k-group p's (the first half's) and
 * k-group p+4's (the second's), with their planes of high bits `first` and `second`. */
static inline __attribute__((always_inline)) void q6_vectors(const uint8_t *wp, __m256i first, __m256i second,
                                                             const int p, __m256i *lo, __m256i *hi) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i packed = _mm256_loadu_si256((const __m256i *)(wp + 32 * p));
    *lo = _mm256_or_si256(_mm256_and_si256(packed, low), high_pair(first, p));
    *hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(packed, 4), low), high_pair(second, p));
}

/* R rows (<= Q4_ROW_TILE) × one 8-column group of 6-bit weights: for each half of a block, Σ q·x
 * less Q6_OFFSET · Σ x_q over the half, times the half's scale. */
static inline __attribute__((always_inline)) void q6_tile(
    const int8_t *xq, const float *xs, const int32_t *xqsum, const int32_t *xqhalf, const uint8_t *w,
    const void *ws, const float *bias, float *y, int K, int ldy, int accumulate, const int format, const int R) {
    const int KB = K / BLOCK;
    __m256 acc[ROW_TILE], factors = _mm256_setzero_ps();
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int kb = 0; kb < KB; kb++) {
        if (format == SCALES_SUPER_BLOCKS && kb % 8 == 0) factors = super_factors(ws, kb, 6);
        const uint8_t *wp = w + (int64_t)kb * BLOCK_BYTES(6);
        if (R == 1) prefetch_ahead(wp, BLOCK_BYTES(6));
        const __m256i first = _mm256_loadu_si256((const __m256i *)(wp + 128));
        const __m256i second = _mm256_loadu_si256((const __m256i *)(wp + 160));
        __m256i sums[2][ROW_TILE];  /* [half][row] */
        for (int r = 0; r < R; r++) sums[0][r] = sums[1][r] = _mm256_setzero_si256();
#if ROW_VNNI
        for (int p = 0; p < 4; p++) {
            __m256i lo, hi;
            q6_vectors(wp, first, second, p, &lo, &hi);
            for (int r = 0; r < R; r++) {
                const int8_t *xr = xq + (int64_t)r * K + kb * BLOCK;
                sums[0][r] = _mm256_dpbusd_epi32(sums[0][r], lo, broadcast4(xr + 4 * p));
                sums[1][r] = _mm256_dpbusd_epi32(sums[1][r], hi, broadcast4(xr + 4 * p + 16));
            }
        }
#else
        const __m256i ones = _mm256_set1_epi16(1);
        for (int pair = 0; pair < 2; pair++) {
            /* 63 · 127 · 2 per lane and maddubs, two of them: fits int16 (32004), then widened. */
            __m256i s16[2][ROW_TILE];
            for (int r = 0; r < R; r++) s16[0][r] = s16[1][r] = _mm256_setzero_si256();
            for (int p = 2 * pair; p < 2 * pair + 2; p++) {
                __m256i lo, hi;
                q6_vectors(wp, first, second, p, &lo, &hi);
                for (int r = 0; r < R; r++) {
                    const int8_t *xr = xq + (int64_t)r * K + kb * BLOCK;
                    s16[0][r] = _mm256_add_epi16(s16[0][r], _mm256_maddubs_epi16(lo, broadcast4(xr + 4 * p)));
                    s16[1][r] = _mm256_add_epi16(s16[1][r], _mm256_maddubs_epi16(hi, broadcast4(xr + 4 * p + 16)));
                }
            }
            for (int h = 0; h < 2; h++)
                for (int r = 0; r < R; r++) sums[h][r] = _mm256_add_epi32(sums[h][r], _mm256_madd_epi16(s16[h][r], ones));
        }
#endif
        for (int r = 0; r < R; r++) {
            const int32_t half_sums[2] = {xqhalf[r * KB + kb], xqsum[r * KB + kb] - xqhalf[r * KB + kb]};
            for (int h = 0; h < 2; h++)
                sums[h][r] = _mm256_sub_epi32(sums[h][r], _mm256_set1_epi32(Q6_OFFSET * half_sums[h]));
        }
        if (format == SCALES_SUPER_BLOCKS) {
            /* A half's scale is the super-block's factor times an int8: the halves' dot products
             * (|dot| < 2^16) times their multiples (<= 128) sum in int32 exactly, and convert to
             * fp32 exactly (< 2^24), then the factor: one conversion and product a block, not two. */
            const __m256i multiples[2] = {load_multiples(ws, 2 * kb), load_multiples(ws, 2 * kb + 1)};
            for (int r = 0; r < R; r++) {
                const __m256i block = _mm256_add_epi32(_mm256_mullo_epi32(sums[0][r], multiples[0]),
                                                       _mm256_mullo_epi32(sums[1][r], multiples[1]));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block), _mm256_mul_ps(factors, _mm256_set1_ps(xs[r * KB + kb])),
                                         acc[r]);
            }
            continue;
        }
        const __m256 scale[2] = {load_values(ws, 2 * kb, format, factors),
                                 load_values(ws, 2 * kb + 1, format, factors)};
        for (int r = 0; r < R; r++) {
            const __m256 x_scale = _mm256_set1_ps(xs[r * KB + kb]);
            for (int h = 0; h < 2; h++)
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[h][r]), _mm256_mul_ps(scale[h], x_scale), acc[r]);
        }
    }
    store_tile(acc, bias, y, ldy, accumulate, R);
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define VNNI 1
#define GROUP_TILE 2  /* 8-column groups per VNNI tile: one 512-bit register holds a vector of each */
/* Independent int32 sums per row and block: vpdpbusd's latency is ~4 cycles at 2 a cycle, so a tile
 * of few rows would wait on one chain; its sums are split and added at the block's end. */
#define MAX_CHAINS 4
#define CHAINS(R) ((R) == 1 ? 4 : (R) == 2 ? 2 : 1)

static inline __attribute__((always_inline)) __m512i load_pair(const void *a, const void *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

/* Block kb's sixteen values: eight of the group whose values start at p, eight of the next
 * group's, `gv` bytes on. */
static inline __attribute__((always_inline)) __m256i load_halves(const void *a, const void *b) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                   _mm_loadu_si128((const __m128i *)b), 1);
}

/* Super-blocks: both groups' factors (super_factors). */
static inline __attribute__((always_inline)) __m512 super_factor_pair(const void *p, int kb, int64_t gv,
                                                                      const int bits) {
    const uint8_t *first = (const uint8_t *)p + (int64_t)(kb / 8) * SUPER_BLOCK_BYTES(bits);
    return _mm512_cvtph_ps(load_halves(first, first + gv));
}

/* Sub-block sb's sixteen values: eight of the group whose values start at p, eight of the next
 * group's, `gv` bytes on (load_values for two groups). */
static inline __attribute__((always_inline)) __m512 load_value_pair(const void *p, int sb, int64_t gv,
                                                                    const int format, __m512 factors) {
    if (format == SCALES_SUPER_BLOCKS) {  /* 4 bits, as load_values */
        const uint8_t *first = multiples_at(p, sb, 4);
        const __m128i both = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)first),
                                                _mm_loadl_epi64((const __m128i *)(first + gv)));
        return _mm512_mul_ps(factors, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(both)));
    }
    if (format == SCALES_F16) {  /* one conversion for both */
        const uint16_t *h = (const uint16_t *)p + 8 * sb;
        return _mm512_cvtph_ps(load_halves(h, (const char *)h + gv));
    }
    const float *f = (const float *)p + 8 * sb;
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(f))),
                                               _mm256_castps_pd(_mm256_loadu_ps(f + gv / 4)), 1));
}

/* Super-blocks at 6 bits: sub-block sb's sixteen int8 multiples, eight of the group at p and eight
 * of the next one's, `gv` bytes on (load_multiples for two groups). */
static inline __attribute__((always_inline)) __m512i multiple_pair(const void *p, int sb, int64_t gv) {
    const uint8_t *first = multiples_at(p, sb, 6);
    return _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)first),
                                                   _mm_loadl_epi64((const __m128i *)(first + gv))));
}

static inline __attribute__((always_inline)) __m512i broadcast4_512(const int8_t *p) {
    int32_t four;
    memcpy(&four, p, 4);
    return _mm512_set1_epi32(four);
}

static inline __attribute__((always_inline)) __m512i chain_sum(const __m512i *chain, const int n) {
    __m512i total = chain[0];
    for (int c = 1; c < n; c++) total = _mm512_add_epi32(total, chain[c]);
    return total;
}

/* The two groups are adjacent columns of y: one 16-wide store a row. */
static inline __attribute__((always_inline)) void store_pair(
    const __m512 *acc, const float *bias, float *y, int ldy, int accumulate, const int R) {
    for (int r = 0; r < R; r++) {
        __m512 out = bias ? _mm512_add_ps(acc[r], _mm512_loadu_ps(bias)) : acc[r];
        if (accumulate) out = _mm512_add_ps(_mm512_loadu_ps(y + (int64_t)r * ldy), out);
        _mm512_storeu_ps(y + (int64_t)r * ldy, out);
    }
}

/* R rows × two 8-column groups of 4-bit weights (VNNI), `gw` weight bytes and `gv` value bytes
 * apart; the minimums, or their absence, as in q4_tile. */
static inline __attribute__((always_inline)) void q4_tile_vnni(
    const int8_t *xq, const float *xs, const float *xsum, const int32_t *xqsum, const uint8_t *w, int64_t gw,
    const void *ws, const void *wm, int64_t gv, const float *bias, float *y, int K, int ldy, int accumulate,
    const int format, const int R) {
    const int KB = K / BLOCK, NC = CHAINS(R);
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[ROW_TILE], scale_factors = _mm512_setzero_ps(), min_factors = _mm512_setzero_ps();
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int kb = 0; kb < KB; kb++) {
        if (format == SCALES_SUPER_BLOCKS && kb % 8 == 0)
            scale_factors = super_factor_pair(ws, kb, gv, 4), min_factors = super_factor_pair(wm, kb, gv, 4);
        __m512i sums[ROW_TILE][MAX_CHAINS];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < NC; c++) sums[r][c] = _mm512_setzero_si512();
        for (int p = 0; p < 4; p++) {
            const uint8_t *wp = w + (int64_t)kb * 128 + 32 * p;
            const __m512i packed = load_pair(wp, wp + gw);
            const __m512i lo = _mm512_and_si512(packed, low);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(packed, 4), low);  /* each byte's high nibble */
            for (int r = 0; r < R; r++) {
                const int8_t *xr = xq + (int64_t)r * K + kb * BLOCK + 4 * p;
                __m512i *chain = sums[r];
                chain[(2 * p) % NC] = _mm512_dpbusd_epi32(chain[(2 * p) % NC], lo, broadcast4_512(xr));
                chain[(2 * p + 1) % NC] = _mm512_dpbusd_epi32(chain[(2 * p + 1) % NC], hi, broadcast4_512(xr + 16));
            }
        }
        const __m512 scale = load_value_pair(ws, kb, gv, format, scale_factors);
        const __m512 min = wm ? load_value_pair(wm, kb, gv, format, min_factors) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            __m512i dot = chain_sum(sums[r], NC);
            if (!wm) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(Q4_OFFSET * xqsum[r * KB + kb]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, _mm512_set1_ps(xs[r * KB + kb])),
                                     acc[r]);
            if (wm) acc[r] = _mm512_fmadd_ps(min, _mm512_set1_ps(xsum[r * KB + kb]), acc[r]);
        }
    }
    store_pair(acc, bias, y, ldy, accumulate, R);
}

/* R rows × two 8-column groups of 8-bit weights (VNNI): w + 128 against x, less 128 · Σ x_q. With
 * offset 16 or 32, the weights are unpacked q5 or q6 ones (q in [0, 31] or [0, 63], already
 * unsigned): q against x, less the offset times Σ x_q; at 6 bits (`bits`) for each half of a block,
 * times the half's scale. */
static inline __attribute__((always_inline)) void q8_tile_vnni(
    const int8_t *xq, const float *xs, const int32_t *xqsum, const int32_t *xqhalf, const void *w, int64_t gw,
    const void *ws, int64_t gv, const float *bias, float *y, int K, int ldy, int accumulate, const int format,
    const int R, const int offset, const int bits) {
    const int KB = K / BLOCK, halves = bits == 6;
    /* Chains for each half of the block (halves), or for the whole block. */
    const int NC = halves ? (CHAINS(R) > 1 ? CHAINS(R) / 2 : 1) : CHAINS(R), per_half = halves ? 4 : 8;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[ROW_TILE], factors = _mm512_setzero_ps();
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int kb = 0; kb < KB; kb++) {
        if (format == SCALES_SUPER_BLOCKS && kb % 8 == 0) factors = super_factor_pair(ws, kb, gv, bits);
        __m512i sums[ROW_TILE][2][MAX_CHAINS];  /* [row][half][chain] */
        for (int r = 0; r < R; r++)
            for (int c = 0; c < NC; c++) sums[r][0][c] = sums[r][1][c] = _mm512_setzero_si512();
        for (int v = 0; v < 8; v++) {
            const int8_t *wp = (const int8_t *)w + (int64_t)kb * 256 + 32 * v;
            __m512i wv = load_pair(wp, wp + gw);
            if (offset == 128) wv = _mm512_xor_si512(wv, flip);
            for (int r = 0; r < R; r++) {
                const __m512i xv = broadcast4_512(xq + (int64_t)r * K + kb * BLOCK + 4 * v);
                __m512i *chain = &sums[r][v / per_half][v % NC];
                *chain = _mm512_dpbusd_epi32(*chain, wv, xv);
            }
        }
        __m512i dots[ROW_TILE][2];
        for (int h = 0; h <= halves; h++)
            for (int r = 0; r < R; r++) {
                const int32_t x_sum = !halves ? xqsum[r * KB + kb]
                                      : h == 0 ? xqhalf[r * KB + kb] : xqsum[r * KB + kb] - xqhalf[r * KB + kb];
                dots[r][h] = _mm512_sub_epi32(chain_sum(sums[r][h], NC), _mm512_set1_epi32(offset * x_sum));
            }
        if (halves && format == SCALES_SUPER_BLOCKS) {  /* as q6_tile: the halves summed in int32 */
            const __m512i multiples[2] = {multiple_pair(ws, 2 * kb, gv), multiple_pair(ws, 2 * kb + 1, gv)};
            for (int r = 0; r < R; r++) {
                const __m512i block = _mm512_add_epi32(_mm512_mullo_epi32(dots[r][0], multiples[0]),
                                                       _mm512_mullo_epi32(dots[r][1], multiples[1]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(block), _mm512_mul_ps(factors, _mm512_set1_ps(xs[r * KB + kb])),
                                         acc[r]);
            }
            continue;
        }
        for (int h = 0; h <= halves; h++) {
            const __m512 scale = load_value_pair(ws, SUBS_PER_BLOCK(bits) * kb + h, gv, format, factors);
            for (int r = 0; r < R; r++)
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r][h]), _mm512_mul_ps(scale, _mm512_set1_ps(xs[r * KB + kb])),
                                         acc[r]);
        }
    }
    store_pair(acc, bias, y, ldy, accumulate, R);
}

/* The VNNI tile for `rows` rows (at most ROW_TILE: 8 rows measured slower at 8 bits, no faster at
 * 4), R and the scale width known at compile time. */
#define VNNI_SWITCH(CALL, F)                     \
    switch (rows < ROW_TILE ? rows : ROW_TILE) { \
        case 1: CALL(F, 1); break;               \
        case 2: CALL(F, 2); break;               \
        case 3: CALL(F, 3); break;               \
        default: CALL(F, 4); break;              \
    }

/* The unpacked q5 or q6 groups of a VNNI tile, one buffer per thread of the team. */
static __thread ThreadBuffer unpacked_buffer;

/* fifth_bits and high_pair for a pair of groups' vectors side by side. */
static inline __attribute__((always_inline)) __m512i fifth_bit_pair(__m512i plane, const int j) {
    const __m512i at_bit_4 = j < 4 ? _mm512_slli_epi16(plane, 4 - j) : j > 4 ? _mm512_srli_epi16(plane, j - 4) : plane;
    return _mm512_and_si512(at_bit_4, _mm512_set1_epi8(0x10));
}

static inline __attribute__((always_inline)) __m512i high_pair_pair(__m512i plane, const int j) {
    const __m512i at_bit_4 = j < 2 ? _mm512_slli_epi16(plane, 4 - 2 * j)
                             : j > 2 ? _mm512_srli_epi16(plane, 2 * j - 4) : plane;
    return _mm512_and_si512(at_bit_4, _mm512_set1_epi8(0x30));
}

/* A 4-, 5- or 6-bit block of a pair of groups at wp (the next group's gw bytes on): its planes of
 * high bits (at 5 bits one, at 6 two; none at 4). */
static inline __attribute__((always_inline)) void block_planes(const uint8_t *wp, int64_t gw, const int bits,
                                                               __m512i planes[2]) {
    planes[0] = planes[1] = _mm512_setzero_si512();
    if (bits >= 5) planes[0] = load_pair(wp + 128, wp + gw + 128);
    if (bits == 6) planes[1] = load_pair(wp + 160, wp + gw + 160);
}

/* Vector p (0..3) of that block as the pair's q values: k-group p's (lo) and k-group p + 4's (hi),
 * the low nibbles with the high bits of `planes` (block_planes) added. */
static inline __attribute__((always_inline)) void vector_pair_values(const uint8_t *wp, int64_t gw,
                                                                     const __m512i planes[2], const int p,
                                                                     const int bits, __m512i *lo, __m512i *hi) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i packed = load_pair(wp + 32 * p, wp + gw + 32 * p);
    *lo = _mm512_and_si512(packed, low), *hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
    if (bits == 5) {
        *lo = _mm512_or_si512(*lo, fifth_bit_pair(planes[0], p));
        *hi = _mm512_or_si512(*hi, fifth_bit_pair(planes[0], p + 4));
    } else if (bits == 6) {
        *lo = _mm512_or_si512(*lo, high_pair_pair(planes[0], p));
        *hi = _mm512_or_si512(*hi, high_pair_pair(planes[1], p));
    }
}

/* A pair of q5 or q6 groups' blocks unpacked to the q8 layout ([2][KB][8 vectors][32], q in
 * [0, 31] or [0, 63]), so the VNNI tile reads them as 8-bit weights: the unpacking is paid once
 * for every row of the chunk, not once a tile of 4, in 512-bit operations (both groups at once).
 * NULL when out of memory (the caller takes the AVX2 tile instead). */
static const uint8_t *unpacked_pair(const uint8_t *w, int64_t gw, int KB, const int bits) {
    uint8_t *panel = grown(&unpacked_buffer, (size_t)2 * KB * 256);
    if (!panel) return NULL;
    for (int kb = 0; kb < KB; kb++) {
        const uint8_t *wp = w + (int64_t)kb * BLOCK_BYTES(bits);
        uint8_t *out[2] = {panel + (int64_t)kb * 256, panel + ((int64_t)KB + kb) * 256};
        __m512i planes[2];
        block_planes(wp, gw, bits, planes);
        for (int p = 0; p < 4; p++) {
            __m512i lo, hi;
            vector_pair_values(wp, gw, planes, p, bits, &lo, &hi);
            for (int g = 0; g < 2; g++) {
                _mm256_storeu_si256((__m256i *)(out[g] + 32 * p), g ? _mm512_extracti64x4_epi64(lo, 1) : _mm512_castsi512_si256(lo));
                _mm256_storeu_si256((__m256i *)(out[g] + 32 * (p + 4)),
                                    g ? _mm512_extracti64x4_epi64(hi, 1) : _mm512_castsi512_si256(hi));
            }
        }
    }
    return panel;
}

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#define AMX 1
/* AMX (Sapphire Rapids and later): the tile unit multiplies a 16-row × 32-byte tile of the int8
 * activations by a block's weights of two groups (16 columns) into 16 × 16 int32 dot products in
 * one instruction, where the VNNI tile takes 32 vpdpbusd for a quarter of them. Signed × signed
 * (tdpbssd) and signed × unsigned (tdpbsud) products need no offset terms: the panel holds q less
 * its offset (Q4_0, q5, q6) or q itself (q8; q4 with minimums, unsigned). The dot products are the
 * VNNI tile's, exactly, and the fp32 epilogue (convert, times scale times x's scale, then + min ·
 * Σ x) is the same operations in the same order, so a row gets the same bits on either path. */
#define AMX_ROWS 16
#define AMX_PANEL_ROW 64                     /* bytes: a k-group of 4 for both groups' 16 columns */
#define AMX_PANEL_BLOCK (8 * AMX_PANEL_ROW)  /* a block of 32 */
/* Tile registers, as literals (the tile instructions take them as immediates): a block's sums, its
 * activations and its weights, two of each, so that consecutive blocks use different tiles (tiles
 * are not renamed: the next block's loads would wait for this block's multiply). At 6 bits each
 * set holds a half block's activations and weights. */
#define AMX_C0 0
#define AMX_C1 1
#define AMX_C2 2
#define AMX_C3 3
#define AMX_A0 4
#define AMX_A1 5
#define AMX_B0 6
#define AMX_B1 7

/* The process asks Linux once for the tile registers' state (off until asked); 0 where refused. */
static int amx_permitted(void) {
    static int state = -1;
    int known = __atomic_load_n(&state, __ATOMIC_RELAXED);
    if (known < 0) {
        known = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
        __atomic_store_n(&state, known, __ATOMIC_RELAXED);
    }
    return known;
}

/* Sums: 16 × 16 int32; activations 16 rows × the k values of a block (or, halves, a half block);
 * weights those k values' groups of 4 × 64 bytes. */
static void amx_configure(const int halves) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t bytes_per_row[16];
        uint8_t rows[16];
    } __attribute__((packed, aligned(64))) config = {.palette = 1};
    const int k = halves ? BLOCK / 2 : BLOCK;
    for (int t = 0; t < 8; t++) {
        const int weights = t >= AMX_B0;
        config.bytes_per_row[t] = t < AMX_A0 ? 64 : weights ? AMX_PANEL_ROW : k;
        config.rows[t] = weights ? k / 4 : AMX_ROWS;
    }
    _tile_loadconfig(&config);
}

/* A pair of groups' blocks for the tile unit: [KB][8 k-groups][2 groups][8 columns][4 k], as
 * int8 q less its offset, or (4 bits with minimums) q as uint8. One buffer per thread of the team;
 * NULL when out of memory. */
static __thread ThreadBuffer amx_panel_buffer;

static const uint8_t *amx_panel(const uint8_t *w, int64_t gw, int KB, const int bits, const int has_min) {
    uint8_t *panel = grown(&amx_panel_buffer, (size_t)KB * AMX_PANEL_BLOCK);
    if (!panel) return NULL;
    const int offset = bits == 4 ? (has_min ? 0 : Q4_OFFSET) : bits == 5 ? 16 : bits == 6 ? Q6_OFFSET : 0;
    const __m512i less = _mm512_set1_epi8((char)offset);
    for (int kb = 0; kb < KB; kb++) {
        const uint8_t *wp = w + (int64_t)kb * BLOCK_BYTES(bits);
        __m512i *out = (__m512i *)(panel + (int64_t)kb * AMX_PANEL_BLOCK);
        if (bits == 8) {
            for (int v = 0; v < 8; v++) _mm512_store_si512(out + v, load_pair(wp + 32 * v, wp + gw + 32 * v));
            continue;
        }
        __m512i planes[2];
        block_planes(wp, gw, bits, planes);
        for (int p = 0; p < 4; p++) {
            __m512i lo, hi;
            vector_pair_values(wp, gw, planes, p, bits, &lo, &hi);
            _mm512_store_si512(out + p, _mm512_sub_epi8(lo, less));
            _mm512_store_si512(out + p + 4, _mm512_sub_epi8(hi, less));
        }
    }
    return panel;
}

/* Block kb's activations (a: 16 rows K bytes apart) and weights (b: the panel's block) into tiles
 * A_P, B_P, P a literal 0 or 1; at 6 bits its halves' into A0, B0 and A1, B1. */
#define AMX_LOAD(P, a, b, K, halves)                                  \
    do {                                                              \
        if (halves) {                                                 \
            _tile_loadd(AMX_A0, a, K);                                \
            _tile_loadd(AMX_B0, b, AMX_PANEL_ROW);                    \
            _tile_loadd(AMX_A1, (a) + BLOCK / 2, K);                  \
            _tile_loadd(AMX_B1, (b) + 4 * AMX_PANEL_ROW, AMX_PANEL_ROW); \
        } else {                                                      \
            _tile_loadd(AMX_A##P, a, K);                              \
            _tile_loadd(AMX_B##P, b, AMX_PANEL_ROW);                  \
        }                                                             \
    } while (0)

/* Its dot products into C_P (at 6 bits the halves' into C_P and C_(P + 2)): signed activations
 * times signed weights, or (has_min) unsigned ones. */
#define AMX_DOTS(P, has_min, halves)                      \
    do {                                                  \
        _tile_zero(AMX_C##P);                             \
        if (halves) {                                     \
            _tile_zero(AMX_C2##P);                        \
            _tile_dpbssd(AMX_C##P, AMX_A0, AMX_B0);       \
            _tile_dpbssd(AMX_C2##P, AMX_A1, AMX_B1);      \
        } else if (has_min) {                             \
            _tile_dpbsud(AMX_C##P, AMX_A##P, AMX_B##P);   \
        } else {                                          \
            _tile_dpbssd(AMX_C##P, AMX_A##P, AMX_B##P);   \
        }                                                 \
    } while (0)

/* C_P's sums into dots (int32 [16][16]; at 6 bits C_(P + 2)'s, the second half's, at dots + 256). */
#define AMX_STORE(P, dots, halves)                                                        \
    do {                                                                                  \
        _tile_stored(AMX_C##P, dots, 64);                                                 \
        if (halves) _tile_stored(AMX_C2##P, (dots) + 256, 64);                            \
        /* the tile stores wrote dots (the compiler cannot see it): reads of dots stay after */ \
        __asm__ volatile("" : "+m"(*(int32_t(*)[2 * AMX_ROWS * 16])(dots)));            \
    } while (0)
#define AMX_C20 AMX_C2
#define AMX_C21 AMX_C3

/* Block kb's epilogue on the 16 rows' accumulators, from its dot products d: q8_tile_vnni's and
 * q4_tile_vnni's, operation for operation. x_scale and x_sum: the rows' activation scales and
 * rounded sums for this block, one a row; the super-blocks' factors are read at each 8th block. */
static inline __attribute__((always_inline)) void amx_epilogue(
    __m512 *acc, __m512 *scale_factors, __m512 *min_factors, const int32_t *d, int kb, const float *x_scale,
    const float *x_sum, const void *ws, const void *wm, int64_t gv, const int format, const int bits,
    const int has_min) {
    const int halves = bits == 6;
    if (format == SCALES_SUPER_BLOCKS && kb % 8 == 0) {
        *scale_factors = super_factor_pair(ws, kb, gv, bits);
        if (has_min) *min_factors = super_factor_pair(wm, kb, gv, bits);
    }
    if (halves && format == SCALES_SUPER_BLOCKS) {
        const __m512i multiples[2] = {multiple_pair(ws, 2 * kb, gv), multiple_pair(ws, 2 * kb + 1, gv)};
        _Pragma("GCC unroll 16") for (int r = 0; r < AMX_ROWS; r++) {
            const __m512i block = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_load_si512(d + 16 * r), multiples[0]),
                                                   _mm512_mullo_epi32(_mm512_load_si512(d + 256 + 16 * r), multiples[1]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(block), _mm512_mul_ps(*scale_factors, _mm512_set1_ps(x_scale[r])),
                                     acc[r]);
        }
        return;
    }
    for (int h = 0; h <= halves; h++) {
        const __m512 scale = load_value_pair(ws, SUBS_PER_BLOCK(bits) * kb + h, gv, format, *scale_factors);
        _Pragma("GCC unroll 16") for (int r = 0; r < AMX_ROWS; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(d + 256 * h + 16 * r)),
                                     _mm512_mul_ps(scale, _mm512_set1_ps(x_scale[r])), acc[r]);
    }
    if (has_min) {
        const __m512 min = load_value_pair(wm, kb, gv, format, *min_factors);
        _Pragma("GCC unroll 16") for (int r = 0; r < AMX_ROWS; r++)
            acc[r] = _mm512_fmadd_ps(min, _mm512_set1_ps(x_sum[r]), acc[r]);
    }
}

/* One block of the pipeline in amx_tile, at parity P = kb % 2 (a literal; Q = 1 - P): the next
 * block's tiles loaded, this block's sums stored, the next block's multiply, then the previous
 * block's epilogue. */
#define AMX_STEP(P, Q)                                                                                    \
    do {                                                                                                  \
        const int next = kb + 1 < KB;                                                                     \
        if (next) AMX_LOAD(Q, xq + (int64_t)(kb + 1) * BLOCK, panel + (int64_t)(kb + 1) * AMX_PANEL_BLOCK, K, \
                           halves);                                                                       \
        AMX_STORE(P, dots[P], halves);                                                                    \
        if (next) AMX_DOTS(Q, has_min, halves);                                                           \
        if (kb > 0)                                                                                       \
            amx_epilogue(acc, &scale_factors, &min_factors, dots[Q], kb - 1, x_scale + (kb - 1) * x_stride, \
                         x_sum + (kb - 1) * x_stride, ws, wm, gv, format, bits, has_min);                 \
    } while (0)

/* 16 rows × a pair of groups through the tile unit, from the pair's panel (amx_panel). A load
 * that follows a tile store waits for the store to complete, so the tile operations run a block
 * ahead of the epilogue, which reads the sums stored an iteration earlier, and the rows'
 * activation scales come by block (one pointer, not 16 that would be spilled and reloaded). */
static inline __attribute__((always_inline)) void amx_tile(
    const int8_t *xq, const float *x_scale, const float *x_sum, int64_t x_stride, const uint8_t *panel,
    const void *ws, const void *wm, int64_t gv, const float *bias, float *y, int K, int ldy, int accumulate,
    const int format, const int bits, const int has_min) {
    const int KB = K / BLOCK, halves = bits == 6;
    int32_t dots[2][2 * AMX_ROWS * 16] __attribute__((aligned(64)));  /* [block % 2][half][row][column] */
    __m512 acc[AMX_ROWS], scale_factors = _mm512_setzero_ps(), min_factors = _mm512_setzero_ps();
    for (int r = 0; r < AMX_ROWS; r++) acc[r] = _mm512_setzero_ps();
    __asm__ volatile("" ::: "memory"); /* the panel's stores stay before the tile loads */
    AMX_LOAD(0, xq, panel, K, halves);
    AMX_DOTS(0, has_min, halves);
    for (int kb = 0; kb < KB; kb++) {
        if (kb % 2) AMX_STEP(1, 0);
        else AMX_STEP(0, 1);
    }
    amx_epilogue(acc, &scale_factors, &min_factors, dots[(KB - 1) % 2], KB - 1, x_scale + (KB - 1) * x_stride,
                 x_sum + (KB - 1) * x_stride, ws, wm, gv, format, bits, has_min);
    store_pair(acc, bias, y, ldy, accumulate, AMX_ROWS);
}

/* amx_tile at each value format, width and minimums, out of line: inlined into group_rows, its
 * pointers were spilled to the stack, and each reload waited behind a tile store. (At fp32 and
 * fp16 the 4-, 5- and 8-bit bodies are the same code: only the panel differs.) */
#define AMX_TILE_AT(F, B, MIN)                                                                                 \
    static __attribute__((noinline)) void amx_tile_##F##_##B##_##MIN(                                         \
        const int8_t *xq, const float *x_scale, const float *x_sum, int64_t x_stride, const uint8_t *panel,    \
        const void *ws, const void *wm, int64_t gv, const float *bias, float *y, int K, int ldy, int accumulate) { \
        amx_tile(xq, x_scale, x_sum, x_stride, panel, ws, wm, gv, bias, y, K, ldy, accumulate, F, B, MIN);     \
    }
AMX_TILE_AT(SCALES_F32, 4, 0)
AMX_TILE_AT(SCALES_F32, 4, 1)
AMX_TILE_AT(SCALES_F32, 5, 0)
AMX_TILE_AT(SCALES_F32, 6, 0)
AMX_TILE_AT(SCALES_F32, 8, 0)
AMX_TILE_AT(SCALES_F16, 4, 0)
AMX_TILE_AT(SCALES_F16, 4, 1)
AMX_TILE_AT(SCALES_F16, 5, 0)
AMX_TILE_AT(SCALES_F16, 6, 0)
AMX_TILE_AT(SCALES_F16, 8, 0)
AMX_TILE_AT(SCALES_SUPER_BLOCKS, 4, 1)
AMX_TILE_AT(SCALES_SUPER_BLOCKS, 6, 0)
#else
#define AMX 0
#endif
#else
#define VNNI 0
#define GROUP_TILE 1
#define AMX 0
#endif

/* The AVX2 tile for `rows` rows (at most TILE), its row count and value format known at compile time. */
#define TILE_SWITCH(CALL, TILE, F)            \
    switch (rows < TILE ? rows : TILE) {      \
        case 1: CALL(F, 1); break;            \
        case 2: CALL(F, 2); break;            \
        case 3: CALL(F, 3); break;            \
        default: CALL(F, 4); break;           \
    }

int quant_linear_available(void) { return 1; }

size_t quant_linear_scratch_bytes(int M, int K) {
    /* xq; xs, xsum, xqsum, xqhalf; xs and xsum by block */
    return (size_t)M * K + 6 * sizeof(float) * (size_t)M * (K / BLOCK);
}

/* Super-block values of G groups expanded to fp32 (their layout in that format), one buffer per
 * thread of the team: then every tile of the chunk's rows reads them as fp32 values instead of
 * computing each product again (measured 8-10% of the GEMM at 64-256 rows when each tile did,
 * 10% slower than that at 8 rows). The scales, then (where min is not NULL) the minimums; NULL
 * when out of memory. */
static __thread ThreadBuffer expanded_buffer;

static const float *expanded_values(const void *scale, const void *min, int64_t gv, int KB, int G) {
    const size_t per_group = (size_t)KB * 8, bytes = 2 * G * per_group * sizeof(float);
    float *expanded = grown(&expanded_buffer, bytes);
    if (!expanded) return NULL;
    const void *sources[2] = {scale, min};
    for (int which = 0; which < (min ? 2 : 1); which++)
        for (int g = 0; g < G; g++) {
            const char *p = (const char *)sources[which] + g * gv;
            float *out = expanded + (which * G + g) * per_group;
            __m256 factors = _mm256_setzero_ps();
            for (int kb = 0; kb < KB; kb++) {
                if (kb % 8 == 0) factors = super_factors(p, kb, 4);
                _mm256_storeu_ps(out + 8 * kb, load_values(p, kb, SCALES_SUPER_BLOCKS, factors));
            }
        }
    return expanded;
}

/* SWITCH(F) at the layer's value format, F a compile-time constant (super-blocks: 4 and 6 bits). */
#define AT_FORMAT(SWITCH)                                                                          \
    {                                                                                              \
        if (format == SCALES_F16) SWITCH(SCALES_F16)                                               \
        else if ((bits == 4 || bits == 6) && format == SCALES_SUPER_BLOCKS) SWITCH(SCALES_SUPER_BLOCKS) \
        else SWITCH(SCALES_F32)                                                                    \
    }

/* The quantised activations [M, K] of one call (layouts at the top). */
typedef struct {
    const int8_t *q;
    const float *scale, *sum;
    const int32_t *qsum, *qhalf;
    const float *scale_by_block, *sum_by_block; /* scale and sum again as [K/32][M]: the AMX tiles' */
    int rows;                                   /* M */
} Activations;

/* Rows m0..m1 of y (rows ldy floats apart) for groups g..g+G-1 of `layer` (G <= GROUP_TILE; 1
 * unless `vnni`). vnni: the VNNI tiles (where built) for a pair of groups, else the AVX2 ones. */
static void group_rows(const QuantLinear *layer, const Activations *x, float *y, int ldy, int m0, int m1, int g,
                       int G, int accumulate, int vnni) {
    const int K = layer->in_features, KB = K / BLOCK, bits = layer->bits;
    int format = layer->scale_format;
    int64_t gv = group_value_bytes(format, bits, KB);
    const int64_t gw = (int64_t)KB * BLOCK_BYTES(bits);  /* a group's weight bytes */
    const uint8_t *w = (const uint8_t *)layer->weight + g * gw;
    const void *gs = (const char *)layer->scale + g * gv;
    const void *gm = layer->min ? (const char *)layer->min + g * gv : 0;
    const float *gb = layer->bias ? layer->bias + 8 * g : 0;
#if VNNI
    vnni = vnni && G == GROUP_TILE;  /* a lone last group (N = 8 mod 16) takes the AVX2 tile */
#endif
    /* 4-bit super-blocks expanded where more than two tiles read them; fewer compute them in the
     * tile (6-bit ones always do: their products are integers, the factor taken once a block). */
    if (format == SCALES_SUPER_BLOCKS && bits == 4 && m1 - m0 > 2 * ROW_TILE) {
        const float *values = expanded_values(gs, gm, gv, KB, G);
        if (values) {
            gs = values, gm = gm ? values + (int64_t)G * KB * 8 : 0;
            format = SCALES_F32, gv = group_value_bytes(format, bits, KB);
        }
    }
#if AMX
    /* Whole tiles of 16 rows through the tile unit, the rest (and every row where Linux refuses the
     * tiles) through the VNNI tile. */
    const uint8_t *amx = vnni && m1 - m0 >= AMX_ROWS && amx_permitted() ? amx_panel(w, gw, KB, bits, gm != NULL)
                                                                         : NULL;
    if (amx) {
        amx_configure(bits == 6);
        for (; m0 + AMX_ROWS <= m1; m0 += AMX_ROWS) {
            const int8_t *xm = x->q + (int64_t)m0 * K;
            const float *sm = x->scale_by_block + m0, *tm = x->sum_by_block + m0;
            float *ym = y + (int64_t)m0 * ldy + 8 * g;
#define AMX_CALL(F, B, MIN) \
    amx_tile_##F##_##B##_##MIN(xm, sm, tm, x->rows, amx, gs, gm, gv, gb, ym, K, ldy, accumulate)
#define AMX_AT(F)                                                  \
    {                                                              \
        if (bits == 4 && gm) AMX_CALL(F, 4, 1);                    \
        else if (bits == 4) AMX_CALL(F, 4, 0);                     \
        else if (bits == 5) AMX_CALL(F, 5, 0);                     \
        else if (bits == 6) AMX_CALL(F, 6, 0);                     \
        else AMX_CALL(F, 8, 0);                                    \
    }
            if (format == SCALES_SUPER_BLOCKS && bits == 4) AMX_CALL(SCALES_SUPER_BLOCKS, 4, 1);
            else if (format == SCALES_SUPER_BLOCKS) AMX_CALL(SCALES_SUPER_BLOCKS, 6, 0);
            else if (format == SCALES_F16) AMX_AT(SCALES_F16)
            else AMX_AT(SCALES_F32)
        }
        _tile_release();
    }
#endif
#if VNNI
    const uint8_t *panel = vnni && m0 < m1 && (bits == 5 || bits == 6) ? unpacked_pair(w, gw, KB, bits) : NULL;
    vnni = vnni && ((bits != 5 && bits != 6) || panel);
#endif
    const int tile = vnni || bits == 8 ? ROW_TILE : Q4_ROW_TILE;
    for (int m = m0; m < m1; m += tile) {
        const int rows = m1 - m;
        const int8_t *xm = x->q + (int64_t)m * K;
        const float *sm = x->scale + (int64_t)m * KB, *tm = x->sum + (int64_t)m * KB;
        const int32_t *qm = x->qsum + (int64_t)m * KB, *hm = x->qhalf + (int64_t)m * KB;
        float *ym = y + (int64_t)m * ldy + 8 * g;
#if VNNI
#define Q4V(F, R) q4_tile_vnni(xm, sm, tm, qm, w, gw, gs, gm, gv, gb, ym, K, ldy, accumulate, F, R)
#define Q5V(F, R) q8_tile_vnni(xm, sm, qm, hm, panel, (int64_t)KB * 256, gs, gv, gb, ym, K, ldy, accumulate, F, R, 16, 5)
#define Q6V(F, R) q8_tile_vnni(xm, sm, qm, hm, panel, (int64_t)KB * 256, gs, gv, gb, ym, K, ldy, accumulate, F, R, \
                               Q6_OFFSET, 6)
#define Q8V(F, R) q8_tile_vnni(xm, sm, qm, hm, w, gw, gs, gv, gb, ym, K, ldy, accumulate, F, R, 128, 8)
#define Q4V_AT(F) VNNI_SWITCH(Q4V, F)
#define Q5V_AT(F) VNNI_SWITCH(Q5V, F)
#define Q6V_AT(F) VNNI_SWITCH(Q6V, F)
#define Q8V_AT(F) VNNI_SWITCH(Q8V, F)
        if (vnni) {
            if (bits == 4) AT_FORMAT(Q4V_AT)
            else if (bits == 5) AT_FORMAT(Q5V_AT)
            else if (bits == 6) AT_FORMAT(Q6V_AT)
            else AT_FORMAT(Q8V_AT)
            continue;
        }
#endif
#define Q4(F, R) q4_tile(xm, sm, tm, qm, w, gs, gm, gb, ym, K, ldy, accumulate, F, R)
#define Q5(F, R) q5_tile(xm, sm, qm, w, gs, gb, ym, K, ldy, accumulate, F, R)
#define Q6(F, R) q6_tile(xm, sm, qm, hm, w, gs, gb, ym, K, ldy, accumulate, F, R)
#define Q8(F, R) q8_tile(xm, sm, (const int8_t *)w, gs, gb, ym, K, ldy, accumulate, F, R)
#define Q4_AT(F) TILE_SWITCH(Q4, Q4_ROW_TILE, F)
#define Q5_AT(F) TILE_SWITCH(Q5, Q4_ROW_TILE, F)
#define Q6_AT(F) TILE_SWITCH(Q6, Q4_ROW_TILE, F)
#define Q8_AT(F) TILE_SWITCH(Q8, ROW_TILE, F)
        if (bits == 4) AT_FORMAT(Q4_AT)
        else if (bits == 5) AT_FORMAT(Q5_AT)
        else if (bits == 6) AT_FORMAT(Q6_AT)
        else AT_FORMAT(Q8_AT)
    }
}

/* A part's tiles: pairs of groups on the VNNI path, groups on the AVX2 one. */
static inline int part_tiles(const QuantLinear *part, int group_tile) {
    return (part->out_features / 8 + group_tile - 1) / group_tile;
}

void quant_linear_team(const QuantLinear *layer, const float *x, float *y, int M, int accumulate,
                       int8_t *xq) {
    const int K = layer->in_features, KB = K / BLOCK;
    int N = 0;  /* y's width: every part's columns */
    for (const QuantLinear *part = layer; part; part = part->next) N += part->out_features;
    float *xs = (float *)(xq + (size_t)M * K), *xsum = xs + (size_t)M * KB;  /* K % 32 == 0: aligned */
    int32_t *xqsum = (int32_t *)(xsum + (size_t)M * KB), *xqhalf = xqsum + (size_t)M * KB;
#pragma omp for schedule(static)
    for (int m = 0; m < M; m++)
        quantize_row(x + (int64_t)m * K, xq + (int64_t)m * K, xs + (int64_t)m * KB, xsum + (int64_t)m * KB,
                     xqsum + (int64_t)m * KB, xqhalf + (int64_t)m * KB, K);
    float *xs_by_block = (float *)(xqhalf + (size_t)M * KB), *xsum_by_block = xs_by_block + (size_t)M * KB;
#if AMX
    if (M >= AMX_ROWS && amx_permitted()) {
#pragma omp for schedule(static)
        for (int kb = 0; kb < KB; kb++)
            for (int m = 0; m < M; m++) {
                xs_by_block[(int64_t)kb * M + m] = xs[(int64_t)m * KB + kb];
                xsum_by_block[(int64_t)kb * M + m] = xsum[(int64_t)m * KB + kb];
            }
    }
#endif
    const Activations activations = {xq, xs, xsum, xqsum, xqhalf, xs_by_block, xsum_by_block, M};
    /* One row (a decode at batch 1) streams the weights through the AVX2 tile, one group at a time:
     * measured as fast or faster there (VNNI's gain is a weight load shared by rows, and it has one). */
    const int vnni = VNNI && M > 1, group_tile = vnni ? GROUP_TILE : 1;
    int tiles = 0;  /* every part's, shared out in one loop */
    for (const QuantLinear *part = layer; part; part = part->next) tiles += part_tiles(part, group_tile);
    /* Chunks of whole AMX tiles where there are some: no rows left over for the VNNI tile mid-way. */
#if AMX
    const int chunk_rows = AMX_ROWS;
#else
    const int chunk_rows = ROW_TILE;
#endif
    const int fit = CHUNK_BYTES / K / chunk_rows * chunk_rows;
    const int chunk = fit < MIN_ROW_CHUNK ? MIN_ROW_CHUNK : fit > MAX_ROW_CHUNK ? MAX_ROW_CHUNK : fit;
    for (int m0 = 0; m0 < M; m0 += chunk) {
        const int m1 = m0 + chunk < M ? m0 + chunk : M;
#pragma omp for schedule(static)
        for (int t = 0; t < tiles; t++) {
            const QuantLinear *part = layer;
            int first = 0, column = 0;  /* the part's first tile and first column */
            while (t >= first + part_tiles(part, group_tile))
                first += part_tiles(part, group_tile), column += part->out_features, part = part->next;
            const int g = (t - first) * group_tile, groups = part->out_features / 8;
            group_rows(part, &activations, y + column, N, m0, m1, g, groups - g < group_tile ? groups - g : group_tile,
                       accumulate, vnni);
        }
    }
}

/* Sub-block sb's value for column col of the group whose values start at p (load_values, one lane). */
static inline float block_value(const void *p, int sb, int col, int format, int bits) {
    if (format == SCALES_SUPER_BLOCKS) {
        const uint8_t *super = (const uint8_t *)p + (int64_t)(sb / SUBS_PER_SUPER(bits)) * SUPER_BLOCK_BYTES(bits);
        const uint8_t multiple = multiples_at(p, sb, bits)[col];
        return _cvtsh_ss(((const uint16_t *)super)[col]) * (bits == 6 ? (float)(int8_t)multiple : (float)multiple);
    }
    return format == SCALES_F16 ? _cvtsh_ss(((const uint16_t *)p)[8 * sb + col]) : ((const float *)p)[8 * sb + col];
}

/* One weight's integer value: row `col` of its group of 8, k-group kg (of 8) and k j (of 4) in block
 * `b` of the group's blocks (layouts above). */
static inline int block_q(const QuantLinear *w, int64_t group, int b, int col, int kg, int j) {
    const int KB = w->in_features / BLOCK;
    if (w->bits == 8)
        return ((const int8_t *)w->weight)[(((group * KB + b) * 8 + kg) * 8 + col) * 4 + j];
    const uint8_t *block = (const uint8_t *)w->weight + (group * KB + b) * BLOCK_BYTES(w->bits);
    const uint8_t byte = block[((kg % 4) * 8 + col) * 4 + j];
    const int low = kg < 4 ? byte & 15 : byte >> 4;
    if (w->bits == 4) return w->min ? low : low - Q4_OFFSET;
    if (w->bits == 6) return (low | ((block[128 + 32 * (kg / 4) + col * 4 + j] >> (2 * (kg % 4))) & 3) << 4) - Q6_OFFSET;
    return (low | ((block[128 + col * 4 + j] >> kg) & 1) << 4) - 16;
}

/* Rows `ids` of a packed weight as fp32 [n, K]: the embedding lookup of a table kept in these
 * blocks (tied to the lm_head), one call where quant.py's torch reference took ~10 tensor ops
 * (0.2 ms of a 10 ms batch-1 step). The same roundings as that reference: q · scale, then + min,
 * each rounded (the product goes through a volatile: no fused multiply-add). Returns -1 for an id
 * out of range. */
int quant_rows(const QuantLinear *w, const int64_t *ids, int n, float *out) {
    const int K = w->in_features, KB = K / BLOCK;
    for (int t = 0; t < n; t++) {
        if (ids[t] < 0 || ids[t] >= w->out_features) return -1;
        const int64_t group = ids[t] / 8;
        const int col = (int)(ids[t] % 8);
        float *row = out + (int64_t)t * K;
        const int64_t gv = group_value_bytes(w->scale_format, w->bits, KB);
        const int sub = SUB_BLOCK(w->bits);
        for (int sb = 0; sb < K / sub; sb++) {
            const float scale = block_value((const char *)w->scale + group * gv, sb, col, w->scale_format, w->bits);
            for (int k = sb * sub; k < (sb + 1) * sub; k++)
                row[k] = (float)block_q(w, group, k / BLOCK, col, k % BLOCK / 4, k % 4) * scale;
        }
        if (w->min == NULL) continue;
        for (int b = 0; b < KB; b++) {
            const float min = block_value((const char *)w->min + group * gv, b, col, w->scale_format, w->bits);
            for (int k = 0; k < BLOCK; k++) {
                volatile float product = row[b * BLOCK + k];
                row[b * BLOCK + k] = product + min;
            }
        }
    }
    return 0;
}

/* Whether the kernel runs this part: N a multiple of 8, K of 32, bits 4, 5, 6 or 8, and a value
 * format for these bits, K and min. */
static int runs(const QuantLinear *part) {
    const int bits = part->bits, format = part->scale_format;
    if (part->out_features % 8 != 0 || part->in_features % BLOCK != 0) return 0;
    if (bits != 4 && bits != 5 && bits != 6 && bits != 8) return 0;
    if (part->min && bits != 4) return 0;
    if (format == SCALES_F32 || format == SCALES_F16) return 1;
    return format == SCALES_SUPER_BLOCKS && part->in_features % SUPER_BLOCK == 0 &&
           (bits == 6 || (bits == 4 && part->min));
}

/* y = x · Wᵀ + bias for the layer and the parts chained to it (team.h). Returns 0, -1 when a part is
 * not one the kernel runs or the parts' in_features differ, -3 when out of memory. */
int quant_linear(const QuantLinear *layer, const float *x, float *y, int M, int num_threads) {
    for (const QuantLinear *part = layer; part; part = part->next)
        if (!runs(part) || part->in_features != layer->in_features) return -1;
    int8_t *xq = thread_scratch(quant_linear_scratch_bytes(M, layer->in_features));
    if (!xq) return -3;
#pragma omp parallel num_threads(num_threads)
    quant_linear_team(layer, x, y, M, 0, xq);
    return 0;
}

#else  /* no AVX2, FMA or F16C: the library still builds (its other kernels), and Python keeps
        * fp32 weights */
int quant_linear_available(void) { return 0; }

size_t quant_linear_scratch_bytes(int M, int K) { return 0; }

void quant_linear_team(const QuantLinear *layer, const float *x, float *y, int M, int accumulate,
                       int8_t *xq) {}

int quant_linear(const QuantLinear *layer, const float *x, float *y, int M, int num_threads) { return -2; }

int quant_rows(const QuantLinear *w, const int64_t *ids, int n, float *out) { return -2; }
#endif
