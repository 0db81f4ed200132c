/* A temperature draw's arithmetic (cgn_infer/sampling.py), from a logits row to the token:
 * the probabilities, the tokens top-k, top-p and min-p keep, and which of them a uniform
 * number picks. sampling.py's numpy fallback (where the kernels are not loaded) computes
 * the same float operations in the same order, so both pick the same token for the same
 * row and number (tests/test_sampling.py holds them to it):
 *
 *   1. s = logit / T in float32, and its max;
 *   2. p = exp(s - max) by the polynomial in `expf_poly` (float32, no fused multiply-adds,
 *      so numpy can repeat it bit for bit); tokens with p <= e^-30 get 0 (each weighs under
 *      1e-13 of the best token, below float32's resolution of the mass);
 *   3. top-k (0 < k < tokens left): the k largest p stay, ties to the lower token id;
 *   4. top-p (< 1): in order of p descending, ties to the lower id, the shortest prefix
 *      whose running float64 sum reaches top_p times the row's sum (`row_sum`) stays;
 *   5. min-p (> 0): those with p >= min_p * the largest p (float32) stay;
 *   6. the draw: the first token in id order whose running sum exceeds u times the row's
 *      sum (u in [0, 1)), the running sum taken block by block as `row_sum` defines it.
 *
 * Sums ("the row's sum") are float64: each block of 64 ids summed in id order from 0.0,
 * then the blocks' sums in order from 0.0; tokens a filter dropped weigh 0, which leaves
 * every sum's bits as they are. Blocks sum side by side, where one running sum over the
 * whole row waited on each add in turn.
 *
 * In numpy the selection took 0.4-2.2 ms per token over Qwen's 151,936 logits at
 * T 0.7-1, where most tokens are candidates (argpartition and argsort over all of them).
 * Here top-k keeps a bounded min-heap (most tokens fail its first comparison) and top-p
 * sorts only the tokens above a bound found from a histogram of p's float exponents
 * (monotone in p, so the tokens above a bin are a prefix of the sorted order, ties
 * included). Rows of up to 2^31 tokens.
 */
#include <math.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NEGLIGIBLE 0x1.a56e0cp-44f /* float32(e^-30): sampling.py's _NEGLIGIBLE */
#define BLOCK 64                   /* ids per block of the row's sum */

/* exp(d) for d <= 0 in float32: Cephes' expf (range reduction by ln 2 in two parts, a
 * degree-5 polynomial, 2^n by the exponent's bits; its constants as float32 hex, which
 * sampling._EXP repeats), within 2 ulp of exp. Every operation a separate float32
 * multiply or add (GCC does not fuse them under -std=c11, and sampling._exp repeats them
 * in numpy). Below -87 it is exp(-87), far under NEGLIGIBLE. */
static inline float expf_poly(float d) {
    if (!(d > -87.0f)) d = -87.0f; /* -inf too */
    float n = rintf(d * 0x1.715476p+0f); /* log2(e) */
    float r = d - n * 0x1.63p-1f;         /* ln 2 in two parts */
    r = r - n * -0x1.bd0106p-13f;
    float q = 0x1.a0d2cep-13f;
    q = q * r + 0x1.6e879cp-10f;
    q = q * r + 0x1.11121p-7f;
    q = q * r + 0x1.555382p-5f;
    q = q * r + 0x1.555554p-3f;
    q = q * r + 0x1p-1f;
    float y = q * (r * r) + r + 1.0f;
    uint32_t e = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, sizeof scale);
    return y * scale;
}

