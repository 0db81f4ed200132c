/* Matrix products straight from GGUF's quantized blocks (cgn-infer's CPU kernels).
 *
 * y[m, n] = sum_k x[m, k] * W[n, k], where W's rows are the file's own blocks,
 * untouched: no float copy of the model exists. Activations are quantized per row
 * into int8 with a float scale and the scaled sum per 32 values (activations.c, as
 * llama.cpp quantizes them for each weight type), and each weight row is read, a
 * tile at a time or (for up to 16 rows) a group at a time, in a common form:
 *
 *     value[k] = d16[k / 16] * q[k] + m32[k / 32]        (q: int8)
 *
 * which holds every supported type exactly (Q6_K's scales are per 16 values, the
 * others' per 32 or more; Q4_1, Q5_1 and Q4_K carry the additive m). One product is
 * then integer dot products per 16 values, scaled in float:
 *
 *     y = sum_g d16 * da[g] * (q . qa)_g + sum_g m32[g] * sa[g]
 *
 * Each output row's arithmetic is the same whatever the number of rows M in the
 * call and whichever way the weights were read, so a sequence's result never
 * depends on the rows batched with it.
 * Parallel over weight-row tiles with OpenMP; loaded after torch, this library
 * shares torch's libgomp (same soname), so both use one thread pool.
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

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q6_K = 14 };

static inline float fp16(const uint8_t *p) { return half_to_float((uint16_t)(p[0] | (p[1] << 8))); }

/* Bytes of one block and values it holds, or 0 for a type without a kernel. */
int cgn_block_bytes(int type) {
    switch (type) {
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    case T_Q5_1: return 24;
    case T_Q8_0: return 34;
    case T_Q4_K: return 144;
    case T_Q6_K: return 210;
    default: return 0;
    }
}

int cgn_block_values(int type) { return (type == T_Q4_K || type == T_Q6_K) ? 256 : 32; }

static void scale_min_k4(int j, const uint8_t *s, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* 16 bytes of nibbles -> 32 values: low nibbles first, then high (ggml's order), plus `add`. */
static inline void nibbles16(const uint8_t *restrict qs, int8_t *restrict y, int add) {
#ifdef __AVX2__
    __m128i raw = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(0x0f);
    __m256i v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m), _mm_and_si128(raw, m));
    _mm256_storeu_si256((__m256i *)y, _mm256_add_epi8(v, _mm256_set1_epi8((char)add)));
#else
    for (int j = 0; j < 16; j++) {
        y[j] = (int8_t)((qs[j] & 0xf) + add);
        y[j + 16] = (int8_t)((qs[j] >> 4) + add);
    }
#endif
}

/* Q5_0 / Q5_1: nibbles plus a fifth bit per value from qh (bit j for value j); `add` -16 or 0. */
static inline void fives32(const uint8_t *restrict qh, const uint8_t *restrict qs,
                           int8_t *restrict y, int add) {
    uint32_t h;
    memcpy(&h, qh, 4);
#ifdef __AVX2__
    __m128i raw = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(0x0f);
    __m256i v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m), _mm_and_si128(raw, m));
    /* byte j = 0xff where bit j of h is set */
    __m256i bits = _mm256_shuffle_epi8(_mm256_set1_epi32((int)h),
                                       _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                         0x0101010101010101, 0));
    bits = _mm256_cmpeq_epi8(_mm256_or_si256(bits, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                             _mm256_set1_epi64x(-1));
    v = _mm256_or_si256(v, _mm256_and_si256(bits, _mm256_set1_epi8(0x10)));
    _mm256_storeu_si256((__m256i *)y, _mm256_add_epi8(v, _mm256_set1_epi8((char)add)));
#else
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
        for (int64_t b = 0; b < nb; b++, src += 144) {
            float d = fp16(src), dmin = fp16(src + 2);
            const uint8_t *scales = src + 4, *qs = src + 16;
            for (int j = 0; j < 4; j++, qs += 32) {
                int sc, m;
                for (int h = 0; h < 2; h++) {
                    scale_min_k4(2 * j + h, scales, &sc, &m);
                    int64_t g = b * 8 + 2 * j + h;
                    d16[2 * g] = d16[2 * g + 1] = d * sc;
                    m32[g] = -dmin * m;
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
block_dot(int64_t K, const int NR, const int8_t *restrict q, const float *restrict d16,
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
            for (int64_t g = 0; g < groups; g++) mins += wm[g] * sa[c * groups + g];
            y[c * ldy + r] = hsum(acc[r][c]) + mins;
        }
    }
}
#endif

/* y[c][r] = row r of the unpacked tile against activation row c, for r < nr, c < nc. */
static void tile_dot(int64_t K, int nr, const int8_t *restrict q, const float *restrict d16,
                     const float *restrict m32, int nc, const int8_t *restrict qa,
                     const float *restrict da, const float *restrict sa, float *restrict y,
                     int64_t ldy) {
    int64_t groups = K / GROUP;
#ifdef __AVX2__
    for (int r = 0; r < nr; r += 2) {
        const int8_t *wq = q + r * K;
        const float *wd = d16 + r * (K / 16), *wm = m32 + r * groups;
        float *out = y + r;
#define BLOCK(NR, NC) block_dot(K, NR, wq, wd, wm, NC, qa, da, sa, out, ldy)
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
                total += wm[g] * sa[c * groups + g];
            }
            y[c * ldy + r] = total;
        }
    }
#endif
}

