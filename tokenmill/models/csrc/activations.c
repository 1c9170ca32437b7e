/* The elementwise steps between a decoder layer's matmuls (CPU, fp32), one pass each.
 *
 * Why this exists: at batch 1 a decode step is ~120 small matmuls and, between them, ~400
 * PyTorch elementwise ops of a few microseconds each (RoPE alone is eight: slices, a cat, a
 * negation, two products, a sum). Those ops cost more than reading the 4-bit weights did.
 */
#include <math.h>
#include <stdint.h>

#include "team.h"
#include "vec8.h"

/* RoPE in place, the half-split layout (Hugging Face Llama): for each of T rows and H heads of
 * D values (rows `row_stride` floats apart, heads D apart), the first R dimensions turn by the
 * row's angles; cos/sin [T, R] hold each angle twice (both halves). */
void rope_team(float *x, const float *cos_t, const float *sin_t, int T, int H, int D, int R,
               int64_t row_stride) {
    const int half = R / 2;
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++) {
        const float *c = cos_t + (int64_t)t * R, *s = sin_t + (int64_t)t * R;
        for (int h = 0; h < H; h++) {
            float *v = x + t * row_stride + (int64_t)h * D;
            for (int i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

int rope_inplace(float *x, const float *cos_t, const float *sin_t, int T, int H, int D, int R,
                 int64_t row_stride, int num_threads) {
    if (R % 2 != 0 || R > D) return -1;
#pragma omp parallel num_threads(num_threads) if (T >= 16)
    rope_team(x, cos_t, sin_t, T, H, D, R, row_stride);
    return 0;
}

/* 1 / (1 + e^-z), eight at a time, from e^-|z| (never overflows). */
static inline vec8 sigmoid8(vec8 z) {
    const vec8 e = exp8(select8(z < 0.0f, z, -z));
    return select8(z < 0.0f, e / (1.0f + e), 1.0f / (1.0f + e));
}

/* out[t, i] = act(gate_up[t, i]) · gate_up[t, I + i]: the gated MLP's activation, gate and up
 * halves side by side as the fused projection leaves them. I is a multiple of 8. act: SILU, or
 * GELU_TANH (Gemma's gelu_pytorch_tanh: 0.5·x·(1 + tanh(u)) = x·sigmoid(2u), with
 * u = sqrt(2/π)·(x + 0.044715·x³)). */
void gated_activation_team(const float *gate_up, float *out, int T, int I, int act) {
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++) {
        const float *g = gate_up + (int64_t)t * 2 * I, *u = g + I;
        float *o = out + (int64_t)t * I;
        for (int i = 0; i < I; i += 8) {
            const vec8 x = LOAD(g + i);
            const vec8 z = act == GELU_TANH ? 1.5957691216f * (x + 0.044715f * x * x * x) : x;
            *(vec8u *)(o + i) = x * sigmoid8(z) * LOAD(u + i);
        }
    }
}

int gated_activation(const float *gate_up, float *out, int T, int I, int act, int num_threads) {
    if (I % 8 != 0 || (act != SILU && act != GELU_TANH)) return -1;
#pragma omp parallel num_threads(num_threads) if ((int64_t)T * I >= 16384)
    gated_activation_team(gate_up, out, T, I, act);
    return 0;
}