#ifdef __AVX2__
/* expf_poly on 8 lanes: the same operations, each the same float32 instruction */
static inline __m256 expf8(__m256 d) {
    d = _mm256_max_ps(d, _mm256_set1_ps(-87.0f)); /* -inf too (d is never NaN here) */
    __m256 n = _mm256_round_ps(_mm256_mul_ps(d, _mm256_set1_ps(0x1.715476p+0f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_sub_ps(d, _mm256_mul_ps(n, _mm256_set1_ps(0x1.63p-1f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-0x1.bd0106p-13f)));
    __m256 q = _mm256_set1_ps(0x1.a0d2cep-13f);
    q = _mm256_add_ps(_mm256_mul_ps(q, r), _mm256_set1_ps(0x1.6e879cp-10f));
    q = _mm256_add_ps(_mm256_mul_ps(q, r), _mm256_set1_ps(0x1.11121p-7f));
    q = _mm256_add_ps(_mm256_mul_ps(q, r), _mm256_set1_ps(0x1.555382p-5f));
    q = _mm256_add_ps(_mm256_mul_ps(q, r), _mm256_set1_ps(0x1.555554p-3f));
    q = _mm256_add_ps(_mm256_mul_ps(q, r), _mm256_set1_ps(0x1p-1f));
    __m256 y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(q, _mm256_mul_ps(r, r)), r),
                             _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

/* A token as one integer in the sorted order's reverse: p's float bits (a positive
 * float's bits grow with it) above the id's complement, so the larger key is the larger
 * p, then the lower id. */
static inline uint64_t key(const float *p, int64_t i) {
    uint32_t b;
    memcpy(&b, &p[i], sizeof b);
    return (uint64_t)b << 32 | (uint32_t)~(uint32_t)i;
}
static inline int64_t id(uint64_t k) { return (int64_t)(uint32_t)~(uint32_t)k; }
static inline float prob(uint64_t k) {
    uint32_t b = (uint32_t)(k >> 32);
    float x;
    memcpy(&x, &b, sizeof x);
    return x;
}
static int descending(const void *x, const void *y) {
    uint64_t a = *(const uint64_t *)x, b = *(const uint64_t *)y;
    return (a < b) - (a > b);
}

/* a min-heap of keys: its root is the one top-k drops first */
static void sift_down(uint64_t *h, int64_t n, int64_t i) {
    for (;;) {
        int64_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && h[l] < h[m]) m = l;
        if (r < n && h[r] < h[m]) m = r;
        if (m == i) return;
        uint64_t t = h[i];
        h[i] = h[m], h[m] = t, i = m;
    }
}

/* Every token whose key is below `floor` weighs 0 from here on. */
static void drop_below(float *p, int64_t n, uint64_t floor) {
    int64_t i = 0;
#ifdef __AVX2__
    const __m256 vf = _mm256_set1_ps(prob(floor));
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(p + i);
        if (_mm256_movemask_ps(_mm256_cmp_ps(v, vf, _CMP_EQ_OQ))) { /* a tie: by id */
            for (int64_t j = i; j < i + 8; j++)
                if (key(p, j) < floor) p[j] = 0.0f;
            continue;
        }
        _mm256_storeu_ps(p + i, _mm256_andnot_ps(_mm256_cmp_ps(v, vf, _CMP_LT_OQ), v));
    }
#endif
    for (; i < n; i++)
        if (key(p, i) < floor) p[i] = 0.0f;
}

static float row_max(const float *p, int64_t n) {
    float best = 0.0f;
    int64_t i = 0;
#ifdef __AVX2__
    __m256 v = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(p + i));
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    for (int j = 0; j < 8; j++) best = lanes[j] > best ? lanes[j] : best;
#endif
    for (; i < n; i++) best = p[i] > best ? p[i] : best;
    return best;
}

/* top-p's bounds: 4^-level, level < LEVELS - 1 (the last level is every token) */
#define LEVELS 13
static const float BOUNDS[LEVELS - 1] = {1.0f, 0x1p-2f, 0x1p-4f, 0x1p-6f, 0x1p-8f, 0x1p-10f,
                                         0x1p-12f, 0x1p-14f, 0x1p-16f, 0x1p-18f, 0x1p-20f, 0x1p-22f};

