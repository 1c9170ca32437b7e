/* The CPU's int8 multiply-accumulate peak, measured rather than looked up: independent chains of
 * the instruction the GEMM's inner loop is built on, registers only (no memory), on every thread.
 * Also the clock: a chain of dependent adds retires one per cycle.
 *
 *   cc -O2 -march=native -fopenmp benchmarks/int8_peak.c -o int8_peak && ./int8_peak THREADS
 * prints: GHz, then GMAC/s for vpmaddubsw (AVX2: 32 MACs, then vpmaddwd + vpaddd to keep the sums)
 * and for vpdpbusd (AVX-512 VNNI, 256-bit: 32 MACs into int32 lanes), where the CPU has it; the
 * 512-bit vpdpbusd (64 MACs) the GEMM's VNNI tiles use; and the same tiles' instruction mix on
 * registers (`tile_*`, 4 rows; `tile8_*`, 8): what a 32-value block costs beside its products (the
 * 4-bit unpacking, the int32 sum's conversion and scaling), the ceiling no memory layout can lift;
 * where the CPU has AMX, the tile unit's peak and its rate on the quant GEMM's blocks of 32.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define CHAINS 16 /* independent accumulators: more than latency × throughput */
#define STEPS 20000000L

static double clock_ghz(void) {
    uint64_t x = 1;
    const double t0 = now();
    for (long i = 0; i < STEPS * 10; i++) __asm__ volatile("add $1, %0" : "+r"(x));
    return STEPS * 10 / (now() - t0) / 1e9;
}

/* GMAC/s of the maddubs sequence a 4-bit tile issues per 32 MACs (maddubs, then an add of int16). */
static double maddubs_gmacs(int threads) {
    const double t0 = now();
#pragma omp parallel num_threads(threads)
    {
        __m256i acc[CHAINS], w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(5);
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_setzero_si256();
        for (long i = 0; i < STEPS; i++) {
#pragma GCC unroll 16
            for (int c = 0; c < CHAINS; c++) {
                acc[c] = _mm256_add_epi16(acc[c], _mm256_maddubs_epi16(w, x));
                __asm__ volatile("" : "+v"(w));  /* w "changes": one product per chain, not one shared */
            }
        }
        __m256i total = acc[0];
        for (int c = 1; c < CHAINS; c++) total = _mm256_add_epi32(total, acc[c]);
        volatile int sink = _mm256_extract_epi32(total, 0);  /* every chain's result is used */
        (void)sink;
    }
    return (double)threads * STEPS * CHAINS * 32 / (now() - t0) / 1e9;
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
static double dpbusd_gmacs(int threads) {
    const double t0 = now();
#pragma omp parallel num_threads(threads)
    {
        __m256i acc[CHAINS], w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(5);
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_setzero_si256();
        for (long i = 0; i < STEPS; i++) {
#pragma GCC unroll 16
            for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_dpbusd_epi32(acc[c], w, x);
            __asm__ volatile("" : "+v"(w));  /* w unknown to the compiler: no folding of the loop */
        }
        __m256i total = acc[0];
        for (int c = 1; c < CHAINS; c++) total = _mm256_add_epi32(total, acc[c]);
        volatile int sink = _mm256_extract_epi32(total, 0);  /* every chain's result is used */
        (void)sink;
    }
    return (double)threads * STEPS * CHAINS * 32 / (now() - t0) / 1e9;
}

static double dpbusd512_gmacs(int threads) {
    const double t0 = now();
#pragma omp parallel num_threads(threads)
    {
        __m512i acc[CHAINS], w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_setzero_si512();
        for (long i = 0; i < STEPS; i++) {
#pragma GCC unroll 16
            for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_dpbusd_epi32(acc[c], w, x);
            __asm__ volatile("" : "+v"(w));
        }
        __m512i total = acc[0];
        for (int c = 1; c < CHAINS; c++) total = _mm512_add_epi32(total, acc[c]);
        volatile int sink = _mm512_reduce_add_epi32(total);
        (void)sink;
    }
    return (double)threads * STEPS * CHAINS * 64 / (now() - t0) / 1e9;
}

/* GMAC/s of the VNNI tile's work on registers: `rows` x 16 columns, per 32-value block 8
 * vpdpbusd a row (two chains), then the block's epilogue a row: the chains added, converted, the
 * row's scale times the columns', one fma (`minimums`: a second fma, as Q4_K's). `unpack`: the
 * 4-bit weights split into nibbles first (and, shift, and for each of four 64-byte vectors), as
 * q4_tile_vnni does; without it, the 8-bit tile's sign flip (one xor a vector). */
#define MAX_TILE_ROWS 8
static inline __attribute__((always_inline)) void tile_work(long blocks, const int unpack, const int minimums,
                                                            const int rows) {
    __m512 acc[MAX_TILE_ROWS], scale = _mm512_set1_ps(0.5f), xs = _mm512_set1_ps(0.25f);
    __m512i x = _mm512_set1_epi8(5), packed = _mm512_set1_epi8(0x35), low = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (long b = 0; b < blocks; b++) {
        __m512i sums[MAX_TILE_ROWS][2];
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) sums[r][0] = sums[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int p = 0; p < 4; p++) {
            __asm__ volatile("" : "+v"(packed));  /* a new weight vector each time */
            __m512i first, second;
            if (unpack) {
                first = _mm512_and_si512(packed, low);
                second = _mm512_and_si512(_mm512_srli_epi32(packed, 4), low);
            } else {
                first = _mm512_xor_si512(packed, low);
                __asm__ volatile("" : "+v"(packed));
                second = _mm512_xor_si512(packed, low);
            }
#pragma GCC unroll 8
            for (int r = 0; r < rows; r++) {
                __asm__ volatile("" : "+v"(x));  /* the row's broadcast activations */
                sums[r][0] = _mm512_dpbusd_epi32(sums[r][0], first, x);
                sums[r][1] = _mm512_dpbusd_epi32(sums[r][1], second, x);
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            __asm__ volatile("" : "+v"(xs));
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(sums[r][0], sums[r][1]));
            acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale, xs), acc[r]);
            if (minimums) acc[r] = _mm512_fmadd_ps(scale, xs, acc[r]);
        }
    }
    __m512 total = acc[0];
    for (int r = 1; r < rows; r++) total = _mm512_add_ps(total, acc[r]);
    volatile float sink = _mm512_reduce_add_ps(total);
    (void)sink;
}

