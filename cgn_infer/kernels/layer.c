/* A whole transformer layer of cgn-infer in one call: the decode and prefill hot path.
 *
 * x [T, D] (the residual stream, float32) is updated in place:
 *
 *     h = rms_norm(x) * attn_norm;   qkv = h @ Wqkv.T (+ bias);   rotate q and k (RoPE)
 *     each row's K and V into its slot of the paged pool;   a = attention (cgn_attend)
 *     x += a @ Wo.T;   h = rms_norm(x) * ffn_norm;   [g | u] = h @ Wgu.T
 *     x += (silu(g) * u) @ Wd.T
 *
 * and, for a row whose request names a LoRA adapter, each product plus that adapter's
 * scale * B (A h) (lora_add; the base rows of the same step pay one test per matrix).
 *
 * with every matrix in its GGUF blocks (cgn_qmatmul, qmatmul.c). Python made ~15 torch
 * ops and ~10 ctypes calls per layer for this, a third of a decode step
 * (bench/results/infer_profile.md); here it is one call.
 *
 * RoPE rotates adjacent pairs (the loader permutes NEOX-layout q/k rows into pairs) by the
 * table's (cos, sin) at each row's position. Every row's arithmetic is independent of the
 * other rows in the call, as in qmatmul.c, so batching and chunking change nothing.
 * Scratch is one buffer per calling thread, grown to the largest step it has seen.
 * The KV pool holds float32, float16 or bfloat16 (cgn_step.kv_type): K and V are rounded
 * to it as they are written and widened back to float32 as attention reads them.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* The OpenMP threads of the calling thread's next parallel regions (its products and
 * layers): torch.set_num_threads' effect, for a process without torch. */
void cgn_set_threads(int n) {
#ifdef _OPENMP
    omp_set_num_threads(n > 0 ? n : 1);
#else
    (void)n;
#endif
}

#define GROUP 32
#define MAX_PARTS 4

/* A weight matrix [out, K]: its parts' block rows stacked (a fused QKV may mix types).
 * backends/quantized.py builds one per QuantMatrix, once. */
typedef struct {
    int64_t parts, out, type[MAX_PARTS], rows[MAX_PARTS], row_bytes[MAX_PARTS];
    const uint8_t *data[MAX_PARTS];
} cgn_matrix;

/* One LoRA pair of one layer for one loaded adapter: y += row scale * factor * B (A x),
 * A [rank, in] and B [out, rank] float32 (rank 0: this matrix is not adapted). */
typedef struct {
    int64_t rank, out;
    const float *a, *b;
    float factor; /* alpha / rank (the adapter's own scale) */
} cgn_lora_pair;

/* The matrices an adapter may adapt (cgn_core/lora.py's TARGETS, in that order). */
enum { L_Q, L_K, L_V, L_O, L_GATE, L_UP, L_DOWN, L_TARGETS };
#define MAX_LORA_RANK 512

typedef struct {
    cgn_lora_pair p[L_TARGETS];
} cgn_lora_layer;

/* One layer's weights and shape. bqkv is NULL for a model without QKV biases. lora: the
 * loaded adapters' pairs for this layer by adapter slot (NULL: none loaded). */
typedef struct {
    int64_t dim, heads, kv_heads, head_dim, ffn;
    float eps, scale;
    const float *attn_norm, *ffn_norm, *bqkv;
    cgn_matrix wqkv, wo, w_gate_up, w_down;
    const cgn_lora_layer *lora;
    int64_t lora_slots;
} cgn_layer_weights;

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 }; /* the pool's element type */

/* What every layer of a step reads: rows, their positions and KV slots, the attention's
 * view of the pool (as cgn_attend takes it), and the RoPE table [positions, hd/2, 2]. */
typedef struct {
    int64_t rows, table_width, kv_type;
    const int64_t *positions, *slots, *tables, *seq, *lengths;
    const float *rope;
    /* each row's adapter slot (-1: the base) and the request's scale of it; NULL: no row
     * has an adapter */
    const int64_t *lora_slot;
    const float *lora_scale;
} cgn_step;

void cgn_quantize_rows(const float *x, int64_t M, int64_t K, int block, int8_t *qa, float *da,
                       float *sa);
int cgn_block_values(int type);
int cgn_attend(const float *q, const void *pool_k, const void *pool_v, int kv_type,
               const int64_t *tables, int64_t nb, const int64_t *seq, const int64_t *lengths,
               int64_t R, int64_t H, int64_t KVH, int64_t hd, float scale, float *out);
