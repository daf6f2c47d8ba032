/* y (m, n) = x (m, k) . w (n, k)^T + bias, float32, row-major and contiguous, for a few rows m.
 *
 * A decode step multiplies one or a few rows by every weight of the model once: it is bound by reading the
 * weights from memory. torch's float32 F.linear (MKL's sgemv/sgemm, packed or not, and oneDNN's) streams a
 * row-major (n, k) weight at 6-8 GB/s on the 2-core AMD EPYC it was measured on, where a plain read runs at
 * ~19 GB/s; this loop reads each weight row once for all m rows, with the k-loop vectorized (omp simd's
 * reduction lets the compiler keep partial sums in vector lanes), and splits the n output columns across
 * threads. It runs on the OpenMP runtime torch itself loaded (the same libgomp.so.1), so its threads are
 * torch's. Sums are in float32, in another order than BLAS: equal to F.linear within float32 rounding. */
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
