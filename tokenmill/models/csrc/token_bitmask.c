/* Structured outputs: set the logits of tokens a grammar forbids to -inf (CPU, fp32).
 *
 * Why this exists: the mask arrives as bits (llguidance writes one bit per token), and the
 * PyTorch/numpy ways to apply it first expand it to a byte or a word per token, then mask; one
 * pass over the bits is cheaper (benchmarks/structured.py compares them). Words with every bit
 * set (free rows, most of a permissive grammar's vocabulary) are skipped, words with none set
 * (most of a strict grammar's) are filled whole, the rest bit by bit. One thread: the work is a
 * few megabytes of writes, less than waking a thread pool costs.
 *
 * Layouts (contiguous):
 *   logits [rows, vocab]  fp32
 *   mask   [rows, words]  32-bit words, bit b of word w = token 32*w + b allowed
 */
#include <math.h>
#include <stdint.h>

int apply_token_bitmask(float *logits, const int32_t *mask, int rows, int vocab, int words) {
    for (int r = 0; r < rows; r++) {
        float *row = logits + (int64_t)r * vocab;
        const uint32_t *bits = (const uint32_t *)mask + (int64_t)r * words;
        int full_words = vocab / 32 < words ? vocab / 32 : words;
        for (int w = 0; w < full_words; w++) {
            uint32_t word = bits[w];
            float *out = row + w * 32;
            if (word == 0xffffffffu)
                continue;
            if (word == 0) {
                for (int b = 0; b < 32; b++)
                    out[b] = -INFINITY;
                continue;
            }
            for (int b = 0; b < 32; b++)  /* branch-free, so it vectorizes */
                out[b] = ((word >> b) & 1u) ? out[b] : -INFINITY;
        }
        if (full_words < words) /* the vocabulary ends inside this word */
            for (int i = full_words * 32; i < vocab; i++)
                if (!((bits[full_words] >> (i - full_words * 32)) & 1u))
                    row[i] = -INFINITY;
    }
    return 0;
}
