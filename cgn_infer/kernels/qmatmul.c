/* Matrix products straight from GGUF's quantized blocks (cgn-infer's CPU kernels).
 *
 * y[m, n] = sum_k x[m, k] * W[n, k], where W's rows are the file's own blocks,
 * untouched: no float copy of the model exists. Activations are quantized per row
 * into int8 with a float scale and a sum per 32 values (activations.c, as llama.cpp
 * quantizes them for each weight type). The 32-value types (Q4_0..Q8_0) are read, a
 * tile of rows at a time (unpacked) or (for up to 8 rows) a group at a time straight
 * from the blocks, in a common form:
 *
 *     value[k] = d16[k / 16] * q[k] + m32[k / 32]        (q: int8)
 *
 * (Q4_1 and Q5_1 carry the additive m), and one product is integer dot products per 32
 * values, scaled in float:
 *
 *     y = sum_g d16 * da[g] * (q . qa)_g + sum_g m32[g] * sa[g]
 *
 * The K-quants are summed a 256-value superblock at a time in integers (k_dot below).
 * Each output row's arithmetic is the same whatever the number of rows M in the
 * call and whichever way the weights were read, so a sequence's result never
 * depends on the rows batched with it.
 * Parallel over weight rows with OpenMP; loaded after torch, this library shares
 * torch's libgomp (same soname), so both use one thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "half.h"

#define GROUP 32
#define TILE 8   /* weight rows unpacked together (fits L1/L2 for K up to ~8k) */
#define CHUNK 4  /* activation rows sharing one pass over a tile */

#define QK 256 /* values in a K-quant superblock */

enum {
    T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14
};

static inline int is_k(int type) { return type == T_Q4_K || type == T_Q5_K || type == T_Q6_K; }

/* Q4_1 and Q5_1 carry an offset m per 32 values; the others' m is 0, and the sum of m * sa
 * they would add is +0 (sa is finite), which every AVX2 product skips alike (the K-quants
 * sum their mins their own way). */
static inline __attribute__((always_inline)) int has_min(const int type) {
    return type == T_Q4_1 || type == T_Q5_1;
}

static inline float fp16(const uint8_t *p) { return half_to_float((uint16_t)(p[0] | (p[1] << 8))); }

/* Bytes of one block and values it holds, or 0 for a type without a kernel. block_bytes
 * inlines, so that a K-quant row's superblock stride is a constant in its products. */
static inline __attribute__((always_inline)) int block_bytes(int type) {
    switch (type) {
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    case T_Q5_1: return 24;
    case T_Q8_0: return 34;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    case T_Q6_K: return 210;
    default: return 0;
    }
}

int cgn_block_bytes(int type) { return block_bytes(type); }

int cgn_block_values(int type) { return is_k(type) ? QK : 32; }

/* Q4_K's and Q5_K's eight 6-bit scales and eight 6-bit mins, packed in 12 bytes s: for
 * j < 4, sc[j] and m[j] are the low 6 bits of s[j] and s[j + 4]; for j >= 4, the low and
 * high nibbles of s[j + 4], each topped with the 2 spare high bits of s[j - 4] (sc) or of
 * s[j] (m). Four bytes at a time, as 32-bit words. */
static inline void scales_mins_k4(const uint8_t *restrict s, uint8_t sc[8], uint8_t m[8]) {
    uint32_t w[3], out[4];
    memcpy(w, s, 12);
    out[0] = w[0] & 0x3f3f3f3fu;
    out[1] = (w[2] & 0x0f0f0f0fu) | (((w[0] >> 6) & 0x03030303u) << 4);
    out[2] = w[1] & 0x3f3f3f3fu;
    out[3] = ((w[2] >> 4) & 0x0f0f0f0fu) | (((w[1] >> 6) & 0x03030303u) << 4);
    memcpy(sc, out, 8);
    memcpy(m, out + 2, 8);
}