void cgn_qmatmul(int type, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K,
                 const int8_t *qa, const float *da, const float *sa, int64_t M, float *y,
                 int64_t ldy);

static _Thread_local struct {
    void *p;
    size_t n;
} scratch;

static void *grow(size_t n) {
    if (n > scratch.n) {
        free(scratch.p);
        scratch.p = malloc(n);
        scratch.n = scratch.p ? n : 0;
    }
    return scratch.p;
}

/* y [T, m->out] = x [T, K] @ m.T: x quantized into qa/da/sa (room for [T, K]) in the
 * blocks of each part's type, again only where a part's type wants other blocks than the
 * part before it (a fused matrix rarely mixes the two kinds). Every product of a quantized
 * matrix goes through here: the layers below and QuantMatrix's calls from Python. */
void cgn_matrix_product(const cgn_matrix *m, const float *x, int64_t T, int64_t K, int8_t *qa,
                        float *da, float *sa, float *y) {
    int64_t col = 0;
    for (int64_t p = 0, block = 0; p < m->parts; p++) {
        int want = cgn_block_values((int)m->type[p]); /* ggml quantizes to the weight's block */
        if (want != block) cgn_quantize_rows(x, T, K, want, qa, da, sa), block = want;
        cgn_qmatmul((int)m->type[p], m->data[p], m->row_bytes[p], m->rows[p], K, qa, da, sa, T,
                    y + col, m->out);
        col += m->rows[p];
    }
}

/* x . y in 8 independent partial sums (the compiler keeps them in one vector register:
 * a single running sum cannot be vectorized without reordering it), then added in a
 * fixed order: the same value for a row whatever else runs beside it. */
static inline float dot_lanes(const float *x, const float *y, int64_t n) {
    float lane[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) lane[j] += x[i + j] * y[i + j];
    float acc = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    for (; i < n; i++) acc += x[i] * y[i];
    return acc;
}

/* The adapters' share of one product: for every row t whose adapter adapts `target`,
 * y[t, col : col + out] += scale_t * factor * B (A x_t), x [T, K], y's rows ldy apart. Rows
 * without an adapter cost one test each; every row's sum is its own (batch-invariant). */
static void lora_add(const cgn_layer_weights *w, const cgn_step *s, int target, const float *x,
                     int64_t K, float *y, int64_t ldy, int64_t col) {
    if (s->lora_slot == NULL || w->lora == NULL) return;
    #pragma omp parallel for schedule(static) if (s->rows > 4)
    for (int64_t t = 0; t < s->rows; t++) {
        int64_t slot = s->lora_slot[t];
        if (slot < 0 || slot >= w->lora_slots) continue;
        const cgn_lora_pair *p = &w->lora[slot].p[target];
        if (p->rank <= 0 || p->rank > MAX_LORA_RANK) continue;
        float ax[MAX_LORA_RANK];
        const float *xt = x + t * K, f = s->lora_scale[t] * p->factor;
        for (int64_t r = 0; r < p->rank; r++)
            ax[r] = dot_lanes(p->a + r * K, xt, K) * f;
        float *yt = y + t * ldy + col;
        for (int64_t o = 0; o < p->out; o++) {
            const float *br = p->b + o * p->rank;
            float acc = 0.0f;
            for (int64_t r = 0; r < p->rank; r++) acc += br[r] * ax[r];
            yt[o] += acc;
        }
    }
}

/* out = x * w / sqrt(mean(x^2) + eps), per row; the sum in double, as llama.cpp does. */
static void rms_norm(const float *x, const float *w, int64_t T, int64_t D, float eps, float *out) {
    for (int64_t t = 0; t < T; t++) {
        const float *r = x + t * D;
        double ss = 0.0;
        for (int64_t i = 0; i < D; i++) ss += (double)r[i] * r[i];
        float inv = 1.0f / sqrtf((float)(ss / (double)D) + eps);
        for (int64_t i = 0; i < D; i++) out[t * D + i] = r[i] * inv * w[i];
    }
}

/* rms_norm for the model's last norm (the C backend's, before the LM head). */
void cgn_rms_norm(const float *x, const float *w, int64_t T, int64_t D, float eps, float *out) {
    rms_norm(x, w, T, D, eps, out);
}