/* mass[level]: the float32 sum of the p at or above each bound (an estimate) */
static void masses(const float *p, int64_t n, float *mass) {
    for (int l = 0; l < LEVELS - 1; l++) mass[l] = 0.0f;
    int64_t i = 0;
#ifdef __AVX2__
    __m256 acc[LEVELS - 1];
    for (int l = 0; l < LEVELS - 1; l++) acc[l] = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(p + i);
        for (int l = 0; l < LEVELS - 1; l++)
            acc[l] = _mm256_add_ps(acc[l], _mm256_and_ps(v, _mm256_cmp_ps(v, _mm256_set1_ps(BOUNDS[l]), _CMP_GE_OQ)));
    }
    for (int l = 0; l < LEVELS - 1; l++) {
        float lanes[8];
        _mm256_storeu_ps(lanes, acc[l]);
        for (int j = 0; j < 8; j++) mass[l] += lanes[j];
    }
#endif
    for (; i < n; i++)
        for (int l = 0; l < LEVELS - 1; l++)
            if (p[i] >= BOUNDS[l]) mass[l] += p[i];
}

/* p's block sums into sums[(n + BLOCK - 1) / BLOCK], eight blocks side by side; returns
 * the row's sum (the blocks' sums in order). */
static double row_sum(const float *p, int64_t n, double *sums) {
    int64_t blocks = (n + BLOCK - 1) / BLOCK, full = n / BLOCK, b = 0;
    for (; b + 8 <= full; b += 8) {
        const float *q = p + b * BLOCK;
        double s[8] = {0};
        for (int j = 0; j < BLOCK; j++)
            for (int c = 0; c < 8; c++) s[c] += q[c * BLOCK + j];
        for (int c = 0; c < 8; c++) sums[b + c] = s[c];
    }
    for (; b < blocks; b++) {
        double s = 0.0;
        for (int64_t i = b * BLOCK; i < n && i < (b + 1) * BLOCK; i++) s += p[i];
        sums[b] = s;
    }
    double total = 0.0;
    for (b = 0; b < blocks; b++) total += sums[b];
    return total;
}

/* Steps 1-6 above on logits x [n] (n < 2^31); p (n floats), keys (n) and sums (n / 64 + 1)
 * are scratch. Returns the token; -2 where the row holds NaN or +inf or nothing but -inf
 * (sampling.py then cleans it first). */
int64_t cgn_sample(const float *x, int64_t n, float temperature, int64_t top_k, double top_p,
                   float min_p, double u, float *p, uint64_t *keys, double *sums) {
    float top = -INFINITY;
    int broken = 0;
    int64_t i0 = 0, left = 0;
#ifdef __AVX2__
    const __m256 t = _mm256_set1_ps(temperature), big = _mm256_set1_ps(3.40282347e38f);
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    __m256 vtop = ninf, bad = _mm256_setzero_ps();
    for (; i0 + 8 <= n; i0 += 8) {
        __m256 s = _mm256_div_ps(_mm256_loadu_ps(x + i0), t);
        _mm256_storeu_ps(p + i0, s);
        /* NaN or +inf: not (s <= max) and not -inf */
        bad = _mm256_or_ps(bad, _mm256_andnot_ps(_mm256_cmp_ps(s, big, _CMP_LE_OQ),
                                                 _mm256_cmp_ps(s, ninf, _CMP_NEQ_UQ)));
        vtop = _mm256_max_ps(vtop, s);
    }
    broken = _mm256_movemask_ps(bad) != 0;
    float lanes[8];
    _mm256_storeu_ps(lanes, vtop);
    for (int j = 0; j < 8; j++) top = lanes[j] > top ? lanes[j] : top;
#endif
    for (int64_t i = i0; i < n; i++) {
        float s = p[i] = x[i] / temperature;
        broken |= !(s <= 3.40282347e38f) && s != -INFINITY; /* NaN or +inf */
        top = s > top ? s : top;
    }
    if (broken || top == -INFINITY) return -2;
    i0 = 0;
#ifdef __AVX2__
    const __m256 vt = _mm256_set1_ps(top), neg = _mm256_set1_ps(NEGLIGIBLE);
    for (; i0 + 8 <= n; i0 += 8) {
        __m256 e = expf8(_mm256_sub_ps(_mm256_loadu_ps(p + i0), vt));
        __m256 keep = _mm256_cmp_ps(e, neg, _CMP_GT_OQ);
        _mm256_storeu_ps(p + i0, _mm256_and_ps(e, keep));
        left += __builtin_popcount((unsigned)_mm256_movemask_ps(keep));
    }
#endif
    for (int64_t i = i0; i < n; i++) {
        float e = expf_poly(p[i] - top);
        p[i] = e > NEGLIGIBLE ? e : 0.0f;
        left += e > NEGLIGIBLE;
    }
    if (top_k > 0 && top_k < left) { /* the k largest keys, their smallest at the root */
        int64_t h = 0, i = 0;
        for (; h < top_k; i++)
            if (p[i] > 0.0f) keys[h++] = key(p, i);
        for (int64_t j = top_k / 2 - 1; j >= 0; j--) sift_down(keys, top_k, j);
        for (; i < n; i++) {
#ifdef __AVX2__
            /* 8 at a time while none can enter (the root only rises) */
            while (i % 8 == 0 && i + 8 <= n &&
                   !_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + i),
                                                     _mm256_set1_ps(prob(keys[0])), _CMP_GE_OQ)))
                i += 8;
            if (i >= n) break;
