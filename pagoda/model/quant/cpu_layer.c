/* One decode step of a Llama-family model on the CPU in one call: every decoder layer
 * (input RMSNorm with the residual add, QKV block matmul, rotary, KV store into the
 * paged cache, paged decode attention read through the block table, o_proj, residual
 * + post-attention RMSNorm, gate_up, SiLU * up, down) and the final norm.
 * pagoda/model/cpu_fused_decode.py decides when it applies and packs the pointers.
 *
 * Same math as the unfused path (pagoda/model/llama.py over torch_ref), in float32:
 * - RMSNorm: x * (1 / sqrt(mean(x^2) + eps)), then times the weight.
 * - Matmuls: one row (batch 1) quantizes the activation to 8 bits per block and takes
 *   the integer block dots, as cpu_kernels.c's *_gemv_q8 (the unfused path's batch-1
 *   kernel: identical results for identical inputs), unless quantize_one_row is 0;
 *   otherwise the float register tiles over dequantized weight rows, as blocks_mm.
 *   The 8-bit rounding of the activation is discontinuous: a one-ulp difference in a
 *   norm's output can move a value to the next integer, so at batch 1 the fused and
 *   unfused steps differ by about what a one-ulp change of the input does to either.
 * - Rotary: rotate_half layout with the model's cos/sin cache (attention factor folded in).
 * - Attention: scores q.k * scale over positions 0..L-1 of the row's context, softmax
 *   (max subtracted, exp, normalised by the sum) in float32, then probs @ V.
 * Only float32 rounding differs (sum orders, FMA contraction, a polynomial exp).
 *
 * Parallelism: one OpenMP region per call (torch's libgomp, as cpu_kernels.c); the
 * phases of a layer are work-shared loops whose implicit barriers order them. Attention
 * items are (row, query head): the item of a KV head's first query head writes that
 * head's new K/V into the cache, and every item takes the newest position from the
 * rotated k/v it computes itself, never from the cache (so no item waits for the
 * store). Items read cache positions 0..L-2 only: positions written in earlier steps,
 * in blocks no item of this step writes (a decode row's newest slot lies in a block
 * its request alone holds).
 */
#include <math.h>
#include <omp.h>

#include "cpu_gemm.h"

enum { KIND_Q4_1 = 0, KIND_Q8_0 = 1 };

typedef struct {
    const float *input_norm, *post_norm;        /* [hidden] */
    const uint8_t *qkv, *o, *gate_up, *down;    /* blocks [out, in / 32, bytes] */
    int32_t qkv_kind, o_kind, gate_up_kind, down_kind;
    float *kv_cache;                            /* [2, cache_slots, kv_heads, head_dim] */
} pagoda_layer;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, inter;
    int64_t cache_slots;  /* num_blocks * block_size: how far V lies after K */
    int64_t block_size;
    float eps, scale;
    int32_t quantize_one_row;  /* batch 1: 8-bit activations (cpu_kernels.QUANTIZE_ACTIVATIONS) */
    const float *final_norm;  /* [hidden] */
    const float *cos, *sin;   /* [max_position, head_dim / 2] */
} pagoda_model;

typedef struct {
    int64_t rows;                        /* one query token per row (request) */
    const int64_t *positions;            /* [rows] */
    const int64_t *slot_mapping;         /* [rows]; -1: write nothing */
    const int32_t *seq_lens;             /* [rows]: context length with the new token */
    const int32_t *block_tables;         /* [rows, table_stride] */
    int64_t table_stride;
    int64_t max_seq_len;
} pagoda_step;

#define ALIGN16(n) (((n) + 15) / 16 * 16)

/* Scratch layout, in floats (each region 64-byte aligned). */
typedef struct {
    int64_t resid, x, qkv, attn, y, gu, act, xq, dx, xs, scores, score_stride, total;
} scratch_layout;

static scratch_layout layout_of(const pagoda_model *m, int64_t rows, int64_t max_seq_len,
                                int threads) {
    const int64_t H = m->hidden, Q = m->heads * m->head_dim, KV = m->kv_heads * m->head_dim;
    const int64_t kmax = H > Q ? (H > m->inter ? H : m->inter) : (Q > m->inter ? Q : m->inter);
    scratch_layout s;
    int64_t at = 0;
    s.resid = at, at += ALIGN16(rows * H);
    s.x = at, at += ALIGN16(rows * H);
    s.qkv = at, at += ALIGN16(rows * (Q + 2 * KV));
    s.attn = at, at += ALIGN16(rows * Q);
    s.y = at, at += ALIGN16(rows * H);
    s.gu = at, at += ALIGN16(rows * 2 * m->inter);
    s.act = at, at += ALIGN16(rows * m->inter);
    s.xq = at, at += ALIGN16(kmax / 4);  /* int8 [kmax]: one row (only batch 1 quantizes) */
    s.dx = at, at += ALIGN16(kmax / QK);
    s.xs = at, at += ALIGN16(kmax / QK);
    s.score_stride = ALIGN16(max_seq_len);
    s.scores = at, at += threads * s.score_stride;
    s.total = at;
    return s;
}

