/* bf16 and float32 weight x activation products for a few rows (decoding), with AVX2 FMAs.
 *
 * y[r, o] = bias[o] + sum_i x[r, i] * w[o, i], summed in float32, w row-major (out, n).
 *
 * Decoding reads every weight once, so the speed is the weight's read bandwidth. Each OpenMP
 * thread takes a contiguous range of output rows and reads it as one sequential stream, one
 * output row after the other, prefetching 4 KiB ahead (1.10x 2 KiB on an AVX512 EPYC); the rows
 * of x (a few) are dotted with each weight row while it is in L1, two at a time (row_dot2).
 * Measured on a 2-core AVX2 CPU (benchmarks/RESULTS.md): bf16 read at 1.6x the bandwidth of
 * torch's bf16 F.linear, float32 at MKL's.
 *
 * bf16 is float32's upper half, so a bf16 value widens by a 16-bit shift; results are rounded
 * back to bf16 to nearest even (a NaN stays a NaN).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define PREFETCH 4096 /* bytes ahead */
#define PARALLEL_MIN (1 << 16) /* products (weights x rows) worth a second thread */

/* One weight row's dot with one float32 activation row (inlined with a constant bf16, so each
 * caller gets its own loop). */
static inline float row_dot(const float *x, const void *w, int64_t n, int bf16) {
  const char *bytes = (const char *)w;
  const int64_t size = bf16 ? 2 : 4;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    /* (a prefetch past the end of the weight is harmless: it never faults) */
    for (int64_t line = 0; line < 32 * size; line += 64)
      _mm_prefetch(bytes + i * size + PREFETCH + line, _MM_HINT_T0);
    a0 = _mm256_fmadd_ps(load8(w, i, bf16), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(load8(w, i + 8, bf16), _mm256_loadu_ps(x + i + 8), a1);
    a2 = _mm256_fmadd_ps(load8(w, i + 16, bf16), _mm256_loadu_ps(x + i + 16), a2);
    a3 = _mm256_fmadd_ps(load8(w, i + 24, bf16), _mm256_loadu_ps(x + i + 24), a3);
  }
  for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(load8(w, i, bf16), _mm256_loadu_ps(x + i), a0);
  float sum = lanes_sum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; i < n; i++) sum += load1(w, i, bf16) * x[i];
  return sum;
}

/* Two activation rows' dots with one weight row: each weight vector is loaded (and widened)
 * once for both, and each row's sums run exactly as row_dot's (the same operations in the same
 * order), so a row's result does not depend on the rows beside it. 8 rows through the 100M
 * shape's weights: 1.12x one row per pass (benchmarks/RESULTS.md). */
static inline void row_dot2(const float *x0, const float *x1, const void *w, int64_t n, int bf16,
                            float *s0, float *s1) {
  const char *bytes = (const char *)w;
  const int64_t size = bf16 ? 2 : 4;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int64_t line = 0; line < 32 * size; line += 64)
      _mm_prefetch(bytes + i * size + PREFETCH + line, _MM_HINT_T0);
    const __m256 w0 = load8(w, i, bf16), w1 = load8(w, i + 8, bf16);
    const __m256 w2 = load8(w, i + 16, bf16), w3 = load8(w, i + 24, bf16);
    a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0 + i), a0);
    b0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x1 + i), b0);
    a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x0 + i + 8), a1);
    b1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x1 + i + 8), b1);
    a2 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x0 + i + 16), a2);
    b2 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x1 + i + 16), b2);
    a3 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x0 + i + 24), a3);
    b3 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x1 + i + 24), b3);
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 w0 = load8(w, i, bf16);
    a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0 + i), a0);
    b0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x1 + i), b0);
  }
  float sum0 = lanes_sum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  float sum1 = lanes_sum(_mm256_add_ps(_mm256_add_ps(b0, b1), _mm256_add_ps(b2, b3)));
  for (; i < n; i++) {
    const float v = load1(w, i, bf16);
    sum0 += v * x0[i];
    sum1 += v * x1[i];
  }
  *s0 = sum0;
  *s1 = sum1;
}

/* y (rows, out) = x (rows, n) @ w.T + bias, all bf16 (bias may be NULL), on `threads` threads;
 * 0 on success, 1 when the float32 copy of x cannot be allocated. */
int attnkit_bf16_linear(const uint16_t *x, int64_t rows, int64_t n, const uint16_t *w,
                        const uint16_t *bias, int64_t out, uint16_t *y, int threads) {
  float *xf = malloc((size_t)(rows * n) * sizeof(float) + 1); /* (+1: never malloc(0)) */
  if (!xf) return 1;
  for (int64_t i = 0; i < rows * n; i++) xf[i] = bf16_to_float(x[i]);
  (void)threads; /* (unused where built without OpenMP) */
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * out * n >= PARALLEL_MIN)
  for (int64_t o = 0; o < out; o++) {
    const float b = bias ? bf16_to_float(bias[o]) : 0.f;
    int64_t r = 0;
    for (; r + 2 <= rows; r += 2) {
      float s0, s1;
      row_dot2(xf + r * n, xf + (r + 1) * n, w + o * n, n, 1, &s0, &s1);
      y[r * out + o] = float_to_bf16(s0 + b);
      y[(r + 1) * out + o] = float_to_bf16(s1 + b);
    }
    if (r < rows) y[r * out + o] = float_to_bf16(row_dot(xf + r * n, w + o * n, n, 1) + b);
  }
  free(xf);
  return 0;
}

/* The same with float32 x, w, bias and y. */
int attnkit_float_linear(const float *x, int64_t rows, int64_t n, const float *w,
                         const float *bias, int64_t out, float *y, int threads) {
  (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * out * n >= PARALLEL_MIN)
  for (int64_t o = 0; o < out; o++) {
    const float b = bias ? bias[o] : 0.f;
    int64_t r = 0;
    for (; r + 2 <= rows; r += 2) {
      float s0, s1;
      row_dot2(x + r * n, x + (r + 1) * n, w + o * n, n, 0, &s0, &s1);
      y[r * out + o] = s0 + b;
      y[(r + 1) * out + o] = s1 + b;
    }
    if (r < rows) y[r * out + o] = row_dot(x + r * n, w + o * n, n, 0) + b;
  }
  return 0;
}