#ifdef __AVX2__
/* Group g (values 32g..32g+31) of a row of any supported type, straight from the blocks:
 * the same int8 values, 16-value scales and offset that unpack_row writes for it (same
 * expressions), for the paths of up to DIRECT_ROWS activation rows, which skip the
 * unpacked copy. */
static inline __attribute__((always_inline)) __m256i
group_q(const int type, const uint8_t *restrict row, int64_t g, float *d0, float *d1, float *m) {
    int8_t tmp[32];
    switch (type) {
    case T_Q8_0: {
        const uint8_t *b = row + g * 34;
        *d0 = *d1 = fp16(b);
        *m = 0.0f;
        return _mm256_loadu_si256((const __m256i *)(b + 2));
    }
    case T_Q4_0: case T_Q4_1: {
        const uint8_t *b = row + g * (type == T_Q4_0 ? 18 : 20);
        *d0 = *d1 = fp16(b);
        *m = type == T_Q4_1 ? fp16(b + 2) : 0.0f;
        nibbles16(b + (type == T_Q4_0 ? 2 : 4), tmp, type == T_Q4_0 ? -8 : 0);
        return _mm256_loadu_si256((const __m256i *)tmp);
    }
    case T_Q4_K: { /* sub-block g % 8 of block g / 8: pair j's low or high nibbles */
        const uint8_t *b = row + (g / 8) * 144;
        int s = (int)(g % 8), sc, mn;
        scale_min_k4(s, b + 4, &sc, &mn);
        *d0 = *d1 = fp16(b) * sc;
        *m = -fp16(b + 2) * mn;
        __m256i v = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * (s / 2)));
        if (s & 1) v = _mm256_srli_epi16(v, 4);
        return _mm256_and_si256(v, _mm256_set1_epi8(0x0f));
    }
    case T_Q6_K: { /* sixes128's quarter g % 4 of half (g % 8) / 4 of block g / 8 */
        const uint8_t *b = row + (g / 8) * 210;
        int s = (int)(g % 8), k = s % 4;
        const int8_t *sc = (const int8_t *)(b + 192);
        float d = fp16(b + 208);
        *d0 = d * sc[2 * s];
        *d1 = d * sc[2 * s + 1];
        *m = 0.0f;
        __m256i lo = _mm256_loadu_si256((const __m256i *)(b + 64 * (s / 4) + 32 * (k & 1)));
        __m256i hi = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * (s / 4)));
        lo = _mm256_and_si256(_mm256_srl_epi16(lo, _mm_cvtsi32_si128(4 * (k >> 1))), _mm256_set1_epi8(0x0f));
        hi = _mm256_and_si256(_mm256_srl_epi16(hi, _mm_cvtsi32_si128(2 * k)), _mm256_set1_epi8(0x03));
        return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
    }
    default: { /* Q5_0, Q5_1 */
        const uint8_t *b = row + g * (type == T_Q5_0 ? 22 : 24);
        *d0 = *d1 = fp16(b);
        *m = type == T_Q5_1 ? fp16(b + 2) : 0.0f;
        int h = type == T_Q5_0 ? 2 : 4;
        fives32(b + h, b + h + 4, tmp, type == T_Q5_0 ? -16 : 0);
        return _mm256_loadu_si256((const __m256i *)tmp);
    }
    }
}

