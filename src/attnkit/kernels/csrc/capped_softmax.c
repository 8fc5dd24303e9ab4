/* The softmax of rows of soft-capped scores (Gemma 2's attention-logit cap).
 *
 * Scores hold t = 2 x / c for raw scores x (the caller folds 2 / c into its product); the
 * capped score c tanh(x / c) equals 2c sigmoid(t) - c, and softmax ignores the shift by c. A row
 * may attend the keys [a, b) that causal and window masking leave (bottom-right aligned, as
 * attnkit.masks.Structure), and its probabilities are
 *
 *   p[j] = exp(2c sigmoid(t[j]) - m) / sum_k exp(2c sigmoid(t[k]) - m),  a <= j < b,
 *
 * with m the row's largest capped score; outside [a, b) p is 0, and a row without keys is all 0.
 *
 * attnkit_capped_softmax does this to rows of scores in memory, in place: torch runs it as five
 * passes over memory (sigmoid, multiply, masks, softmax; its sigmoid and softmax cost about 1.4 ns
 * a value on a 2-core AVX2 CPU); here a row is read once from memory and worked on in L1.
 *
 * A prefill's whole soft-capped attention, which never holds a row of scores, is flash.c's
 * forward with a cap; this softmax serves torch builds whose BLAS cannot be found.
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

static void row_softmax(float *s, int64_t width, int64_t a, int64_t b, float cap, int finite) {
  int64_t j;
  for (j = 0; j < a; j++) s[j] = 0.f;
  for (j = b; j < width; j++) s[j] = 0.f;
  if (b <= a) return;
  float *row = s + a;
  const int64_t n = b - a;
  /* 1: capped scores and their maximum. Three short passes over a row in L1, not one long one:
   * each value's chain of two exponentials is longer than the out-of-order window can overlap. */
  const float m = capped_row(row, n, cap, finite);
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
    int64_t a, b;
    reach(at, causal, window, 0, width, &a, &b);
    if (a > width) a = width;
    if (b < a) b = a;
    row_softmax(s + k * stride, width, a, b, cap, finite);
  }
  return 0;
}
