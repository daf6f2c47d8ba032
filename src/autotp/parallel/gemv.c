/* y (m, n) = x (m, k) . w (n, k)^T + bias, float32 or bfloat16, row-major and contiguous, for a few rows m.
 *
 * A decode step multiplies one or a few rows by every weight of the model once: it is bound by reading the
 * weights from memory. torch's float32 F.linear (MKL's sgemv/sgemm, packed or not, and oneDNN's) streams a
 * row-major (n, k) weight at 6-8 GB/s on the 2-core AMD EPYC it was measured on, where a plain read runs at
 * ~19 GB/s; this loop reads each weight row once for all m rows, with the k-loop vectorized (omp simd's
 * reduction lets the compiler keep partial sums in vector lanes), and splits the n output columns across
 * threads. It runs on the OpenMP runtime torch itself loaded (the same libgomp.so.1), so its threads are
 * torch's. Sums are in float32, in another order than BLAS: equal to F.linear within float32 rounding.
 *
 * bfloat16 (autotp_gemv_bf16, built only where the CPU has AVX512_BF16's dot product): weights and x as
 * bfloat16, products summed in float32 lanes, each y rounded to bfloat16 once, to nearest even, as torch rounds.
 * On the Xeon with AMX it was measured on, torch's bfloat16 F.linear of one row read the weights at 10 GB/s,
 * under half its float32 rate; where the instruction is missing there is no such function, and F.linear stays. */
#include <stddef.h>

/* Rows i..i+3 of y's column j: the weight row is loaded once for four rows of x. */
static inline void four(const float *wr, const float *x, float *y, const float *bias, long i, long j, long k,
                        long n) {
    const float *x0 = x + i * k, *x1 = x0 + k, *x2 = x1 + k, *x3 = x2 + k;
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
    for (long c = 0; c < k; c++) {
        a0 += wr[c] * x0[c];
        a1 += wr[c] * x1[c];
        a2 += wr[c] * x2[c];
        a3 += wr[c] * x3[c];
    }
    float b = bias ? bias[j] : 0.0f;
    y[i * n + j] = a0 + b;
    y[(i + 1) * n + j] = a1 + b;
    y[(i + 2) * n + j] = a2 + b;
    y[(i + 3) * n + j] = a3 + b;
}

void autotp_gemv_f32(const float *x, const float *w, const float *bias, float *y, long m, long k, long n,
                     int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long j = 0; j < n; j++) {
        const float *wr = w + j * k;
        long i = 0;
        for (; i + 4 <= m; i += 4)
            four(wr, x, y, bias, i, j, k, n);
        for (; i < m; i++) {
            const float *xr = x + i * k;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (long c = 0; c < k; c++)
                acc += wr[c] * xr[c];
            y[i * n + j] = bias ? acc + bias[j] : acc;
        }
    }
}

#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
/* The weights 16 KB ahead of the loop are asked for in advance: each core streams its own rows, and the
 * hardware's prefetcher alone left the loop waiting on memory (one row: 14.7 -> 11.6 ms a step in an ad hoc run of
 * gemv_bench.py's products, 2-32 KB ahead tried). */
#define PREFETCH 8192

static inline float widen(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t narrow(float f) { /* round to nearest even; a NaN stays a NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Rows i..i+r-1 (r <= 4) of y's column j, bfloat16: 64 weights per step, each load used for r rows of x by
 * AVX512_BF16's dot product (vdpbf16ps: pairs of bfloat16 products summed into float32 lanes); two accumulators
 * per row, so that one row's products do not wait on each other. Past the weights' end a prefetch is a hint that
 * does not fault. */
static inline void rows_bf16(const uint16_t *wr, const uint16_t *x, uint16_t *y, const uint16_t *bias, long i,
                             int r, long j, long k, long n) {
    __m512 lo[4], hi[4];
    for (int t = 0; t < 4; t++)
        lo[t] = hi[t] = _mm512_setzero_ps();
    long c = 0;
    for (; c + 64 <= k; c += 64) {
        _mm_prefetch((const char *)(wr + c + PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(wr + c + PREFETCH + 32), _MM_HINT_T0);
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + c), w1 = (__m512bh)_mm512_loadu_si512(wr + c + 32);
        for (int t = 0; t < r; t++) {
            const uint16_t *xr = x + (i + t) * k + c;
            lo[t] = _mm512_dpbf16_ps(lo[t], w0, (__m512bh)_mm512_loadu_si512(xr));
            hi[t] = _mm512_dpbf16_ps(hi[t], w1, (__m512bh)_mm512_loadu_si512(xr + 32));
        }
    }
    for (; c + 32 <= k; c += 32) {
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + c);
        for (int t = 0; t < r; t++)
            lo[t] = _mm512_dpbf16_ps(lo[t], w0, (__m512bh)_mm512_loadu_si512(x + (i + t) * k + c));
    }
    float b = bias ? widen(bias[j]) : 0.0f;
    for (int t = 0; t < r; t++) {
        float a = _mm512_reduce_add_ps(_mm512_add_ps(lo[t], hi[t]));
        for (long e = c; e < k; e++)
            a += widen(wr[e]) * widen(x[(i + t) * k + e]);
        y[(i + t) * n + j] = narrow(a + b);
    }
}

void autotp_gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, long m, long k,
                      long n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long j = 0; j < n; j++)
        for (long i = 0; i < m; i += 4)
            rows_bf16(w + j * k, x, y, bias, i, m - i < 4 ? (int)(m - i) : 4, j, k, n);
}
#endif
