/* Block-quantized matmul building blocks shared by cpu_kernels.c (one matmul per call)
 * and cpu_layer.c (a whole decode step per call): GGUF block layouts (see cpu_kernels.c),
 * their dequantization, the float register tiles, and the 8-bit activation dot
 * products. Everything here is static: each file that includes it gets its own copy
 * (both are linked into one library by cpu_kernels.py).
 */
#ifndef PAGODA_CPU_GEMM_H
#define PAGODA_CPU_GEMM_H

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32
#define NT 4
#define MT 3

static inline float fp16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* One row of Q4_1 blocks -> K floats. */
static inline void dequant_q4_1_row(const uint8_t *blocks, int64_t nb, float *out) {
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++, blocks += 20, out += QK) {
        const __m256 d = _mm256_set1_ps(fp16_to_f32(blocks));
        const __m256 m = _mm256_set1_ps(fp16_to_f32(blocks + 2));
        const __m128i qs = _mm_loadu_si128((const __m128i *)(blocks + 4));
        const __m128i lo = _mm_and_si128(qs, low);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(qs, 4), low);
        _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), d, m));
        _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), d, m));
        _mm256_storeu_ps(out + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), d, m));
        _mm256_storeu_ps(out + 24, _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), d, m));
    }
}

/* One row of Q8_0 blocks -> K floats. */
static inline void dequant_q8_0_row(const uint8_t *blocks, int64_t nb, float *out) {
    for (int64_t b = 0; b < nb; b++, blocks += 34, out += QK) {
        const __m256 d = _mm256_set1_ps(fp16_to_f32(blocks));
        for (int i = 0; i < 4; i++) {
            const __m128i q = _mm_loadl_epi64((const __m128i *)(blocks + 2 + 8 * i));
            _mm256_storeu_ps(out + 8 * i,
                             _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d));
        }
    }
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y[m, n] = dot(x[m, :], w[n, :]) for mt x nt rows; inlined with constant mt and nt, so
 * the accumulators live in registers. */
static inline __attribute__((always_inline)) void
tile(const float *x, int64_t ldx, const float *w, int64_t K, float *y, int64_t ldy,
     const int mt, const int nt) {
    __m256 acc[MT][NT];
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nt; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        __m256 wv[NT];
        for (int j = 0; j < nt; j++) wv[j] = _mm256_loadu_ps(w + j * K + k);
        for (int i = 0; i < mt; i++) {
            const __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
            for (int j = 0; j < nt; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nt; j++) y[i * ldy + j] = hsum(acc[i][j]);
}

#define TILE_CASE(a, b) tile(x + m * K, K, wbuf, K, y + m * N + n0, N, a, b)

static inline void tile_rows(const float *x, int64_t M, int64_t K, const float *wbuf, int64_t N,
                      int64_t n0, int nt, float *y) {
    for (int64_t m = 0; m < M; m += MT) {
        const int mt = M - m < MT ? (int)(M - m) : MT;
        switch (mt * 8 + nt) {
        case 3 * 8 + 4: TILE_CASE(3, 4); break;
        case 2 * 8 + 4: TILE_CASE(2, 4); break;
        case 1 * 8 + 4: TILE_CASE(1, 4); break;
        case 3 * 8 + 3: TILE_CASE(3, 3); break;
        case 2 * 8 + 3: TILE_CASE(2, 3); break;
        case 1 * 8 + 3: TILE_CASE(1, 3); break;
        case 3 * 8 + 2: TILE_CASE(3, 2); break;
        case 2 * 8 + 2: TILE_CASE(2, 2); break;
        case 1 * 8 + 2: TILE_CASE(1, 2); break;
        case 3 * 8 + 1: TILE_CASE(3, 1); break;
        case 2 * 8 + 1: TILE_CASE(2, 1); break;
        default: TILE_CASE(1, 1); break;
        }
    }
}

/* ---- M = 1 with the activation quantized (llama.cpp's scheme) --------------------------
 * x is quantized once per call into int8 blocks of 32 (xq, with scale dx and, for Q4_1,
 * the block's dx * sum(xq)), and each weight block's dot product runs on 8-bit integers:
 * maddubs multiplies unsigned by signed bytes and adds pairs into int16, madd adds pairs
 * of those into int32, and one float FMA per block applies dw * dx. Several times fewer
 * instructions per weight than converting every weight to float. */

/* x[K] -> xq[K] int8, dx[K/32], xs[K/32] = dx * sum(xq): q = round-half-even(x / dx),
 * dx = amax / 127 (0 for an all-zero block, whose q are then 0). */
static inline void quantize_x_q8(const float *x, int64_t K, int8_t *xq, float *dx, float *xs) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < K / QK; b++, x += QK, xq += QK) {
        __m256 amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++)
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * i)));
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        const float d = _mm_cvtss_f32(m) / 127.0f;
        int32_t sum = 0;
        if (d == 0.0f) {
            memset(xq, 0, QK);
        } else {
            const __m256 dv = _mm256_set1_ps(d);
            for (int i = 0; i < 4; i++) {
                const __m256 q = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + 8 * i), dv),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                const __m256i qi = _mm256_cvtps_epi32(q);
                int32_t lanes[8];
                _mm256_storeu_si256((__m256i *)lanes, qi);
                for (int j = 0; j < 8; j++) {
                    xq[8 * i + j] = (int8_t)lanes[j];
                    sum += lanes[j];
                }
            }
        }
        dx[b] = d;
        xs[b] = d * (float)sum;
    }
}