#ifdef __AVX2__
/* 16 bytes of nibbles -> 32 values: low nibbles first, then high (ggml's order), plus `add`. */
static inline __attribute__((always_inline)) __m256i nibbles(const uint8_t *restrict qs, int add) {
    __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(raw), _mm_srli_epi16(raw, 4), 1);
    v = _mm256_and_si256(v, _mm256_set1_epi8(0x0f));
    return add ? _mm256_add_epi8(v, _mm256_set1_epi8((char)add)) : v;
}

/* Q5_0 / Q5_1: nibbles plus a fifth bit per value from qh (bit j for value j); `add` -16 or 0. */
static inline __attribute__((always_inline)) __m256i fives(const uint8_t *restrict qh,
                                                           const uint8_t *restrict qs, int add) {
    uint32_t h;
    memcpy(&h, qh, 4);
    /* byte j = 0xff where bit j of h is set */
    __m256i bits = _mm256_shuffle_epi8(_mm256_set1_epi32((int)h),
                                       _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                         0x0101010101010101, 0));
    bits = _mm256_cmpeq_epi8(_mm256_or_si256(bits, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                             _mm256_set1_epi64x(-1));
    if (add == -16) /* q - 16: the nibble where the bit is set, else the nibble with 0xf0 (-16 + it) */
        return _mm256_or_si256(nibbles(qs, 0), _mm256_andnot_si256(bits, _mm256_set1_epi8((char)0xf0)));
    return _mm256_add_epi8(_mm256_or_si256(nibbles(qs, 0), _mm256_and_si256(bits, _mm256_set1_epi8(0x10))),
                           _mm256_set1_epi8((char)add));
}
#endif

/* nibbles() into y */
static inline void nibbles16(const uint8_t *restrict qs, int8_t *restrict y, int add) {
#ifdef __AVX2__
    _mm256_storeu_si256((__m256i *)y, nibbles(qs, add));
#else
    for (int j = 0; j < 16; j++) {
        y[j] = (int8_t)((qs[j] & 0xf) + add);
        y[j + 16] = (int8_t)((qs[j] >> 4) + add);
    }
#endif
}

/* fives() into y */
static inline void fives32(const uint8_t *restrict qh, const uint8_t *restrict qs,
                           int8_t *restrict y, int add) {
#ifdef __AVX2__
    _mm256_storeu_si256((__m256i *)y, fives(qh, qs, add));
#else
    uint32_t h;
    memcpy(&h, qh, 4);
    for (int j = 0; j < 16; j++) {
        y[j] = (int8_t)(((qs[j] & 0xf) | (((h >> j) & 1) << 4)) + add);
        y[j + 16] = (int8_t)(((qs[j] >> 4) | (((h >> (j + 16)) & 1) << 4)) + add);
    }
#endif
}

/* Q6_K, one half block: 64 bytes of low nibbles, 32 of high bit pairs -> 128 values. */
static inline void sixes128(const uint8_t *restrict ql, const uint8_t *restrict qh,
                            int8_t *restrict y) {
#ifdef __AVX2__
    const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(0x03), off = _mm256_set1_epi8(32);
    __m256i a = _mm256_loadu_si256((const __m256i *)ql), b = _mm256_loadu_si256((const __m256i *)(ql + 32));
    __m256i h = _mm256_loadu_si256((const __m256i *)qh);
    __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(h, m2), 4);
    __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m2), 4);
    __m256i h2 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m2), 4);
    __m256i h3 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m2), 4);
    __m256i ahi = _mm256_and_si256(_mm256_srli_epi16(a, 4), m4), bhi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m4);
    _mm256_storeu_si256((__m256i *)y, _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(a, m4), h0), off));
    _mm256_storeu_si256((__m256i *)(y + 32), _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(b, m4), h1), off));
    _mm256_storeu_si256((__m256i *)(y + 64), _mm256_sub_epi8(_mm256_or_si256(ahi, h2), off));
    _mm256_storeu_si256((__m256i *)(y + 96), _mm256_sub_epi8(_mm256_or_si256(bhi, h3), off));