/* Bytes of scratch pagoda_llama_decode needs for this many rows, context and threads. */
int64_t pagoda_llama_scratch_bytes(const pagoda_model *m, int64_t rows, int64_t max_seq_len,
                                   int threads) {
    return layout_of(m, rows, max_seq_len, threads).total * (int64_t)sizeof(float) + 64;
}

/* ---- small row operations ------------------------------------------------------------ */

/* out = x / sqrt(mean(x^2) + eps) * w; n a multiple of 8. */
static void rms_norm_row(const float *x, const float *w, int64_t n, float eps, float *out) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256 u = _mm256_loadu_ps(x + i), v = _mm256_loadu_ps(x + i + 8);
        a0 = _mm256_fmadd_ps(u, u, a0), a1 = _mm256_fmadd_ps(v, v, a1);
    }
    for (; i < n; i += 8) {
        const __m256 u = _mm256_loadu_ps(x + i);
        a0 = _mm256_fmadd_ps(u, u, a0);
    }
    const float inv = 1.0f / sqrtf(hsum(_mm256_add_ps(a0, a1)) / (float)n + eps);
    const __m256 s = _mm256_set1_ps(inv);
    for (i = 0; i < n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), s),
                                                _mm256_loadu_ps(w + i)));
}

static void add_row(float *acc, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i += 8)
        _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i), _mm256_loadu_ps(x + i)));
}

/* e^x for x <= 0 (softmax) or any x within float range: e^x = 2^n e^r, n = round(x log2 e),
 * r = x - n ln 2 (|r| <= ln2 / 2, ln 2 split in two for an exact n ln2_hi), e^r by its
 * Taylor polynomial to degree 7 (truncation below 1.5e-8 relative). x is clamped to
 * [-87, 88] so that 2^n stays a normal float; e^-87 is 1.6e-38. */
static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* out = silu(gate) * up = gate / (1 + e^-gate) * up; n a multiple of 8. */
static void silu_mul_row(const float *gate, const float *up, int64_t n, float *out) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = exp256(_mm256_xor_ps(g, sign));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)),
                                                _mm256_loadu_ps(up + i)));
    }
}

/* rotate_half: out[i] = x[i] cos[i] - x[i + D/2] sin[i], out[i + D/2] = x[i + D/2] cos[i]
 * + x[i] sin[i], for i < D/2. Two rounded products and one rounded sum, never an FMA
 * (contraction off): the bits of the layers' rotary (apply_rotary_tables). */
__attribute__((optimize("fp-contract=off"))) static void rotate_head(const float *x, const float *cos, const float *sin, int64_t D,
                        float *out) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        out[i] = x1 * cos[i] - x2 * sin[i];
        out[i + half] = x2 * cos[i] + x1 * sin[i];
    }
}

/* ---- matmuls inside the parallel region -------------------------------------------- */

/* A Q4_1 row times the 8-bit activation (the sum gemv_q4_1_q8_row computes, rounded
 * otherwise): eight blocks' fp16 scale and minimum come in with one gather (d and m are
 * the first four bytes of each 20-byte block) and are converted, multiplied by dx and
 * summed with xs as vectors, instead of one scalar conversion chain per block. */
