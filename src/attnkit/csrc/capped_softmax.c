/* Soft-capped attention (Gemma 2's attention-logit cap): the softmax of rows of scores, and the
 * whole attention of a prefill in FlashAttention's loop.
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
 * attnkit_capped_attention computes softmax(capped scores) v without ever holding a row of
 * scores: each thread takes a block of queries of one head, walks the key blocks it may attend
 * (causal and window blocks past its reach are skipped), gets each tile of scores from the BLAS
 * sgemm torch links (a tile stays in L2), caps it and folds it into a running maximum and sum
 * per query (the online softmax), and multiplies it with the block's values into the output,
 * which is divided by the sums at the end. torch's fused CPU kernel has the same loop without
 * the cap; this one measured faster than it (benchmarks/RESULTS.md).
 *
 * Non-finite scores: a NaN makes its row NaN, as softmax does. With `finite` unset an infinite
 * t becomes NaN too (t + 0 t t), as the uncapped math would make its row NaN; with it set the
 * caller knows its inputs were finite and an overflowed product is capped like tanh caps it.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "simd.h"

#define PARALLEL_MIN (1 << 15) /* scores worth a second thread */

/* The keys [a, b) that the query at position `at` may attend within [lo, hi). */
static inline void reach(int64_t at, int causal, int64_t window, int64_t lo, int64_t hi,
                         int64_t *a, int64_t *b) {
  *a = lo;
  *b = hi;
  if (causal && at + 1 < *b) *b = at + 1;
  if (window > 0) {
    if (at - window + 1 > *a) *a = at - window + 1;
    if (at + window < *b) *b = at + window;
  }
}

/* row[j] = 2c sigmoid(row[j]) for n values, in place; returns their maximum (a NaN may or may
 * not win it; it reaches the sum of the exponentials either way, and with it the whole row). */
static inline float capped_row(float *row, int64_t n, float cap, int finite) {
  const __m256 two_c = _mm256_set1_ps(2.f * cap);
  __m256 top = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
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
  return m;
}