#else
    for (int l = 0; l < 32; l++) {
        y[l + 0] = (int8_t)(((ql[l] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32);
        y[l + 32] = (int8_t)(((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32);
        y[l + 64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
        y[l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
    }
#endif
}

/* One row of K values from its blocks into q / d16 / m32 (the common form above).
 * One loop per type, so that each compiles without per-block branches. */
static void unpack_row(int type, const uint8_t *restrict src, int64_t K, int8_t *restrict q,
                       float *restrict d16, float *restrict m32) {
    int64_t nb = K / cgn_block_values(type);
    switch (type) {
    case T_Q6_K:
        for (int64_t b = 0; b < nb; b++, src += 210) {
            const int8_t *sc = (const int8_t *)(src + 192);
            float d = fp16(src + 208);
            sixes128(src, src + 128, q + b * 256);
            sixes128(src + 64, src + 160, q + b * 256 + 128);
            for (int i = 0; i < 16; i++) d16[b * 16 + i] = d * sc[i];
            for (int i = 0; i < 8; i++) m32[b * 8 + i] = 0.0f;
        }
        return;
    case T_Q4_K:
    case T_Q5_K: /* Q5_K: Q4_K's scales, 32 bytes of fifth bits (bit j of byte l: value 32j + l), nibbles */
        for (int64_t b = 0; b < nb; b++, src += block_bytes(type)) {
            float d = fp16(src), dmin = fp16(src + 2);
            const uint8_t *qs = src + (type == T_Q4_K ? 16 : 48);
            uint8_t sc[8], m[8];
            scales_mins_k4(src + 4, sc, m);
            for (int j = 0; j < 4; j++, qs += 32) {
                for (int h = 0; h < 2; h++) {
                    int64_t g = b * 8 + 2 * j + h;
                    d16[2 * g] = d16[2 * g + 1] = d * sc[2 * j + h];
                    m32[g] = -dmin * m[2 * j + h];
                }
                int8_t *y = q + b * 256 + 64 * j;
#ifdef __AVX2__
                __m256i v = _mm256_loadu_si256((const __m256i *)qs), m4 = _mm256_set1_epi8(0x0f);
                _mm256_storeu_si256((__m256i *)y, _mm256_and_si256(v, m4));
                _mm256_storeu_si256((__m256i *)(y + 32), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
#else
                for (int l = 0; l < 32; l++) {
                    y[l] = (int8_t)(qs[l] & 0xf);
                    y[32 + l] = (int8_t)(qs[l] >> 4);
                }
#endif
                if (type == T_Q5_K)
                    for (int l = 0; l < 32; l++) {
                        y[l] |= (int8_t)(((src[16 + l] >> (2 * j)) & 1) << 4);
                        y[32 + l] |= (int8_t)(((src[16 + l] >> (2 * j + 1)) & 1) << 4);
                    }
            }
        }
        return;
    case T_Q8_0:
        for (int64_t b = 0; b < nb; b++, src += 34) {
            memcpy(q + b * 32, src + 2, 32);
            d16[2 * b] = d16[2 * b + 1] = fp16(src);
            m32[b] = 0.0f;
        }
        return;
    case T_Q4_0:
        for (int64_t b = 0; b < nb; b++, src += 18) {
            nibbles16(src + 2, q + b * 32, -8);
            d16[2 * b] = d16[2 * b + 1] = fp16(src);
            m32[b] = 0.0f;
        }
        return;
    case T_Q4_1:
        for (int64_t b = 0; b < nb; b++, src += 20) {
            nibbles16(src + 4, q + b * 32, 0);
            d16[2 * b] = d16[2 * b + 1] = fp16(src);
            m32[b] = fp16(src + 2);
        }
        return;
    case T_Q5_0:
        for (int64_t b = 0; b < nb; b++, src += 22) {
            fives32(src + 2, src + 6, q + b * 32, -16);
            d16[2 * b] = d16[2 * b + 1] = fp16(src);
            m32[b] = 0.0f;
        }
        return;
    default: /* Q5_1 */
        for (int64_t b = 0; b < nb; b++, src += 24) {
            fives32(src + 4, src + 8, q + b * 32, 0);
            d16[2 * b] = d16[2 * b + 1] = fp16(src);
            m32[b] = fp16(src + 2);
        }
        return;
    }
}

/* Rows `ids` of a quantized matrix [N, K] as float32 (embedding lookups). */
void cgn_dequantize_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t K,
                         const int64_t *ids, int64_t n, float *out) {
    #pragma omp parallel
    {
        int8_t *q = malloc(K);
        float *d16 = malloc(sizeof(float) * (K / 16)), *m32 = malloc(sizeof(float) * (K / 32));
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) {
            unpack_row(type, w + ids[i] * row_bytes, K, q, d16, m32);
            for (int64_t k = 0; k < K; k++) out[i * K + k] = d16[k / 16] * q[k] + m32[k / 32];
        }
        free(q); free(d16); free(m32);
    }
}

#ifdef __AVX2__
/* int32 sums of 4 adjacent products of u's unsigned bytes and s's signed ones: one VNNI
 * instruction (dpbusd) on the avx512vnni path, maddubs and madd on avx2. The same
 * integers: maddubs's int16 pair sums cannot saturate here (|w| <= 128, |a| <= 127). */
static inline __attribute__((always_inline)) __m256i dot4(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#ifdef __AVX2__
/* y[c][r] for weight rows r < NR of the unpacked tile and activation rows c < NC, both
 * constants after inlining (so the NR x NC accumulators live in registers). Every
 * (r, c) pair runs the same instructions in the same order whatever NR and NC are, so a
 * row's result never depends on the rows computed beside it. */
static inline __attribute__((always_inline)) void
block_dot(int64_t K, int with_min, const int NR, const int8_t *restrict q, const float *restrict d16,
          const float *restrict m32, const int NC, const int8_t *restrict qa,
          const float *restrict da, const float *restrict sa, float *restrict y, int64_t ldy) {
    int64_t groups = K / GROUP;
    __m256 acc[2][CHUNK];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256i w[2], wabs[2];
        __m256 scale[2];
        for (int r = 0; r < NR; r++) {
            const float *wd = d16 + r * (K / 16);
            w[r] = _mm256_loadu_si256((const __m256i *)(q + r * K + g * GROUP));
            wabs[r] = _mm256_sign_epi8(w[r], w[r]);
            scale[r] = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(wd[2 * g])),
                                            _mm_set1_ps(wd[2 * g + 1]), 1);
        }
        for (int c = 0; c < NC; c++) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(qa + c * K + g * GROUP));
            __m256 sd = _mm256_set1_ps(da[c * groups + g]);
            for (int r = 0; r < NR; r++) {
                __m256i p = dot4(wabs[r], _mm256_sign_epi8(a, w[r]));
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(scale[r], sd), acc[r][c]);
            }
        }
    }
    for (int r = 0; r < NR; r++) {
        const float *wm = m32 + r * groups;
        for (int c = 0; c < NC; c++) {
            float mins = 0.0f;
            if (with_min)
                for (int64_t g = 0; g < groups; g++) mins += wm[g] * sa[c * groups + g];
            y[c * ldy + r] = hsum(acc[r][c]) + mins;
        }
    }
}
#endif