static float gemv_q4_1_q8_row8(const int8_t *xq, const float *dx, const float *xs,
                               const uint8_t *blocks, int64_t nb) {
    const __m256i offsets = _mm256_setr_epi32(0, 20, 40, 60, 80, 100, 120, 140);
    /* Per 128-bit lane: bytes of the four low (d) or high (m) halves to the first 8 bytes. */
    const __m256i take_d = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                            0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i take_m = _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
                                            2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m128i low = _mm_set1_epi8(0x0F);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, accm = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        const uint8_t *blk = blocks + b * 20;
        const __m256i dm = _mm256_i32gather_epi32((const int *)blk, offsets, 1);
        /* qwords 0 and 2 hold the halves of lanes 0 and 1: bring them together. */
        const __m256i d16 = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(dm, take_d), 0x08);
        const __m256i m16 = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(dm, take_m), 0x08);
        const __m256 d = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(d16)),
                                       _mm256_loadu_ps(dx + b));
        accm = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(m16)),
                               _mm256_loadu_ps(xs + b), accm);
        for (int i = 0; i < 8; i++) {
            const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + 20 * i + 4));
            const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), low),
                                               _mm_and_si128(qs, low));
            const __m256i p = _mm256_maddubs_epi16(
                q, _mm256_loadu_si256((const __m256i *)(xq + (b + i) * QK)));
            acc[i & 1] = _mm256_fmadd_ps(i32_sum_to_ps(p),
                                         _mm256_permutevar8x32_ps(d, _mm256_set1_epi32(i)),
                                         acc[i & 1]);
        }
    }
    float ym = hsum(accm);
    for (; b < nb; b++) {  /* the last nb % 8 blocks, one at a time */
        const uint8_t *blk = blocks + b * 20;
        const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + 4));
        const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), low),
                                           _mm_and_si128(qs, low));
        const __m256i p = _mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)(xq + b * QK)));
        acc[b & 1] = _mm256_fmadd_ps(i32_sum_to_ps(p), _mm256_set1_ps(fp16_to_f32(blk) * dx[b]),
                                     acc[b & 1]);
        ym += fp16_to_f32(blk + 2) * xs[b];
    }
    return hsum(_mm256_add_ps(acc[0], acc[1])) + ym;
}

/* y[M, N] = x[M, K] @ dequant(w).T, work-shared over the team (an orphaned omp for: every
 * thread calls it with the same arguments). With xq (M = 1 only) the 8-bit activation
 * xq/dx/xs (quantize_x_q8 of x) is multiplied instead of x. Returns 1 when this thread
 * could not allocate its tile buffer. */
static int team_mm(const float *x, const int8_t *xq, const float *dx, const float *xs,
                   int64_t M, int64_t K, const uint8_t *w, int kind, int64_t N, float *y) {
    const int64_t nb = K / QK, bytes = kind == KIND_Q4_1 ? 20 : 34, row_bytes = nb * bytes;
    int failed = 0;
    if (xq != NULL) {
        if (kind == KIND_Q4_1) {
#pragma omp for schedule(static)
            for (int64_t n = 0; n < N; n++) y[n] = gemv_q4_1_q8_row8(xq, dx, xs, w + n * row_bytes, nb);
        } else {
#pragma omp for schedule(static)
            for (int64_t n = 0; n < N; n++) y[n] = gemv_q8_0_q8_row(xq, dx, xs, w + n * row_bytes, nb);
        }
        return 0;
    }
    const int64_t tiles = (N + NT - 1) / NT;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++)
        failed |= dequant_tile_mm(x, M, K, w, N, row_bytes, kind == KIND_Q8_0, t, y);
    return failed;
}

/* ---- decode attention of one (row, query head) --------------------------------------- */

/* Lane i of the result = the sum of a[i]'s lanes. */
static inline __m256 hsum8x8(const __m256 *a) {
    const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                         _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* scores[j] = (q . k_j) * scale for n keys at k + j * stride (D floats each). */
static inline __attribute__((always_inline)) void
qk_scores(const float *q, const float *k, int64_t stride, int64_t n, const int64_t D,
          float scale, float *scores) {
    const __m256 sv = _mm256_set1_ps(scale);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 a[8];
        for (int u = 0; u < 8; u++) a[u] = _mm256_setzero_ps();
        for (int64_t c = 0; c < D; c += 8) {
            const __m256 qv = _mm256_loadu_ps(q + c);
            for (int u = 0; u < 8; u++)
                a[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + (j + u) * stride + c), a[u]);
        }
        _mm256_storeu_ps(scores + j, _mm256_mul_ps(hsum8x8(a), sv));
    }
    for (; j < n; j++) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t c = 0; c < D; c += 8)
            a = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(k + j * stride + c), a);
        scores[j] = hsum(a) * scale;
    }
}

