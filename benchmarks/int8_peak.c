/* The CPU's int8 multiply-accumulate peak, measured rather than looked up: independent chains of
 * the instruction the GEMM's inner loop is built on, registers only (no memory), on every thread.
 * Also the clock: a chain of dependent adds retires one per cycle.
 *
 *   cc -O2 -march=native -fopenmp benchmarks/int8_peak.c -o int8_peak && ./int8_peak THREADS
 * prints: GHz, then GMAC/s for vpmaddubsw (AVX2: 32 MACs, then vpmaddwd + vpaddd to keep the sums)
 * and for vpdpbusd (AVX-512 VNNI, 256-bit: 32 MACs into int32 lanes), where the CPU has it; and
 * the 512-bit vpdpbusd (64 MACs), which the GEMM does not use yet: where a core runs it at the
 * 256-bit form's rate, it is the ceiling a 512-bit kernel could reach.
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
#endif

int main(int argc, char **argv) {
    const int threads = argc > 1 ? atoi(argv[1]) : omp_get_max_threads();
    printf("{\"threads\": %d, \"clock_ghz\": %.3f, \"maddubs_gmacs\": %.1f", threads, clock_ghz(),
           maddubs_gmacs(threads));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    printf(", \"dpbusd_gmacs\": %.1f, \"dpbusd512_gmacs\": %.1f", dpbusd_gmacs(threads), dpbusd512_gmacs(threads));
#endif
    printf("}\n");
    return 0;
}