/* y[c][r] = row r of the unpacked tile against activation row c, for r < nr, c < nc. */
static void tile_dot(int64_t K, int type, int nr, const int8_t *restrict q, const float *restrict d16,
                     const float *restrict m32, int nc, const int8_t *restrict qa,
                     const float *restrict da, const float *restrict sa, float *restrict y,
                     int64_t ldy) {
    int64_t groups = K / GROUP;
#ifdef __AVX2__
    for (int r = 0; r < nr; r += 2) {
        const int8_t *wq = q + r * K;
        const float *wd = d16 + r * (K / 16), *wm = m32 + r * groups;
        float *out = y + r;
#define BLOCK(NR, NC) block_dot(K, has_min(type), NR, wq, wd, wm, NC, qa, da, sa, out, ldy)
        if (r + 1 < nr) {
            switch (nc) {
            case 1: BLOCK(2, 1); break;
            case 2: BLOCK(2, 2); break;
            case 3: BLOCK(2, 3); break;
            default: BLOCK(2, 4); break;
            }
        } else {
            switch (nc) {
            case 1: BLOCK(1, 1); break;
            case 2: BLOCK(1, 2); break;
            case 3: BLOCK(1, 3); break;
            default: BLOCK(1, 4); break;
            }
        }
#undef BLOCK
    }
#else
    for (int r = 0; r < nr; r++) {
        const int8_t *wq = q + r * K;
        const float *wd = d16 + r * (K / 16), *wm = m32 + r * groups;
        for (int c = 0; c < nc; c++) {
            float total = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                const int8_t *a = qa + c * K + g * GROUP, *b = wq + g * GROUP;
                int lo = 0, hi = 0;
                for (int j = 0; j < 16; j++) lo += a[j] * b[j];
                for (int j = 16; j < 32; j++) hi += a[j] * b[j];
                total += da[c * groups + g] * (wd[2 * g] * lo + wd[2 * g + 1] * hi);
                /* the K-quants' activation sums are integers (q8_K's bsums), without d */
                total += wm[g] * (is_k(type) ? da[c * groups + g] * sa[c * groups + g] : sa[c * groups + g]);
            }
            y[c * ldy + r] = total;
        }
    }