#endif
            if (p[i] >= prob(keys[0]) && key(p, i) > keys[0]) keys[0] = key(p, i), sift_down(keys, top_k, 0);
        }
        drop_below(p, n, keys[0]);
        left = top_k;
    }
    if (top_p < 1.0) {
        double goal = top_p * row_sum(p, n, sums);
        /* the highest of the bounds 1, 1/4, 1/16, ... whose tokens at or above hold the
         * goal, by float32 sums (an estimate: a sorted prefix that still falls short takes
         * the next bound down, and the last bound is 0, every token) */
        float mass[LEVELS - 1];
        masses(p, n, mass);
        int level = 0;
        while (level < LEVELS - 1 && !(mass[level] >= goal * (1.0 + 1e-4))) level++;
        for (;; level++) {
            float bound = level < LEVELS - 1 ? BOUNDS[level] : 0x1p-149f;
            int64_t m = 0;
            for (int64_t i = 0; i < n; i++) {
#ifdef __AVX2__
                while (i % 8 == 0 && i + 8 <= n &&
                       !_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + i),
                                                         _mm256_set1_ps(bound), _CMP_GE_OQ)))
                    i += 8;
                if (i >= n) break;
#endif
                if (p[i] >= bound) keys[m++] = key(p, i);
            }
            qsort(keys, (size_t)m, sizeof *keys, descending);
            double sum = 0.0;
            int64_t cut = 0;
            do sum += prob(keys[cut++]); /* at least the most likely token */
            while (cut < m && sum < goal);
            if (sum >= goal || m == left || level == LEVELS - 1) {
                drop_below(p, n, keys[cut - 1]);
                break;
            }
        }
    }
    if (min_p > 0.0f) { /* p >= min_p * the largest p: a floor key with the largest id part */
        float floor = min_p * row_max(p, n);
        uint32_t b;
        memcpy(&b, &floor, sizeof b);
        drop_below(p, n, (uint64_t)b << 32);
    }
    double total = row_sum(p, n, sums), target = u * total, before = 0.0;
    int64_t blocks = (n + BLOCK - 1) / BLOCK, b = 0;
    for (; b < blocks - 1 && !(before + sums[b] > target); b++) before += sums[b];
    int64_t end = (b + 1) * BLOCK < n ? (b + 1) * BLOCK : n;
    for (int64_t i = b * BLOCK; i < end; i++)
        if (p[i] > 0.0f && (before += p[i]) > target) return i;
    for (int64_t i = end - 1; i >= 0; i--) /* rounding: the last token left up to here */
        if (p[i] > 0.0f) return i;
    return -2;
}