static double tile_gmacs(int threads, int unpack, int minimums, int rows) {
    const long blocks = STEPS / 8;
    const double t0 = now();
#pragma omp parallel num_threads(threads)
    {
        if (rows == 4) {
            if (!unpack) tile_work(blocks, 0, 0, 4);
            else if (!minimums) tile_work(blocks, 1, 0, 4);
            else tile_work(blocks, 1, 1, 4);
        } else {
            if (!unpack) tile_work(blocks, 0, 0, 8);
            else if (!minimums) tile_work(blocks, 1, 0, 8);
            else tile_work(blocks, 1, 1, 8);
        }
    }
    return (double)threads * blocks * rows * 8 * 64 / (now() - t0) / 1e9;
}
#endif

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
/* GMAC/s of the AMX tile unit on every thread: tdpbssd into four 16 × 16 int32 tiles from the same
 * two operand tiles (no memory), at K = 64 (`blocked` 0: the unit's peak), or the quant GEMM's
 * work per block of 32 (`blocked` 1: 16 rows × 32 bytes of activations and the block's weights
 * loaded from L1, multiplied, the sums stored for the epilogue, two blocks in flight). 0 where
 * Linux refuses the tile state. */
static double amx_gmacs(int threads, int blocked) {
    if (syscall(SYS_arch_prctl, 0x1023, 18)) return 0.0;  /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA */
    const long steps = STEPS / 40;
    const double t0 = now();
#pragma omp parallel num_threads(threads)
    {
        struct {
            uint8_t palette, start_row, reserved[14];
            uint16_t bytes_per_row[16];
            uint8_t rows[16];
        } __attribute__((packed, aligned(64))) config = {.palette = 1};
        static __thread int8_t a[16 * 64] __attribute__((aligned(64)));
        static __thread int8_t b[16 * 64] __attribute__((aligned(64)));
        static __thread int32_t sums[2][256] __attribute__((aligned(64)));
        for (int i = 0; i < 16 * 64; i++) a[i] = (int8_t)(i * 7), b[i] = (int8_t)(i * 13);
        for (int t = 0; t < 8; t++) config.bytes_per_row[t] = 64, config.rows[t] = 16;
        if (blocked) config.bytes_per_row[4] = config.bytes_per_row[5] = 32, config.rows[6] = config.rows[7] = 8;
        _tile_loadconfig(&config);
        if (!blocked) {
            _tile_loadd(4, a, 64);
            _tile_loadd(6, b, 64);
            for (long i = 0; i < steps; i++) {
                _tile_dpbssd(0, 4, 6);
                _tile_dpbssd(1, 4, 6);
                _tile_dpbssd(2, 4, 6);
                _tile_dpbssd(3, 4, 6);
            }
        } else {
            for (long i = 0; i < steps; i++) {
                _tile_loadd(4, a, 32);
                _tile_loadd(6, b, 64);
                _tile_stored(1, sums[1], 64);
                _tile_zero(0);
                _tile_dpbssd(0, 4, 6);
                _tile_loadd(5, a + 32, 32);
                _tile_loadd(7, b + 512, 64);
                _tile_stored(0, sums[0], 64);
                _tile_zero(1);
                _tile_dpbssd(1, 5, 7);
            }
        }
        _tile_stored(0, sums[0], 64);
        volatile int32_t sink = sums[0][0];
        (void)sink;
        _tile_release();
    }
    return (double)threads * steps * 4 * 16 * 16 * (blocked ? 16 : 64) / (now() - t0) / 1e9;
}
#endif

int main(int argc, char **argv) {
    const int threads = argc > 1 ? atoi(argv[1]) : omp_get_max_threads();
    printf("{\"threads\": %d, \"clock_ghz\": %.3f, \"maddubs_gmacs\": %.1f", threads, clock_ghz(),
           maddubs_gmacs(threads));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    printf(", \"dpbusd_gmacs\": %.1f, \"dpbusd512_gmacs\": %.1f", dpbusd_gmacs(threads), dpbusd512_gmacs(threads));
    printf(", \"tile_q8_gmacs\": %.1f, \"tile_q4_gmacs\": %.1f, \"tile_q4_minimums_gmacs\": %.1f",
           tile_gmacs(threads, 0, 0, 4), tile_gmacs(threads, 1, 0, 4), tile_gmacs(threads, 1, 1, 4));
    printf(", \"tile8_q8_gmacs\": %.1f, \"tile8_q4_gmacs\": %.1f, \"tile8_q4_minimums_gmacs\": %.1f",
           tile_gmacs(threads, 0, 0, 8), tile_gmacs(threads, 1, 0, 8), tile_gmacs(threads, 1, 1, 8));
#endif
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
    printf(", \"amx_gmacs\": %.1f, \"amx_block_gmacs\": %.1f", amx_gmacs(threads, 0), amx_gmacs(threads, 1));
#endif
    printf("}\n");
    return 0;
}