#endif
}

#ifdef __AVX2__
/* Group g (values 32g..32g+31) of a row of a 32-value type, straight from the blocks:
 * the same int8 values, scale (unpack_row's d16 for both its halves) and offset that
 * unpack_row writes for it (same expressions), for the paths of up to DIRECT_ROWS
 * activation rows, which skip the unpacked copy. */
static inline __attribute__((always_inline)) __m256i
group_q(const int type, const uint8_t *restrict row, int64_t g, float *d, float *m) {
    switch (type) {
    case T_Q8_0: {
        const uint8_t *b = row + g * 34;
        *d = fp16(b);
        *m = 0.0f;
        return _mm256_loadu_si256((const __m256i *)(b + 2));
    }
    case T_Q4_0: case T_Q4_1: {
        const uint8_t *b = row + g * (type == T_Q4_0 ? 18 : 20);
        *d = fp16(b);
        *m = type == T_Q4_1 ? fp16(b + 2) : 0.0f;
        return nibbles(b + (type == T_Q4_0 ? 2 : 4), type == T_Q4_0 ? -8 : 0);
    }
    default: { /* Q5_0, Q5_1 */
        const uint8_t *b = row + g * (type == T_Q5_0 ? 22 : 24);
        *d = fp16(b);
        *m = type == T_Q5_1 ? fp16(b + 2) : 0.0f;
        int h = type == T_Q5_0 ? 2 : 4;
        return fives(b + h, b + h + 4, type == T_Q5_0 ? -16 : 0);
    }
    }
}

/* Sums of w * a per 4 values (int32): dot4 takes its first operand unsigned, so signed
 * weights go in as |w| with a's signs flipped where w < 0; the types whose values are never
 * negative (Q4_1, Q5_1) skip that, and the sums are the same integers either way. */
static inline __attribute__((always_inline)) __m256i
product(const int type, __m256i w, __m256i wabs, __m256i a) {
    if (type == T_Q4_1 || type == T_Q5_1) return dot4(w, a);
    return dot4(wabs, _mm256_sign_epi8(a, w));
}

/* block_dot's arithmetic for one weight row read straight from its blocks (group_q)
 * against NC activation rows: what up to DIRECT_ROWS rows take instead of the unpacked
 * tile, whose copy costs more than it saves when few rows share it. One weight row at a
 * time: a thread's single stream through memory is what the hardware prefetches best (two
 * interleaved rows, even prefetched by hand, ran Qwen's decode products at 4 rows ~25 %
 * slower, and an LM head at 2-4 rows at a third of one row's bandwidth unprefetched). */