/* Row i (n values) of a pool: written from float32, rounded to the pool's type. */
static void kv_store(void *pool, int64_t i, int64_t n, int kv, const float *src) {
    if (kv == KV_F32) {
        memcpy((float *)pool + i * n, src, sizeof(float) * (size_t)n);
        return;
    }
    uint16_t *h = (uint16_t *)pool + i * n;
    for (int64_t j = 0; j < n; j++)
        h[j] = kv == KV_F16 ? float_to_half(src[j]) : float_to_bf16(src[j]);
}

/* Row i (n values) of a pool as float32: in place for float32, else widened into buf. */
static inline const float *kv_load(const void *pool, int64_t i, int64_t n, int kv, float *buf) {
    if (kv == KV_F32) return (const float *)pool + i * n;
    const uint16_t *h = (const uint16_t *)pool + i * n;
    int64_t j = 0;
    if (kv == KV_BF16) {
        for (; j < n; j++) buf[j] = bf16_to_float(h[j]);
        return buf;
    }
#if defined(__F16C__) && defined(__AVX__)
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(buf + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + j))));
#endif
    for (; j < n; j++) buf[j] = half_to_float(h[j]);
    return buf;
}

/* Rotate heads [n, hd] at one position: (a, b) -> (a c - b s, a s + b c) per pair. */
static void rotate(float *v, int64_t n, int64_t hd, const float *cs) {
    for (int64_t h = 0; h < n; h++, v += hd)
        for (int64_t i = 0; i < hd / 2; i++) {
            float a = v[2 * i], b = v[2 * i + 1], c = cs[2 * i], s = cs[2 * i + 1];
            v[2 * i] = a * c - b * s;
            v[2 * i + 1] = a * s + b * c;
        }
}

