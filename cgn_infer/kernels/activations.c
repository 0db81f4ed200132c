/* The activations' side of cgn-infer's products (qmatmul.c): each row quantized to int8
 * the way llama.cpp's CPU backend quantizes it for the weight type it meets, so that our
 * products and ggml's start from the same integers and scales.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "half.h"

#define GROUP 32

/* x rounded to the nearest float16 (ties to even), back as a float. */
static inline float half_round(float x) { return half_to_float(float_to_half(x)); }

/* x [M, K] float32 -> qa [M, K] int8, da and sa [M, K/32], as llama.cpp quantizes the
 * activations for each weight type, in blocks of the weight's own block size (ggml's
 * q8_1/q8_0 and q8_K):
 *   block 32 (for Q4_0..Q8_0): per 32 values d = max|x| / 127, q = round(x * 127 / max|x|),
 *     d and d * sum(q) rounded to float16, as those blocks store them;
 *   block 256 (for the K-quants): per 256 values, m = the value of largest magnitude,
 *     q = min(127, round(x * -127 / m)), d = m / -127 in float32, repeated for its 8 groups.
 * A block so small that its inverse scale overflows (subnormal floats) becomes zeros.
 * sa per group of 32: d * sum(q) for block 32 (q8_1's s), the integer sum(q) itself for
 * block 256 (q8_K's bsums, per 32 here), which the K-quants' products sum in integers.
 * Rows are independent (parallel only when large). */
static void quantize_row(const float *x, int64_t K, int block, int8_t *qa, float *da, float *sa) {
    for (int64_t b = 0; b < K / block; b++) {
        const float *v = x + b * block;
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < block; j++)
            if (fabsf(v[j]) > amax) amax = fabsf(v[j]), max = v[j];
        float d, inv;
        if (block == GROUP) d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        else inv = amax > 0.0f ? -127.0f / max : 0.0f, d = amax > 0.0f ? 1.0f / inv : 0.0f;
        if (isinf(inv)) d = inv = 0.0f; /* subnormal inputs: zeros (ggml would overflow) */
        for (int g = 0; g < block / GROUP; g++) {
            int64_t i = b * (block / GROUP) + g;
            int sum = 0;
            for (int j = 0; j < GROUP; j++) {
                int r = (int)rintf(v[g * GROUP + j] * inv); /* half to even, like nearbyintf */
                r = r > 127 ? 127 : r;
                qa[i * GROUP + j] = (int8_t)r;
                sum += r;
            }
            da[i] = block == GROUP ? half_round(d) : d;
            sa[i] = block == GROUP ? half_round(d * (float)sum) : (float)sum;
        }
    }
}

void cgn_quantize_rows(const float *x, int64_t M, int64_t K, int block, int8_t *qa, float *da,
                       float *sa) {
    #pragma omp parallel for schedule(static) if (M * K >= 65536)
    for (int64_t m = 0; m < M; m++)
        quantize_row(x + m * K, K, block, qa + m * K, da + m * (K / GROUP), sa + m * (K / GROUP));
}