static inline __m256 i32_sum_to_ps(__m256i prod16) {
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(prod16, _mm256_set1_epi16(1)));
}

/* sum_j (dw q_j + mw) (dx xq_j) = dw dx (q . xq) + mw (dx sum(xq)), per block. */
static inline float gemv_q4_1_q8_row(const int8_t *xq, const float *dx, const float *xs,
                              const uint8_t *blocks, int64_t nb) {
    const __m128i low = _mm_set1_epi8(0x0F);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};  /* alternate: FMA latency */
    float ym[2] = {0.0f, 0.0f};
    for (int64_t b = 0; b < nb; b++, blocks += 20, xq += QK) {
        const __m128i qs = _mm_loadu_si128((const __m128i *)(blocks + 4));
        const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), low),
                                           _mm_and_si128(qs, low));  /* weights 0..31 */
        const __m256i p = _mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)xq));
        acc[b & 1] = _mm256_fmadd_ps(i32_sum_to_ps(p),
                                     _mm256_set1_ps(fp16_to_f32(blocks) * dx[b]), acc[b & 1]);
        ym[b & 1] += fp16_to_f32(blocks + 2) * xs[b];
    }
    return hsum(_mm256_add_ps(acc[0], acc[1])) + (ym[0] + ym[1]);
}

/* sum_j dw q_j dx xq_j = dw dx (q . xq): signed bytes both, so |q| and xq * sign(q). */
static inline float gemv_q8_0_q8_row(const int8_t *xq, const float *dx, const float *xs,
                              const uint8_t *blocks, int64_t nb) {
    (void)xs;
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < nb; b++, blocks += 34, xq += QK) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(blocks + 2));
        const __m256i x = _mm256_loadu_si256((const __m256i *)xq);
        const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q));
        acc[b & 1] = _mm256_fmadd_ps(i32_sum_to_ps(p),
                                     _mm256_set1_ps(fp16_to_f32(blocks) * dx[b]), acc[b & 1]);
    }
    return hsum(_mm256_add_ps(acc[0], acc[1]));
}

/* A per-thread buffer of at least n floats (grown on demand, kept for later calls). */
static inline float *thread_buffer(int64_t n) {
    static __thread float *buf = NULL;
    static __thread int64_t cap = 0;
    if (n > cap) {
        free(buf);
        buf = aligned_alloc(64, (size_t)((n * 4 + 63) / 64 * 64));
        cap = buf ? n : 0;
    }
    return buf;
}

/* Tile t of y[M, N] = x[M, K] @ dequant(w).T: its NT weight rows (rows of row_bytes
 * bytes: q8_0 when q8_0 is set, else q4_1) dequantized into this thread's buffer, then
 * multiplied with every row of x. Returns 1 when the buffer could not be allocated (the
 * tile of y is then not written). */
static inline int dequant_tile_mm(const float *x, int64_t M, int64_t K, const uint8_t *w,
                                  int64_t N, int64_t row_bytes, int q8_0, int64_t t, float *y) {
    float *wbuf = thread_buffer(NT * K);
    if (wbuf == NULL) return 1;
    const int64_t nb = K / QK, n0 = t * NT;
    const int nt = N - n0 < NT ? (int)(N - n0) : NT;
    for (int j = 0; j < nt; j++) {
        if (q8_0) dequant_q8_0_row(w + (n0 + j) * row_bytes, nb, wbuf + j * K);
        else dequant_q4_1_row(w + (n0 + j) * row_bytes, nb, wbuf + j * K);
    }
    tile_rows(x, M, K, wbuf, N, n0, nt, y);
    return 0;
}

#endif /* PAGODA_CPU_GEMM_H */