static inline __attribute__((always_inline)) void
direct_dot(const int type, const uint8_t *restrict w, int64_t K, const int NC,
           const int8_t *restrict qa, const float *restrict da, const float *restrict sa,
           float *restrict y, int64_t ldy) {
    int64_t groups = K / GROUP;
    __m256 acc[CHUNK];
    float mins[CHUNK];
    for (int c = 0; c < NC; c++) acc[c] = _mm256_setzero_ps(), mins[c] = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        float d, m;
        __m256i wq = group_q(type, w, g, &d, &m), wabs = _mm256_sign_epi8(wq, wq);
        __m256 scale = _mm256_set1_ps(d);
        for (int c = 0; c < NC; c++) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(qa + c * K + g * GROUP));
            __m256 sd = _mm256_set1_ps(da[c * groups + g]);
            __m256i p = product(type, wq, wabs, a);
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(scale, sd), acc[c]);
            if (has_min(type)) mins[c] += m * sa[c * groups + g];
        }
    }
    for (int c = 0; c < NC; c++) y[c * ldy] = hsum(acc[c]) + mins[c];
}

/* The K-quants (Q4_K, Q5_K, Q6_K), a 256-value superblock at a time, in integers as ggml
 * sums them. A superblock's value k is
 *
 *     d * sc[k / 16] * q[k] + m * mn[k / 32]        (sc, q, mn integers; d, m floats)
 *
 * (Q4_K, Q5_K: q 0..15 or 0..31 with 6-bit scales and mins, m = -dmin; Q6_K: q -32..31,
 * int8 scales, no mins), and the activations' superblock is da * qa with integer sums bs
 * per 32 values (activations.c), so its product is
 *
 *     d * da * sum_k sc * q * qa  +  m * da * sum_g mn * bs
 *
 * The first sum is exact in int32 lanes whatever order it is taken in, and each mn * bs
 * is an exact float; the float work is two multiply-adds per superblock, where the
 * 32-value types take one per 32 values. Every (weight row, activation row) pair runs the
 * same float instructions for any number of rows, so batched rows equal rows alone. */
typedef struct {
    float d, m;   /* the superblock's factors (m = 0 for Q6_K) */
    __m256i sc[2]; /* int16 scales, each 128-bit lane holding 8 (Q6_K: sc[0] groups 0-3, sc[1] 4-7) */
    __m256 mn;    /* the 8 mins, as floats */
} kscales;

static inline __attribute__((always_inline)) void k_scales(const int type, const uint8_t *restrict blk,
                                                           kscales *restrict s) {
    if (type == T_Q6_K) {
        __m128i sc = _mm_loadu_si128((const __m128i *)(blk + 192));
        s->sc[0] = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(sc));
        s->sc[1] = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_srli_si128(sc, 8)));
        s->d = fp16(blk + 208);
        s->m = 0.0f;
        return;
    }
    uint8_t sm[16];
    scales_mins_k4(blk + 4, sm, sm + 8);
    __m128i v = _mm_loadu_si128((const __m128i *)sm);
    s->sc[0] = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(v));
    s->mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
    s->d = fp16(blk);
    s->m = -fp16(blk + 2);
}

/* Group g's int16 scales for madd: scale 2g' in the low 128-bit lane (values 0-15) and
 * 2g' + 1 in the high one (Q6_K, g' = g % 4), or scale g in both (Q4_K, Q5_K). */
static inline __attribute__((always_inline)) __m256i k_scale(const int type, const kscales *s, int g) {
    if (type == T_Q6_K) {
        int lo = 2 * (g % 4), hi = lo + 1;
        __m256i pick = _mm256_set_m128i(_mm_set1_epi16((short)((2 * hi + 1) << 8 | 2 * hi)),
                                        _mm_set1_epi16((short)((2 * lo + 1) << 8 | 2 * lo)));
        return _mm256_shuffle_epi8(s->sc[g / 4], pick);
    }
    return _mm256_shuffle_epi8(s->sc[0], _mm256_set1_epi16((short)((2 * g + 1) << 8 | 2 * g)));
}

