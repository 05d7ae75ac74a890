/* Weight-only quantized matmuls for x86-64 CPUs with AVX2, FMA and F16C.
 *
 * y[M, N] = x[M, K] @ dequant(w)[N, K].T, x and y float32 row-major, w in GGUF's block
 * layouts (32 weights per block, blocks of one output row contiguous):
 *   Q4_1 (20 bytes): fp16 d, fp16 m, uint8 qs[16]; weight j = d * q_j + m, where
 *        q_j = qs[j] & 15 for j < 16 and qs[j - 16] >> 4 for j >= 16.
 *   Q8_0 (34 bytes): fp16 d, int8 qs[32]; weight j = d * qs[j].
 * Every product d * q is exact in float32 (11-bit by at most 8-bit mantissas), so the
 * weights a tile dequantizes are bit-identical to gguf.quants.dequantize (fma(q, d, m)
 * rounds d * q + m once, as numpy's (d * q) + m does after an exact product). The M = 1
 * Q4_1 path sums d (q . x) + m sum(x) per block instead: the same sum in exact
 * arithmetic, rounded differently. Either way only float32 rounding differs from
 * dequantize-then-matmul. The *_gemv_q8 entry points (batch 1, what cpu_kernels.py
 * calls by default) quantize the activation to 8 bits first, as llama.cpp does: they
 * equal dequantize-then-matmul of that quantized activation.
 *
 * Work split: OpenMP threads (torch's own libgomp, which is already loaded, so one
 * thread pool) take output rows. M > 1: tiles of NT rows are dequantized once into a
 * per-thread float buffer and multiplied with every x row, MT rows at a time, in an
 * MT x NT register tile of 8-wide accumulators (FMA-bound rather than load-bound).
 * M = 1: each row is dequantized in registers straight into its dot product.
 */
#include "cpu_gemm.h"

/* M = 1 (decode at batch 1): the register tile would leave one accumulator chain per
 * row (FMA latency-bound), so each row gets four chains, and its blocks are dequantized
 * in registers straight into the dot product (no buffer round trip). */
/* Q4_1 at M = 1, factored per block: sum_j (d q_j + m) x_j = d (q . x) + m sum(x), with
 * sum(x) per block (sx) computed once per call. Nibbles reach 32-bit lanes by one byte
 * shuffle per 8 bytes: lane i holds byte i, whose low nibble is weight i and high
 * nibble weight i + 16. Two accumulators alternate blocks (FMA latency). */
static float gemv_q4_1_row(const float *x, const float *sx, const uint8_t *blocks, int64_t nb) {
    const __m256i first = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                           4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
    const __m256i second = _mm256_add_epi32(first, _mm256_set1_epi32(8));
    const __m256i low = _mm256_set1_epi32(0x0F);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    float ym = 0.0f;
    for (int64_t b = 0; b < nb; b++, blocks += 20, x += QK) {
        const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(blocks + 4)));
        const __m256i a = _mm256_shuffle_epi8(v, first), c = _mm256_shuffle_epi8(v, second);
        const __m256 q0 = _mm256_cvtepi32_ps(_mm256_and_si256(a, low));
        const __m256 q1 = _mm256_cvtepi32_ps(_mm256_and_si256(c, low));
        const __m256 q2 = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
        const __m256 q3 = _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4));
        const __m256 t01 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(x + 8), _mm256_mul_ps(q0, _mm256_loadu_ps(x)));
        const __m256 t23 = _mm256_fmadd_ps(q3, _mm256_loadu_ps(x + 24), _mm256_mul_ps(q2, _mm256_loadu_ps(x + 16)));
        acc[b & 1] = _mm256_fmadd_ps(_mm256_add_ps(t01, t23), _mm256_set1_ps(fp16_to_f32(blocks)), acc[b & 1]);
        ym += fp16_to_f32(blocks + 2) * sx[b];
    }
    return hsum(_mm256_add_ps(acc[0], acc[1])) + ym;
}

static float gemv_q8_0_row(const float *x, const float *sx, const uint8_t *blocks, int64_t nb) {
    (void)sx;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                     _mm256_setzero_ps()};
    for (int64_t b = 0; b < nb; b++, blocks += 34, x += QK) {
        const __m256 d = _mm256_set1_ps(fp16_to_f32(blocks));
        for (int i = 0; i < 4; i++) {
            const __m128i q = _mm_loadl_epi64((const __m128i *)(blocks + 2 + 8 * i));
            const __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
            acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 8 * i), acc[i]);
        }
    }
    return hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}

typedef float (*gemv_q8_fn)(const int8_t *, const float *, const float *, const uint8_t *, int64_t);