/* Sums of w * a per 4 values (int32): dot4 takes its first operand unsigned, so signed
 * weights go in as |w| with a's signs flipped where w < 0; the types whose values are never
 * negative (Q4_1, Q5_1, Q4_K) skip that, and the sums are the same integers either way. */
static inline __attribute__((always_inline)) __m256i
product(const int type, __m256i w, __m256i wabs, __m256i a) {
    if (type == T_Q4_1 || type == T_Q5_1 || type == T_Q4_K) return dot4(w, a);
    return dot4(wabs, _mm256_sign_epi8(a, w));
}

/* One weight row against one activation row, with block_dot's arithmetic exactly. */
static inline __attribute__((always_inline)) float
row_dot1(const int type, const uint8_t *restrict row, int64_t K, const int8_t *restrict qa,
         const float *restrict da, const float *restrict sa) {
    int64_t groups = K / GROUP;
    __m256 acc = _mm256_setzero_ps();
    float mins = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        float d0, d1, m;
        __m256i w = group_q(type, row, g, &d0, &d1, &m);
        __m256i wabs = _mm256_sign_epi8(w, w);
        __m256 scale = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(d0)), _mm_set1_ps(d1), 1);
        __m256i a = _mm256_loadu_si256((const __m256i *)(qa + g * GROUP));
        __m256 sd = _mm256_set1_ps(da[g]);
        __m256i p = product(type, w, wabs, a);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(scale, sd), acc);
        mins += m * sa[g];
    }
    return hsum(acc) + mins;
}

/* block_dot's arithmetic for NR weight rows (pairs) read straight from their blocks
 * (group_q) against NC activation rows: what a few decode rows take instead of the
 * unpacked tile, whose copy costs more than it saves when few rows share it. `far`: the
 * matrix streams from memory, where two interleaved rows defeat the hardware prefetcher
 * (an LM head at 2-4 rows ran at a third of one row's bandwidth), so prefetch them. */
static inline __attribute__((always_inline)) void
direct_dot(const int type, const int NR, const uint8_t *restrict w, int64_t row_bytes, int64_t K,
           const int far, const int NC, const int8_t *restrict qa, const float *restrict da,
           const float *restrict sa, float *restrict y, int64_t ldy) {
    int64_t groups = K / GROUP;
    __m256 acc[2][CHUNK];
    float mins[2][CHUNK];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = _mm256_setzero_ps(), mins[r][c] = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        __m256i wq[2], wabs[2];
        __m256 scale[2];
        float m[2];
        for (int r = 0; r < NR; r++) {
            float d0, d1;
            if (far) /* a few hundred bytes ahead in each row (row_bytes / groups per group) */
                _mm_prefetch((const char *)(w + r * row_bytes + (g * row_bytes) / groups + 384),
                             _MM_HINT_T0);
            wq[r] = group_q(type, w + r * row_bytes, g, &d0, &d1, &m[r]);
            wabs[r] = _mm256_sign_epi8(wq[r], wq[r]);
            scale[r] = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(d0)), _mm_set1_ps(d1), 1);
        }
        for (int c = 0; c < NC; c++) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(qa + c * K + g * GROUP));
            __m256 sd = _mm256_set1_ps(da[c * groups + g]);
            for (int r = 0; r < NR; r++) {
                __m256i p = product(type, wq[r], wabs[r], a);
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(scale[r], sd), acc[r][c]);
                mins[r][c] += m[r] * sa[c * groups + g];
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) y[c * ldy + r] = hsum(acc[r][c]) + mins[r][c];
}

