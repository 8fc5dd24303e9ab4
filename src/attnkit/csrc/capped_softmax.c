/* Soft-capped softmax of score rows, in place, in one call (Gemma 2's attention-logit cap).
 *
 * Each row holds t = 2 x / c for raw scores x (the caller folds 2 / c into its product); the
 * capped score c tanh(x / c) equals 2c sigmoid(t) - c, and softmax ignores the shift by c. A row
 * may attend the keys [a, b) that causal and window masking leave (bottom-right aligned, as
 * attnkit.masks.Structure), and its probabilities are
 *
 *   p[j] = exp(2c sigmoid(t[j]) - m) / sum_k exp(2c sigmoid(t[k]) - m),  a <= j < b,
 *
 * with m the row's largest capped score; outside [a, b) p is 0, and a row without keys is all 0.
 * torch runs this as five passes over memory (sigmoid, multiply, masks, softmax; its sigmoid
 * and softmax cost about 1.4 ns a value on a 2-core AVX2 CPU); here a row is read once from
 * memory and worked on in L1 (benchmarks/RESULTS.md).
 *
 * Non-finite scores: a NaN makes its row NaN, as softmax does. With `finite` unset an infinite
 * t becomes NaN too (t + 0 t t), as the uncapped math would make its row NaN; with it set the
 * caller knows its inputs were finite and an overflowed product is capped like tanh caps it.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "simd.h"

#define PARALLEL_MIN (1 << 15) /* scores worth a second thread */

/* 2c sigmoid(t) for eight t (t + 0 t t first unless finite). */
static inline __m256 capped8(__m256 t, __m256 two_c, int finite) {
  if (!finite) t = _mm256_fmadd_ps(_mm256_mul_ps(t, t), _mm256_setzero_ps(), t);
  /* 2c / d with d = 1 + exp(-t) in [1, inf]: the reciprocal estimate (12 bits) and one Newton
   * step (about 2 ulp) cost a third of a division. */
  const __m256 d = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), t)));
  const __m256 y = _mm256_rcp_ps(d);
  const __m256 y1 = _mm256_mul_ps(y, _mm256_fnmadd_ps(d, y, _mm256_set1_ps(2.0f)));
  return _mm256_mul_ps(two_c, y1);
}

static void row_softmax(float *s, int64_t width, int64_t a, int64_t b, float cap, int finite) {
  int64_t j;
  for (j = 0; j < a; j++) s[j] = 0.f;
  for (j = b; j < width; j++) s[j] = 0.f;
  if (b <= a) return;
  const __m256 two_c = _mm256_set1_ps(2.f * cap);
  float *row = s + a;
  const int64_t n = b - a;
  /* 1: capped scores and their maximum (a NaN may or may not win the maximum; it reaches the
   * sum below either way, and with it every value of the row). Three short passes over a row in
   * L1 measured faster than one long one (each value's chain of two exponentials is longer than
   * the out-of-order window can overlap). */
  __m256 top = _mm256_set1_ps(-INFINITY);
  for (j = 0; j + 8 <= n; j += 8) {
    const __m256 c = capped8(_mm256_loadu_ps(row + j), two_c, finite);
    _mm256_storeu_ps(row + j, c);
    top = _mm256_max_ps(top, c);
  }
  float m = lanes_max(top);
  for (; j < n; j++) {
    const float c = _mm256_cvtss_f32(capped8(_mm256_set1_ps(row[j]), two_c, finite));
    row[j] = c;
    m = c > m ? c : m;
  }
  /* 2: exponentials and their sum. */
  const float sum = exp_shifted(row, n, m);
  /* 3: normalised (the maximum's term is 1, so the sum is at least 1, or NaN). */
  const __m256 inverse = _mm256_set1_ps(1.f / sum);
  for (j = 0; j + 8 <= n; j += 8)
    _mm256_storeu_ps(row + j, _mm256_mul_ps(_mm256_loadu_ps(row + j), inverse));
  for (; j < n; j++) row[j] *= 1.f / sum;
}

/* Rows k = 0 .. rows - 1 of `s` (each `width` floats, `stride` apart) belong to query
 * position first + k % period relative to the row's first key; `causal` keeps keys at or before
 * it, `window` (when > 0) keys less than window away. Each row becomes its softmax. Returns 0. */
int attnkit_capped_softmax(float *s, int64_t rows, int64_t width, int64_t stride, int64_t period,
                           int64_t first, int causal, int64_t window, float cap, int finite,
                           int threads) {
  (void)threads; /* (unused where built without OpenMP) */
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * width >= PARALLEL_MIN)
  for (int64_t k = 0; k < rows; k++) {
    const int64_t at = first + k % period;
    int64_t a = 0, b = width;
    if (causal && at + 1 < b) b = at + 1;
    if (window > 0) {
      if (at - window + 1 > a) a = at - window + 1;
      if (at + window < b) b = at + window;
    }
    if (a > width) a = width;
    if (b < a) b = a;
    row_softmax(s + k * stride, width, a, b, cap, finite);
  }
  return 0;
}