int cgn_layer(const cgn_layer_weights *w, void *pool_k, void *pool_v, const cgn_step *s,
              float *x) {
    const int64_t T = s->rows, D = w->dim, hd = w->head_dim, F = w->ffn;
    const int64_t qn = w->heads * hd, kvn = w->kv_heads * hd, qkvn = w->wqkv.out;
    int64_t widest = D > F ? D : F;
    widest = widest > qn ? widest : qn;
    /* h [T, D] | qkv [T, qkvn] | q, att [T, qn] | gu [T, 2F] | act [T, F] | y [T, D] |
     * activation scales and sums [T, widest/32] each | quantized activations [T, widest] */
    const int64_t groups = widest / GROUP;
    size_t floats = (size_t)T * (D + qkvn + 2 * qn + 3 * F + D + 2 * groups);
    float *h = grow(sizeof(float) * floats + (size_t)T * widest);
    if (h == NULL) return -1;
    float *qkv = h + T * D, *q = qkv + T * qkvn, *att = q + T * qn, *gu = att + T * qn;
    float *act = gu + T * 2 * F, *y = act + T * F;
    int8_t *qa = (int8_t *)(y + T * D + 2 * T * groups);
    float *da = y + T * D, *sa = da + T * groups;

    rms_norm(x, w->attn_norm, T, D, w->eps, h);
    cgn_matrix_product(&w->wqkv, h, T, D, qa, da, sa, qkv);
    lora_add(w, s, L_Q, h, D, qkv, qkvn, 0);
    lora_add(w, s, L_K, h, D, qkv, qkvn, qn);
    lora_add(w, s, L_V, h, D, qkv, qkvn, qn + kvn);
    for (int64_t t = 0; t < T; t++) {
        float *r = qkv + t * qkvn;
        if (w->bqkv)
            for (int64_t i = 0; i < qkvn; i++) r[i] += w->bqkv[i];
        const float *cs = s->rope + s->positions[t] * hd;
        rotate(r, w->heads + w->kv_heads, hd, cs);
        memcpy(q + t * qn, r, sizeof(float) * qn);
        kv_store(pool_k, s->slots[t], kvn, (int)s->kv_type, r + qn);
        kv_store(pool_v, s->slots[t], kvn, (int)s->kv_type, r + qn + kvn);
    }
    if (cgn_attend(q, pool_k, pool_v, (int)s->kv_type, s->tables, s->table_width, s->seq,
                   s->lengths, T, w->heads, w->kv_heads, hd, w->scale, att) != 0)
        return -1;
    cgn_matrix_product(&w->wo, att, T, qn, qa, da, sa, y);
    lora_add(w, s, L_O, att, qn, y, D, 0);
    for (int64_t i = 0; i < T * D; i++) x[i] += y[i];

    rms_norm(x, w->ffn_norm, T, D, w->eps, h);
    cgn_matrix_product(&w->w_gate_up, h, T, D, qa, da, sa, gu);
    lora_add(w, s, L_GATE, h, D, gu, 2 * F, 0);
    lora_add(w, s, L_UP, h, D, gu, 2 * F, F);
    #pragma omp parallel for schedule(static) if (T > 4)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * F, *u = g + F;
        for (int64_t i = 0; i < F; i++) act[t * F + i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
    cgn_matrix_product(&w->w_down, act, T, F, qa, da, sa, y);
    lora_add(w, s, L_DOWN, act, F, y, D, 0);
    for (int64_t i = 0; i < T * D; i++) x[i] += y[i];
    return 0;
}

/* Attention straight over the paged KV pool (float32, float16 or bfloat16), for every row
 * of a step: prompt chunks and decode rows alike, with no gather into a scratch copy.
 * q [R, H, hd]; pool_k, pool_v: one layer's [blocks, 16, KVH, hd]; tables [G, nb] block ids;
 * row r attends to positions 0..lengths[r]-1 of the sequence whose blocks are tables[seq[r]]
 * (its own K/V already written); out [R, H, hd]. Query heads h share KV head h / (H / KVH).
 *
 * Consecutive rows of one sequence (a prompt chunk) are taken up to QROWS at a time, and
 * every query head of them that shares a KV head is one "query" of the block. The keys are
 * read a tile of KT positions at a time, widened and transposed once for all the block's
 * queries, and scored as KT sums side by side (QG queries at once, so that several sums
 * are in flight); the values a tile of VT positions at a time, each query's output held in
 * registers OC values at a time. Before, every row read its whole cache alone, one
 * position at a time, with a horizontal sum per score and a serial softmax: a
 * 3,900-token SmolLM2 prompt took 38.8 s in process, 16.8 s now (docs/cgn-infer.md).
 *
 * Each score is q . k summed over the head's dimensions in order, each output value the
 * sum of p * v over positions in order (multiply-adds fused where the CPU has FMA), and
 * the softmax's max and sum go over 8 fixed lanes: every row is computed by the same
 * operations in the same order whatever else is in the step and however its prompt was
 * chunked or blocked, so results are exactly batch- and chunk-invariant. Returns 0, or -1
 * with out unfinished where memory for the scratch ran out. */
#define QROWS 16
#define SCORES_BYTES (4 << 20) /* a thread's scores for one block of rows, at most */
#define KT 8                   /* key positions per tile: 8 scores, one vector */
#define QG 4                   /* queries scored together */
#define VT 32                  /* value positions per tile */
#define OC 32                  /* output values summed together, per query */

#ifdef __FMA__
#define MADD(a, b, c) fmaf(a, b, c)
#else
#define MADD(a, b, c) ((a) * (b) + (c))
#endif

#define NO_TRAPS __attribute__((optimize("no-trapping-math"))) /* lets GCC vectorize the
    max's selects below; no value changes (this code raises no exception anyone reads) */

/* s[0..n) = softmax(s), its max and sum each over 8 fixed lanes (added in a fixed order),
 * so that those loops vectorize (one running sum is one dependent add per position).
 * libm's expf stays: a vectorized polynomial (relative error ~1e-7) measured no faster
 * once the rest was tiled (3,900 SmolLM2 prompt tokens: 17.0 s against 16.8), and it
 * moved an adapted SmolLM2's answer where llama.cpp's margin is 0.43 nats. */
static NO_TRAPS void softmax(float *s, int64_t n) {
    float lane[8], mx, total;
    for (int j = 0; j < 8; j++) lane[j] = -INFINITY;
    int64_t t = 0;
    for (; t + 8 <= n; t += 8)
        for (int j = 0; j < 8; j++) lane[j] = s[t + j] > lane[j] ? s[t + j] : lane[j];
    mx = lane[0];
    for (int j = 1; j < 8; j++) mx = lane[j] > mx ? lane[j] : mx;
    for (; t < n; t++) mx = s[t] > mx ? s[t] : mx;
    for (t = 0; t < n; t++) s[t] = expf(s[t] - mx);
    for (int j = 0; j < 8; j++) lane[j] = 0.0f;
    for (t = 0; t + 8 <= n; t += 8)
        for (int j = 0; j < 8; j++) lane[j] += s[t + j];
    total = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    for (; t < n; t++) total += s[t];
    float inv = total > 0.0f ? 1.0f / total : 0.0f;
    for (t = 0; t < n; t++) s[t] *= inv;
}

/* dst[a][0..KT) = scale * (q[a] . key j of the tile) for a < nq <= QG; kt [hd][KT] holds
 * the tile's keys transposed. A slot past nq repeats query 0 and is dropped. */
static void score_tile(const float *kt, int64_t hd, const float *const *q, int nq, float scale,
                       float *const *dst) {
    const float *qa[QG];
    for (int a = 0; a < QG; a++) qa[a] = q[a < nq ? a : 0];
#if defined(__AVX2__) && defined(__FMA__) /* the loop below, which GCC leaves scalar */
    __m256 acc[QG];
    for (int a = 0; a < QG; a++) acc[a] = _mm256_setzero_ps();
    for (int64_t i = 0; i < hd; i++) {
        __m256 k = _mm256_loadu_ps(kt + i * KT);
        for (int a = 0; a < QG; a++) acc[a] = _mm256_fmadd_ps(_mm256_set1_ps(qa[a][i]), k, acc[a]);
    }
    for (int a = 0; a < nq; a++) _mm256_storeu_ps(dst[a], _mm256_mul_ps(acc[a], _mm256_set1_ps(scale)));
#else
    float acc[QG][KT] = {{0}};
    for (int64_t i = 0; i < hd; i++)
        for (int a = 0; a < QG; a++)
            for (int j = 0; j < KT; j++) acc[a][j] = MADD(qa[a][i], kt[i * KT + j], acc[a][j]);
    for (int a = 0; a < nq; a++)
        for (int j = 0; j < KT; j++) dst[a][j] = acc[a][j] * scale;
#endif
}

/* o[0..hd) += sum over t < n, in order, of p[t] * vt[t][..] (vt [n][hd]). */
static void value_tile(const float *vt, int64_t hd, const float *p, int64_t n, float *o) {
    int64_t i0 = 0;
#if defined(__AVX2__) && defined(__FMA__) /* the loop below, in registers (GCC spills acc) */
    for (; i0 + OC <= hd; i0 += OC) {
        __m256 acc[OC / 8];
        for (int j = 0; j < OC / 8; j++) acc[j] = _mm256_loadu_ps(o + i0 + 8 * j);
        for (int64_t t = 0; t < n; t++) {
            __m256 w = _mm256_set1_ps(p[t]);
            for (int j = 0; j < OC / 8; j++)
                acc[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vt + t * hd + i0 + 8 * j), acc[j]);
        }
        for (int j = 0; j < OC / 8; j++) _mm256_storeu_ps(o + i0 + 8 * j, acc[j]);
    }
#endif
    for (; i0 + OC <= hd; i0 += OC) {
        float acc[OC];
        memcpy(acc, o + i0, sizeof acc);
        for (int64_t t = 0; t < n; t++)
            for (int j = 0; j < OC; j++) acc[j] = MADD(p[t], vt[t * hd + i0 + j], acc[j]);
        memcpy(o + i0, acc, sizeof acc);
    }
    for (; i0 < hd; i0++) {
        float acc = o[i0];
        for (int64_t t = 0; t < n; t++) acc = MADD(p[t], vt[t * hd + i0], acc);
        o[i0] = acc;
    }
}