/* y [M, N] for M <= DIRECT_ROWS: pairs of weight rows in parallel,
 * each pair against every activation row, CHUNK at a time, straight from the blocks. */
#define DIRECT_ROWS 16
#define FAR_BYTES (8 << 20) /* a matrix this large is read from memory, not cache */
static void rows_direct(int type, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K,
                        const int8_t *qa, const float *da, const float *sa, int64_t M, float *y,
                        int64_t ldy) {
    int64_t groups = K / GROUP;
    const int far = N * row_bytes > FAR_BYTES;
#define D(T, NR, NC) direct_dot(T, NR, rows, row_bytes, K, far, NC, a, d, s, out, ldy)
#define DIRECT(T)                                                                              \
    _Pragma("omp parallel for schedule(static)")                                              \
    for (int64_t n = 0; n < N; n += 2) {                                                      \
        for (int64_t c0 = 0; c0 < M; c0 += CHUNK) {                                           \
            int nc = (int)(M - c0 < CHUNK ? M - c0 : CHUNK);                                  \
            const uint8_t *rows = w + n * row_bytes;                                           \
            const int8_t *a = qa + c0 * K;                                                     \
            const float *d = da + c0 * groups, *s = sa + c0 * groups;                          \
            float *out = y + c0 * ldy + n;                                                     \
            if (n + 1 < N) {                                                                   \
                switch (nc) {                                                                  \
                case 1: D(T, 2, 1); break;                                                     \
                case 2: D(T, 2, 2); break;                                                     \
                case 3: D(T, 2, 3); break;                                                     \
                default: D(T, 2, 4); break;                                                    \
                }                                                                              \
            } else {                                                                           \
                switch (nc) {                                                                  \
                case 1: D(T, 1, 1); break;                                                     \
                case 2: D(T, 1, 2); break;                                                     \
                case 3: D(T, 1, 3); break;                                                     \
                default: D(T, 1, 4); break;                                                    \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    return;
    switch (type) {
    case T_Q4_0: DIRECT(T_Q4_0)
    case T_Q4_1: DIRECT(T_Q4_1)
    case T_Q5_0: DIRECT(T_Q5_0)
    case T_Q5_1: DIRECT(T_Q5_1)
    case T_Q4_K: DIRECT(T_Q4_K)
    case T_Q6_K: DIRECT(T_Q6_K)
    default: DIRECT(T_Q8_0)
    }
#undef DIRECT
#undef D
}

static void rows_dot1(int type, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K,
                      const int8_t *qa, const float *da, const float *sa, float *y) {
#define ROWS(T)                                                                               \
    _Pragma("omp parallel for schedule(static)")                                              \
    for (int64_t n = 0; n < N; n++) y[n] = row_dot1(T, w + n * row_bytes, K, qa, da, sa);   \
    return;
    switch (type) {
    case T_Q4_0: ROWS(T_Q4_0)
    case T_Q4_1: ROWS(T_Q4_1)
    case T_Q5_0: ROWS(T_Q5_0)
    case T_Q5_1: ROWS(T_Q5_1)
    default: ROWS(T_Q8_0)
    }
#undef ROWS
}
#endif

/* y[M, N] (row stride ldy) = activations (from cgn_quantize_rows) @ W[N, K].T */
void cgn_qmatmul(int type, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K,
                 const int8_t *qa, const float *da, const float *sa, int64_t M, float *y,
                 int64_t ldy) {
    int64_t tiles = (N + TILE - 1) / TILE, groups = K / GROUP;
#ifdef __AVX2__
    /* decode: blocks straight into the dot products, no unpacked tile (1.5-2x faster at
     * one row: the tile's copy costs more than it saves when few rows share it) */
    if (M == 1 && type != T_Q4_K && type != T_Q6_K) {
        rows_dot1(type, w, row_bytes, N, K, qa, da, sa, y);
        return;
    }
    if (M <= DIRECT_ROWS) {
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
                tile_dot(K, nr, q, d16, m32, nc, qa + c0 * K, da + c0 * groups, sa + c0 * groups,
                         y + c0 * ldy + n0, ldy);
            }
        }
        free(q); free(d16); free(m32);
    }
}