/* Returns 0, or -1 when the quantized activation could not be allocated. */
static int blocks_gemv_q8(const float *x, int64_t K, const uint8_t *w, int64_t N, float *y,
                          int threads, int64_t block_bytes, gemv_q8_fn row) {
    const int64_t nb = K / QK;
    int8_t *xq = malloc((size_t)K);
    float *dx = malloc((size_t)nb * sizeof(float)), *xs = malloc((size_t)nb * sizeof(float));
    if (xq == NULL || dx == NULL || xs == NULL) {
        free(xq), free(dx), free(xs);
        return -1;
    }
    quantize_x_q8(x, K, xq, dx, xs);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) y[n] = row(xq, dx, xs, w + n * nb * block_bytes, nb);
    free(xq), free(dx), free(xs);
    return 0;
}

/* Exported: x[1, K] quantized to 8 bits per 32-block, then integer block dots. */
int pagoda_q4_1_gemv_q8(const float *x, int64_t K, const uint8_t *w, int64_t N, float *y,
                        int threads) {
    return blocks_gemv_q8(x, K, w, N, y, threads, 20, gemv_q4_1_q8_row);
}

int pagoda_q8_0_gemv_q8(const float *x, int64_t K, const uint8_t *w, int64_t N, float *y,
                        int threads) {
    return blocks_gemv_q8(x, K, w, N, y, threads, 34, gemv_q8_0_q8_row);
}

typedef float (*gemv_fn)(const float *, const float *, const uint8_t *, int64_t);

/* sx: per-block sums of x (float [K / 32]), for the rows that need them. */
static void blocks_gemv(const float *x, const float *sx, int64_t K, const uint8_t *w,
                        int64_t N, float *y, int threads, int64_t block_bytes, gemv_fn row) {
    const int64_t nb = K / QK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) y[n] = row(x, sx, w + n * nb * block_bytes, nb);
}

/* Returns 0, or -1 when a thread could not allocate its buffer (y is then incomplete). */
static int blocks_mm(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                     float *y, int threads, int64_t block_bytes, int q8_0) {
    const int64_t row_bytes = K / QK * block_bytes, tiles = (N + NT - 1) / NT;
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(| : failed)
    for (int64_t t = 0; t < tiles; t++)
        failed |= dequant_tile_mm(x, M, K, w, N, row_bytes, q8_0, t, y);
    return failed ? -1 : 0;
}

int pagoda_q4_1_mm(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                   float *y, int threads) {
    if (M == 1) {
        float *sx = malloc((size_t)(K / QK) * sizeof(float));
        if (sx == NULL) return -1;
        for (int64_t b = 0; b < K / QK; b++) {
            float s = 0.0f;
            for (int j = 0; j < QK; j++) s += x[b * QK + j];
            sx[b] = s;
        }
        blocks_gemv(x, sx, K, w, N, y, threads, 20, gemv_q4_1_row);
        free(sx);
        return 0;
    }
    return blocks_mm(x, M, K, w, N, y, threads, 20, 0);
}

int pagoda_q8_0_mm(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                   float *y, int threads) {
    if (M == 1) {
        blocks_gemv(x, NULL, K, w, N, y, threads, 34, gemv_q8_0_row);
        return 0;
    }
    return blocks_mm(x, M, K, w, N, y, threads, 34, 1);
}

/* Dequantizes all N rows (for large M, where a float GEMM over the dequantized weight
 * is faster than the register tiles). */
void pagoda_q4_1_dequant(const uint8_t *w, int64_t N, int64_t K, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) dequant_q4_1_row(w + n * (K / QK) * 20, K / QK, out + n * K);
}

void pagoda_q8_0_dequant(const uint8_t *w, int64_t N, int64_t K, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) dequant_q8_0_row(w + n * (K / QK) * 34, K / QK, out + n * K);
}

/* Float32 weights [N, K] (K a multiple of 8) times a few rows of x: the register tiles
 * read the weight where it lies, once per MT rows (its NT-row tile stays in L1 for the
 * next rows). For decode-sized steps (2 to a few rows: verify steps of speculative
 * decoding, small batches), where a float GEMM library's small-M path costs 2-3x its
 * one-row GEMV although the weight bytes read are the same. */
int pagoda_f32_mm(const float *x, int64_t M, int64_t K, const float *w, int64_t N,
                  float *y, int threads) {
    const int64_t tiles = (N + NT - 1) / NT;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * NT;
        const int nt = N - n0 < NT ? (int)(N - n0) : NT;
        tile_rows(x, M, K, w + n0 * K, N, n0, nt, y);
    }
    return 0;
}