/* Position t's row of KV head kvh in a pool of 16-position blocks, through a block table. */
static inline int64_t kv_row(const int64_t *table, int64_t t, int64_t KVH, int64_t kvh) {
    return (table[t / 16] * 16 + t % 16) * KVH + kvh;
}

/* One job: rows b0..b0+nr-1 of one sequence (lengths len[0..nr)), KV head kvh. */
static void attend_block(const float *q, const void *pool_k, const void *pool_v, int kv_type,
                         const int64_t *table, const int64_t *len, int64_t b0, int64_t nr,
                         int64_t kvh, int64_t H, int64_t KVH, int64_t group, int64_t hd,
                         int64_t stride, float scale, float *scores, float *tile, float *row,
                         float *out) {
    int64_t most = 0, nq = nr * group;
    for (int64_t b = 0; b < nr; b++) most = len[b] > most ? len[b] : most;
    /* query a = (row a / group, head a % group): its q, out and scores */
#define QUERY(a) (((b0 + (a) / group) * H + kvh * group + (a) % group) * hd)
    for (int64_t t0 = 0; t0 < most; t0 += KT) {
        for (int j = 0; j < KT; j++) { /* the tile's keys, transposed; zeros past `most` */
            if (t0 + j < most) {
                const float *k = kv_load(pool_k, kv_row(table, t0 + j, KVH, kvh), hd, kv_type, row);
                for (int64_t i = 0; i < hd; i++) tile[i * KT + j] = k[i];
            } else {
                for (int64_t i = 0; i < hd; i++) tile[i * KT + j] = 0.0f;
            }
        }
        const float *qs[QG];
        float *dst[QG];
        int n = 0;
        for (int64_t a = 0; a < nq; a++) {
            if (t0 >= len[a / group]) continue;
            qs[n] = q + QUERY(a);
            dst[n++] = scores + a * stride + t0;
            if (n == QG) score_tile(tile, hd, qs, n, scale, dst), n = 0;
        }
        if (n) score_tile(tile, hd, qs, n, scale, dst);
    }
    for (int64_t a = 0; a < nq; a++) {
        softmax(scores + a * stride, len[a / group]);
        memset(out + QUERY(a), 0, sizeof(float) * (size_t)hd);
    }
    for (int64_t t0 = 0; t0 < most; t0 += VT) {
        int64_t n = most - t0 < VT ? most - t0 : VT;
        for (int64_t t = 0; t < n; t++) {
            const float *v = kv_load(pool_v, kv_row(table, t0 + t, KVH, kvh), hd, kv_type, tile + t * hd);
            if (v != tile + t * hd) memcpy(tile + t * hd, v, sizeof(float) * (size_t)hd);
        }
        for (int64_t a = 0; a < nq; a++) {
            int64_t upto = len[a / group] - t0; /* this query's positions in the tile */
            if (upto > 0)
                value_tile(tile, hd, scores + a * stride + t0, upto < n ? upto : n, out + QUERY(a));
        }
    }
#undef QUERY
}