/* Softmax over scores[0..n) in place (scores has room for n rounded up to 8). */
static void softmax(float *scores, int64_t n) {
    const int64_t padded = (n + 7) / 8 * 8;
    for (int64_t j = n; j < padded; j++) scores[j] = -INFINITY;
    __m256 mv = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < padded; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(scores + j));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const __m256 mx = _mm256_set1_ps(_mm_cvtss_f32(m4));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < padded; j += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + j), mx));
        _mm256_storeu_ps(scores + j, e);
    }
    for (int64_t j = n; j < padded; j++) scores[j] = 0.0f;  /* exp256 clamps: not exactly 0 */
    for (int64_t j = 0; j < padded; j += 8) sum = _mm256_add_ps(sum, _mm256_loadu_ps(scores + j));
    const __m256 inv = _mm256_set1_ps(1.0f / hsum(sum));
    for (int64_t j = 0; j < padded; j += 8)
        _mm256_storeu_ps(scores + j, _mm256_mul_ps(_mm256_loadu_ps(scores + j), inv));
}

#define MAX_D_VECS 32  /* head_dim up to 256 */

/* acc[D / 8] += sum_j p[j] v_j for n values at v + j * stride. */
static inline __attribute__((always_inline)) void
pv_accumulate(const float *p, const float *v, int64_t stride, int64_t n, const int64_t D,
              __m256 *acc) {
    for (int64_t j = 0; j < n; j++) {
        const __m256 pj = _mm256_set1_ps(p[j]);
        for (int64_t c = 0; c < D / 8; c++)
            acc[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + j * stride + 8 * c), acc[c]);
    }
}

/* out[D] = softmax(q . K * scale) @ V over the row's context: positions 0..L-2 from the
 * cache (through the block table), position L-1 from k_new / v_new. */
static inline __attribute__((always_inline)) void
attend(const float *q, const float *k_new, const float *v_new, const float *kc,
       const float *vc, const int32_t *table, int64_t L, int64_t bs, int64_t stride,
       const int64_t D, float scale, float *scores, float *out) {
    const int64_t cached = L - 1;
    for (int64_t p = 0, b = 0; p < cached; p += bs, b++) {
        const int64_t n = cached - p < bs ? cached - p : bs;
        const int64_t base = (int64_t)table[b] * bs * stride;
        qk_scores(q, kc + base, stride, n, D, scale, scores + p);
    }
    qk_scores(q, k_new, 0, 1, D, scale, scores + cached);
    softmax(scores, L);
    __m256 acc[MAX_D_VECS];
    for (int64_t c = 0; c < D / 8; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t p = 0, b = 0; p < cached; p += bs, b++) {
        const int64_t n = cached - p < bs ? cached - p : bs;
        const int64_t base = (int64_t)table[b] * bs * stride;
        pv_accumulate(scores + p, vc + base, stride, n, D, acc);
    }
    pv_accumulate(scores + cached, v_new, 0, 1, D, acc);
    for (int64_t c = 0; c < D / 8; c++) _mm256_storeu_ps(out + 8 * c, acc[c]);
}

/* One (row, query head) item: rotary on q and on the head's k, the K/V store (by the
 * first query head of each KV head), attention. qkv_row: the row's [q | k | v]. */
static void attention_item(const pagoda_model *m, const pagoda_layer *ly, const pagoda_step *s,
                           const float *qkv_row, int64_t r, int64_t h, float *scores,
                           float *out) {
    const int64_t D = m->head_dim, Hkv = m->kv_heads, group = m->heads / Hkv, kvh = h / group;
    const int64_t Q = m->heads * D, KV = Hkv * D, stride = Hkv * D;
    const float *cos = m->cos + s->positions[r] * (D / 2), *sin = m->sin + s->positions[r] * (D / 2);
    float q[8 * MAX_D_VECS], k[8 * MAX_D_VECS];
    rotate_head(qkv_row + h * D, cos, sin, D, q);
    rotate_head(qkv_row + Q + kvh * D, cos, sin, D, k);
    const float *v = qkv_row + Q + KV + kvh * D;
    const float *kc = ly->kv_cache + kvh * D, *vc = ly->kv_cache + m->cache_slots * stride + kvh * D;
    const int64_t slot = s->slot_mapping[r];
    if (h % group == 0 && slot >= 0) {
        memcpy((float *)kc + slot * stride, k, (size_t)D * sizeof(float));
        memcpy((float *)vc + slot * stride, v, (size_t)D * sizeof(float));
    }
    const int32_t *table = s->block_tables + r * s->table_stride;
    const int64_t L = s->seq_lens[r];
    if (D == 64)
        attend(q, k, v, kc, vc, table, L, m->block_size, stride, 64, m->scale, scores, out);
    else if (D == 128)
        attend(q, k, v, kc, vc, table, L, m->block_size, stride, 128, m->scale, scores, out);
    else
        attend(q, k, v, kc, vc, table, L, m->block_size, stride, D, m->scale, scores, out);
}

