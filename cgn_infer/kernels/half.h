/* float16 and bfloat16 <-> float32 for cgn-infer's kernels: the scales inside GGUF blocks,
 * the activations' q8_1 scales (activations.c) and the KV pool when it is kept in 16 bits
 * (layer.c). Rounding is to the nearest value, ties to even, as torch's .to() and ggml's
 * conversions round; F16C does it in hardware where the path has it, the portable code
 * gives the same bits everywhere else (tests/test_cpu_paths.py runs both).
 */
#ifndef CGN_HALF_H
#define CGN_HALF_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

static inline float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline uint16_t float_to_half(float f) {
#ifdef __F16C__
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return sign | 0x7e00; /* NaN stays NaN */
    if (ax >= 0x477ff000u) return sign | 0x7c00; /* from 65520 up: rounds to infinity */
    if (ax < 0x38800000u) { /* below 2^-14: a half subnormal, a multiple of 2^-24 */
        float a;
        memcpy(&a, &ax, 4);
        return sign | (uint16_t)rintf(a * 16777216.0f); /* 1024 is the smallest normal */
    }
    ax += 0xfffu + ((ax >> 13) & 1); /* 10 mantissa bits kept, ties to even */
    return sign | (uint16_t)((ax - 0x38000000u) >> 13);
#endif
}

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40); /* quiet NaN */
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1)) >> 16);
}

#endif