int cgn_attend(const float *q, const void *pool_k, const void *pool_v, int kv_type,
               const int64_t *tables, int64_t nb, const int64_t *seq, const int64_t *lengths,
               int64_t R, int64_t H, int64_t KVH, int64_t hd, float scale, float *out) {
    int64_t group = H / KVH, maxlen = 1;
    for (int64_t r = 0; r < R; r++) maxlen = lengths[r] > maxlen ? lengths[r] : maxlen;
    int64_t stride = (maxlen + KT - 1) / KT * KT; /* a query's scores, whole tiles */
    /* rows per block: as many as QROWS whose scores fit SCORES_BYTES (at least one) */
    int64_t per = (int64_t)SCORES_BYTES / (int64_t)(sizeof(float) * group * stride);
    per = per < 1 ? 1 : per > QROWS ? QROWS : per;
    int64_t *starts = malloc(sizeof(int64_t) * (size_t)(R + 1)), blocks = 0;
    if (starts == NULL) return -1;
    for (int64_t r = 0; r < R; r++)
        if (r == 0 || seq[r] != seq[r - 1] || r - starts[blocks - 1] == per) starts[blocks++] = r;
    starts[blocks] = R;
    int64_t widest = 1; /* the most rows in a block: decode steps have blocks of one */
    for (int64_t i = 0; i < blocks; i++)
        widest = starts[i + 1] - starts[i] > widest ? starts[i + 1] - starts[i] : widest;
    int failed = 0;
    size_t tile = (size_t)hd * (KT > VT ? KT : VT);
    #pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * ((size_t)(widest * group * stride) + tile + (size_t)hd));
        if (scores == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t job = 0; job < blocks * KVH; job++) {
            if (scores == NULL) continue;
            int64_t b0 = starts[job / KVH], nr = starts[job / KVH + 1] - b0;
            float *t = scores + widest * group * stride;
            attend_block(q, pool_k, pool_v, kv_type, tables + seq[b0] * nb, lengths + b0, b0, nr,
                         job % KVH, H, KVH, group, hd, stride, scale, scores, t, t + tile, out);
        }
        free(scores);
    }
    free(starts);
    return failed ? -1 : 0;
}