/* Values 32g..32g+31 of superblock blk as int8: unpack_row's values for them. */
static inline __attribute__((always_inline)) __m256i k_group(const int type, const uint8_t *restrict blk,
                                                             int g) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    if (type == T_Q6_K) { /* sixes128's quarter g % 4 of half g / 4 */
        int k = g % 4;
        __m256i lo = _mm256_loadu_si256((const __m256i *)(blk + 64 * (g / 4) + 32 * (k & 1)));
        __m256i hi = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * (g / 4)));
        lo = _mm256_and_si256(_mm256_srl_epi16(lo, _mm_cvtsi32_si128(4 * (k >> 1))), m4);
        hi = _mm256_and_si256(_mm256_srl_epi16(hi, _mm_cvtsi32_si128(2 * k)), _mm256_set1_epi8(0x03));
        return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
    }
    /* Q4_K, Q5_K: pair g / 2's low (even g) or high nibbles; Q5_K's fifth bit is bit g */
    __m256i v = _mm256_loadu_si256((const __m256i *)(blk + (type == T_Q4_K ? 16 : 48) + 32 * (g / 2)));
    v = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(4 * (g & 1))), m4);
    if (type == T_Q5_K) {
        __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 16));
        h = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(g)), _mm256_set1_epi8(1));
        v = _mm256_or_si256(v, _mm256_slli_epi16(h, 4));
    }
    return v;
}

/* One weight row straight from its superblocks against NC activation rows. The int16
 * pair sums of maddubs cannot saturate (|q| <= 32, |qa| <= 127), and madd scales them per
 * 16 values into int32 lanes. */
static inline __attribute__((always_inline)) void
k_dot(const int type, const uint8_t *restrict w, int64_t K, const int NC, const int8_t *restrict qa,
      const float *restrict da, const float *restrict sa, float *restrict y, int64_t ldy) {
    const int64_t groups = K / GROUP;
    __m256 acc[CHUNK];
    for (int c = 0; c < NC; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / QK; b++) {
        const uint8_t *blk = w + b * block_bytes(type);
        kscales s;
        k_scales(type, blk, &s);
        __m256i isum[CHUNK];
        for (int c = 0; c < NC; c++) isum[c] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
            __m256i wq = k_group(type, blk, g), wabs = _mm256_sign_epi8(wq, wq);
            __m256i sc = k_scale(type, &s, g);
            for (int c = 0; c < NC; c++) {
                __m256i a = _mm256_loadu_si256((const __m256i *)(qa + c * K + b * QK + g * GROUP));
                __m256i p = type == T_Q6_K ? _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(a, wq))
                                           : _mm256_maddubs_epi16(wq, a);
                isum[c] = _mm256_add_epi32(isum[c], _mm256_madd_epi16(p, sc));
            }
        }
        for (int c = 0; c < NC; c++) {
            float dc = da[c * groups + b * 8];
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[c]), _mm256_set1_ps(s.d * dc), acc[c]);
            if (type != T_Q6_K) { /* mn * bs: exact (integers below 2^18) */
                __m256 bs = _mm256_loadu_ps(sa + c * groups + b * 8);
                acc[c] = _mm256_fmadd_ps(_mm256_mul_ps(s.mn, bs), _mm256_set1_ps(s.m * dc), acc[c]);
            }
        }
    }
    for (int c = 0; c < NC; c++) y[c * ldy] = hsum(acc[c]);
}

/* y [M, N] straight from the blocks, for M <= DIRECT_ROWS of a 32-value type and any M of
 * a K-quant: weight rows in parallel, one at a time per thread, each against the
 * activation rows CHUNK at a time. A prompt's rows go a pass of PASS_BYTES at a time (so
 * they stay in L2 while every weight row streams them), and each CHUNK of them meets
 * ROW_BLOCK weight rows in turn while it is in L1: a K-quant product of 512 rows ran
 * 15-30 % faster than with each weight row streaming all 512 from L3 (bench: a 1.1B
 * model's shapes). Decode's few rows are one chunk, so it still reads the weights in one
 * stream, row after row. Two weight rows sharing each activation load (a 2 x 4 register
 * block) ran 10-20 % slower: their accumulators no longer fit the 16 registers. */
