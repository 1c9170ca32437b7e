/* y = x · Wᵀ (+ bias) for the few rows of a small decode batch (CPU, fp32).
 *
 * Why this exists: at a few rows a linear layer is a matrix-vector product, bound by reading
 * the weights from memory. oneDNN's packed GEMM reaches about half of this machine's memory
 * bandwidth there (it is tuned for many rows); this loop streams each weight once at close to
 * full bandwidth, split over the threads by output columns.
 *
 * Layouts (contiguous, fp32):
 *   x     [M, K]
 *   w     [N/8, K, 8]: eight output columns interleaved, so one 8-float load feeds eight dot
 *                      products and each thread reads one sequential stream (blocked_weight()
 *                      in packed.py builds it)
 *   bias  [N] or NULL
 *   y     [M, N]
 */
#include <stdint.h>

typedef float vec8 __attribute__((vector_size(32)));
typedef float vec8u __attribute__((vector_size(32), aligned(4)));  /* unaligned loads/stores */
#define LOAD(p) (*(const vec8u *)(p))

/* ROWS (<= 8) rows of x against one 8-column block; UNROLL accumulators per row hide the FMA
 * latency when there are too few rows to do it. Both are compile-time constants at every call
 * site, so the accumulators live in registers. */
static inline __attribute__((always_inline)) void block_tile(
    const float *wb, const float *x, const float *bias, float *y, int K, int N,
    const int ROWS, const int UNROLL) {
    vec8 acc[8][4];
    for (int m = 0; m < ROWS; m++)
        for (int u = 0; u < UNROLL; u++) acc[m][u] = (vec8){0};
    for (int k = 0; k < K; k += UNROLL)
        for (int u = 0; u < UNROLL; u++) {
            const vec8 w = LOAD(wb + 8 * (k + u));
            for (int m = 0; m < ROWS; m++) acc[m][u] += x[(int64_t)m * K + k + u] * w;
        }
    for (int m = 0; m < ROWS; m++) {
        vec8 sum = acc[m][0];
        for (int u = 1; u < UNROLL; u++) sum += acc[m][u];
        if (bias) sum += LOAD(bias);
        *(vec8u *)(y + (int64_t)m * N) = sum;
    }
}

/* Returns 0, or -1 when N is not a multiple of 8 or K not a multiple of 4. */
int small_gemm(const float *x, const float *w, const float *bias, float *y,
               int M, int N, int K, int num_threads) {
    if (N % 8 != 0 || K % 4 != 0) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int b = 0; b < N / 8; b++) {
        const float *wb = w + (int64_t)b * K * 8;
        const float *bb = bias ? bias + 8 * b : 0;
        for (int m = 0; m < M; m += 8) {  /* the block stays in L1/L2 across row groups */
            const float *xm = x + (int64_t)m * K;
            float *ym = y + (int64_t)m * N + 8 * b;
            switch (M - m) {
                case 1: block_tile(wb, xm, bb, ym, K, N, 1, 4); break;
                case 2: block_tile(wb, xm, bb, ym, K, N, 2, 2); break;
                case 3: block_tile(wb, xm, bb, ym, K, N, 3, 1); break;
                case 4: block_tile(wb, xm, bb, ym, K, N, 4, 1); break;
                case 5: block_tile(wb, xm, bb, ym, K, N, 5, 1); break;
                case 6: block_tile(wb, xm, bb, ym, K, N, 6, 1); break;
                case 7: block_tile(wb, xm, bb, ym, K, N, 7, 1); break;
                default: block_tile(wb, xm, bb, ym, K, N, 8, 1); break;
            }
        }
    }
    return 0;
}