static void row_softmax(float *s, int64_t width, int64_t a, int64_t b, float cap, int finite) {
  int64_t j;
  for (j = 0; j < a; j++) s[j] = 0.f;
  for (j = b; j < width; j++) s[j] = 0.f;
  if (b <= a) return;
  float *row = s + a;
  const int64_t n = b - a;
  /* 1: capped scores and their maximum. Three short passes over a row in L1 measured faster
   * than one long one (each value's chain of two exponentials is longer than the out-of-order
   * window can overlap). */
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

/* Fortran BLAS sgemm, column-major. Its integer arguments are passed as pointers to int64: an
 * LP64 library reads their low halves (little-endian), an ILP64 one all of them. */
typedef void (*sgemm_fn)(const char *transa, const char *transb, const int64_t *m,
                         const int64_t *n, const int64_t *k, const float *alpha, const float *a,
                         const int64_t *lda, const float *b, const int64_t *ldb, const float *beta,
                         float *c, const int64_t *ldc);

/* One block of queries [i0, i0 + r) of one head: out = softmax(capped q k^T) v over the keys
 * each may attend. `tile` holds r x kb scores, `acc` r x Ev sums, `top` and `sum` r each. */
static void query_block(sgemm_fn sgemm, const float *q, int64_t q_row, const float *k,
                        int64_t k_row, const float *v, int64_t v_row, float *out, int64_t r,
                        int64_t S, int64_t E, int64_t Ev, int64_t p0, int causal, int64_t window,
                        float alpha, float cap, int finite, int64_t kb, float *tile, float *acc,
                        float *top, float *sum) {
  int64_t lo, hi, a, b;
  reach(p0, causal, window, 0, S, &lo, &b); /* the first query's reach starts the span */
  reach(p0 + r - 1, causal, window, 0, S, &a, &hi); /* the last one's ends it */
  memset(acc, 0, (size_t)(r * Ev) * sizeof(float));
  for (int64_t i = 0; i < r; i++) {
    top[i] = -INFINITY;
    sum[i] = 0.f;
  }
  const float zero = 0.f, one = 1.f;
  for (int64_t j0 = lo; j0 < hi; j0 += kb) {
    const int64_t j1 = j0 + kb < hi ? j0 + kb : hi, w = j1 - j0;
    /* tile (r x w, row-major) = alpha q k^T: column-major w x r = k (w x E) q^T */
    sgemm("T", "N", &w, &r, &E, &alpha, k + j0 * k_row, &k_row, q, &q_row, &zero, tile, &w);
    for (int64_t i = 0; i < r; i++) {
      float *row = tile + i * w;
      reach(p0 + i, causal, window, j0, j1, &a, &b);
      if (b <= a) {
        memset(row, 0, (size_t)w * sizeof(float));
        continue;
      }
      memset(row, 0, (size_t)(a - j0) * sizeof(float));
      memset(row + (b - j0), 0, (size_t)(j1 - b) * sizeof(float));
      const float m = capped_row(row + (a - j0), b - a, cap, finite);
      if (m > top[i]) { /* a new maximum: rescale what was summed under the old one */
        if (top[i] > -INFINITY) {
          const float f = exp1(top[i] - m);
          float *o = acc + i * Ev;
          sum[i] *= f;
          for (int64_t c = 0; c < Ev; c++) o[c] *= f;
        }
        top[i] = m;
      }
      sum[i] += exp_shifted(row + (a - j0), b - a, top[i]);
    }
    /* acc (r x Ev, row-major) += tile v: column-major Ev x r = v^T (Ev x w) tile^T (w x r) */
    sgemm("N", "N", &Ev, &r, &w, &one, v + j0 * v_row, &v_row, tile, &w, &one, acc, &Ev);
  }
  for (int64_t i = 0; i < r; i++) {
    /* (the maximum's term is 1, so a row with keys sums to at least 1, or NaN) */
    const float inverse = sum[i] > 0.f ? 1.f / sum[i] : (sum[i] == 0.f ? 0.f : sum[i]);
    for (int64_t c = 0; c < Ev; c++) out[i * Ev + c] = acc[i * Ev + c] * inverse;
  }
}

/* Soft-capped attention of `heads` query heads: q (heads, L, E) with strides q_head, q_row,
 * k (heads / group, S, E) and v (heads / group, S, Ev) likewise, query head n reading key/value
 * head n / group; out (heads, L, Ev) contiguous. Query i sits at key position first + i. alpha
 * is 2 scale / cap; `sgemm` is the BLAS routine (see sgemm_fn), called by one thread at a time
 * per block (BLAS libraries run single-threaded inside an OpenMP region). Blocks of qb queries
 * and kb keys. Returns 0, or 1 where a buffer could not be allocated (nothing written). */
int attnkit_capped_attention(const float *q, int64_t q_head, int64_t q_row, const float *k,
                             int64_t k_head, int64_t k_row, const float *v, int64_t v_head,
                             int64_t v_row, float *out, int64_t heads, int64_t group, int64_t L,
                             int64_t S, int64_t E, int64_t Ev, int64_t first, int causal,
                             int64_t window, float alpha, float cap, int finite, int64_t qb,
                             int64_t kb, void *sgemm, int threads) {
  const int64_t blocks = (L + qb - 1) / qb, tasks = heads * blocks;
  if (tasks < threads) threads = tasks > 0 ? (int)tasks : 1;
  const int64_t each = qb * kb + qb * Ev + 2 * qb; /* floats a thread works in */
  float *work = malloc((size_t)(threads * each) * sizeof(float));
  if (!work) return 1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (int64_t t = 0; t < tasks; t++) {
#ifdef _OPENMP
    float *mine = work + omp_get_thread_num() * each;
#else
    float *mine = work;
#endif
    /* the last blocks (the most keys under causal masking) first, so that the threads end
     * together */
    const int64_t n = t / blocks, i0 = (blocks - 1 - t % blocks) * qb;
    const int64_t r = i0 + qb < L ? qb : L - i0;
    query_block((sgemm_fn)sgemm, q + n * q_head + i0 * q_row, q_row, k + n / group * k_head,
                k_row, v + n / group * v_head, v_row, out + (n * L + i0) * Ev, r, S, E, Ev,
                first + i0, causal, window, alpha, cap, finite, kb, mine, mine + qb * kb,
                mine + qb * kb + qb * Ev, mine + qb * kb + qb * Ev + qb);
  }
  free(work);
  return 0;
}