/* ---- the step -------------------------------------------------------------------------- */

/* One decoder layer for the whole team; x holds the input norm's output on entry. */
static int team_layer(const pagoda_model *m, const pagoda_layer *ly, const pagoda_step *s,
                      float *f, const scratch_layout *sl, float *scores) {
    const int64_t T = s->rows, H = m->hidden, I = m->inter, D = m->head_dim;
    const int64_t Q = m->heads * D, NQKV = Q + 2 * m->kv_heads * D;
    float *resid = f + sl->resid, *x = f + sl->x, *qkv = f + sl->qkv, *attn = f + sl->attn;
    float *y = f + sl->y, *gu = f + sl->gu, *act = f + sl->act;
    /* xq: the 8-bit activation buffer when batch 1 quantizes (else NULL: float tiles). */
    int8_t *xq = T == 1 && m->quantize_one_row ? (int8_t *)(f + sl->xq) : NULL;
    float *dx = f + sl->dx, *xs = f + sl->xs;
    int failed = team_mm(x, xq, dx, xs, T, H, ly->qkv, ly->qkv_kind, NQKV, qkv);
#pragma omp for schedule(static)
    for (int64_t item = 0; item < T * m->heads; item++) {
        const int64_t r = item / m->heads, h = item % m->heads;
        attention_item(m, ly, s, qkv + r * NQKV, r, h, scores, attn + r * Q + h * D);
    }
    if (xq != NULL) {
#pragma omp single
        quantize_x_q8(attn, Q, xq, dx, xs);
    }
    failed |= team_mm(attn, xq, dx, xs, T, Q, ly->o, ly->o_kind, H, y);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < T; r++) {
        add_row(resid + r * H, y + r * H, H);
        rms_norm_row(resid + r * H, ly->post_norm, H, m->eps, x + r * H);
        if (xq != NULL) quantize_x_q8(x, H, xq, dx, xs);
    }
    failed |= team_mm(x, xq, dx, xs, T, H, ly->gate_up, ly->gate_up_kind, 2 * I, gu);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < T; r++) {
        silu_mul_row(gu + r * 2 * I, gu + r * 2 * I + I, I, act + r * I);
        if (xq != NULL) quantize_x_q8(act, I, xq, dx, xs);
    }
    failed |= team_mm(act, xq, dx, xs, T, I, ly->down, ly->down_kind, H, y);
    return failed;
}

/* embed [rows, hidden] (the token embeddings) -> out [rows, hidden] (after the final
 * norm), writing each layer's new K/V into its cache. scratch: at least
 * pagoda_llama_scratch_bytes(...) bytes. Returns 0, or -1 when a tile buffer could not be
 * allocated (out is then incomplete). */
int pagoda_llama_decode(const pagoda_model *m, const pagoda_layer *layers, const pagoda_step *s,
                        const float *embed, float *out, void *scratch, int threads) {
    const scratch_layout sl = layout_of(m, s->rows, s->max_seq_len, threads);
    float *f = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    const int64_t T = s->rows, H = m->hidden;
    float *resid = f + sl.resid, *x = f + sl.x, *y = f + sl.y;
    int8_t *xq = T == 1 && m->quantize_one_row ? (int8_t *)(f + sl.xq) : NULL;
    float *dx = f + sl.dx, *xs = f + sl.xs;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *scores = f + sl.scores + omp_get_thread_num() * sl.score_stride;
        for (int64_t l = 0; l < m->num_layers; l++) {
            const pagoda_layer *ly = layers + l;
            /* The residual stream takes the previous layer's MLP output (the embedding
             * for the first layer), then the input norm. */
#pragma omp for schedule(static)
            for (int64_t r = 0; r < T; r++) {
                if (l == 0) memcpy(resid + r * H, embed + r * H, (size_t)H * sizeof(float));
                else add_row(resid + r * H, y + r * H, H);
                rms_norm_row(resid + r * H, ly->input_norm, H, m->eps, x + r * H);
                if (xq != NULL) quantize_x_q8(x, H, xq, dx, xs);
            }
            failed |= team_layer(m, ly, s, f, &sl, scores);
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < T; r++) {
            add_row(resid + r * H, y + r * H, H);
            rms_norm_row(resid + r * H, m->final_norm, H, m->eps, out + r * H);
        }
    }
    return failed ? -1 : 0;
}