#define PASS_BYTES (192 * 1024)
#define ROW_BLOCK 8
#define DIRECT_ROWS 8 /* past it, the unpacked tile: Qwen's decode products at 16 rows, ~10 % faster */
static void rows_direct(int type, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K,
                        const int8_t *qa, const float *da, const float *sa, int64_t M, float *y,
                        int64_t ldy) {
    int64_t groups = K / GROUP;
    int64_t pass = PASS_BYTES / K / CHUNK * CHUNK;
    if (pass < CHUNK) pass = CHUNK;
#define D(T, NC)                                                                               \
    (is_k(T) ? k_dot(T, w + n * row_bytes, K, NC, qa + c0 * K, da + c0 * groups,               \
                     sa + c0 * groups, y + c0 * ldy + n, ldy)                                  \
             : direct_dot(T, w + n * row_bytes, K, NC, qa + c0 * K, da + c0 * groups,          \
                          sa + c0 * groups, y + c0 * ldy + n, ldy))
#define DIRECT(T)                                                                              \
    _Pragma("omp parallel")                                                                   \
    for (int64_t m0 = 0; m0 < M; m0 += pass) {                                                \
        int64_t m1 = M - m0 < pass ? M : m0 + pass;                                           \
        _Pragma("omp for schedule(static) nowait")                                            \
        for (int64_t n0 = 0; n0 < N; n0 += ROW_BLOCK)                                         \
            for (int64_t c0 = m0; c0 < m1; c0 += CHUNK)                                       \
                for (int64_t n = n0; n < N && n < n0 + ROW_BLOCK; n++) {                      \
                    switch (m1 - c0 < CHUNK ? m1 - c0 : CHUNK) {                              \
                    case 1: D(T, 1); break;                                                    \
                    case 2: D(T, 2); break;                                                    \
                    case 3: D(T, 3); break;                                                    \
                    default: D(T, 4); break;                                                   \
                    }                                                                          \
                }                                                                              \
    }                                                                                          \
    return;
    switch (type) {
    case T_Q4_0: DIRECT(T_Q4_0)
    case T_Q4_1: DIRECT(T_Q4_1)
    case T_Q5_0: DIRECT(T_Q5_0)
    case T_Q5_1: DIRECT(T_Q5_1)
    case T_Q4_K: DIRECT(T_Q4_K)
    case T_Q5_K: DIRECT(T_Q5_K)
    case T_Q6_K: DIRECT(T_Q6_K)
    default: DIRECT(T_Q8_0)
    }
#undef DIRECT
#undef D
}

#endif

/* y[M, N] (row stride ldy) = activations (from cgn_quantize_rows) @ W[N, K].T */
void cgn_qmatmul(int type, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K,
                 const int8_t *qa, const float *da, const float *sa, int64_t M, float *y,
                 int64_t ldy) {
    int64_t tiles = (N + TILE - 1) / TILE, groups = K / GROUP;
#ifdef __AVX2__
    /* decode: blocks straight into the dot products, no unpacked tile (1.5-2x faster at
     * one row: the tile's copy costs more than it saves when few rows share it); the
     * K-quants always (their superblocks decode cheaply) */
    if (M <= DIRECT_ROWS || is_k(type)) {
        rows_direct(type, w, row_bytes, N, K, qa, da, sa, M, y, ldy);
        return;
    }
#endif
    #pragma omp parallel
    {
        int8_t *q = malloc(TILE * K);
        float *d16 = malloc(sizeof(float) * TILE * (K / 16));
        float *m32 = malloc(sizeof(float) * TILE * groups);
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            int64_t n0 = t * TILE;
            int nr = (int)(N - n0 < TILE ? N - n0 : TILE);
            for (int r = 0; r < nr; r++)
                unpack_row(type, w + (n0 + r) * row_bytes, K, q + r * K, d16 + r * (K / 16),
                           m32 + r * groups);
            for (int64_t c0 = 0; c0 < M; c0 += CHUNK) {
                int nc = (int)(M - c0 < CHUNK ? M - c0 : CHUNK);
                tile_dot(K, type, nr, q, d16, m32, nc, qa + c0 * K, da + c0 * groups, sa + c0 * groups,
                         y + c0 * ldy + n0, ldy);
            }
        }
        free(q); free(d16); free(m32);
    }
}
