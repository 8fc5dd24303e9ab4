/* Int8 weight x float activation products for a few rows (decoding), with AVX2 integer dots.
 *
 * y[r, o] = scale[o] * sum_b xs[r, b] * sum_{i in block b} xq[r, i] * w[o, i]
 *
 * The activations of each row are quantized to int8 per block of 32 inputs (one float scale a
 * block, round to nearest), so the inner product of a block is 32 int8 x int8 products summed
 * in integers: AVX2 multiplies unsigned by signed bytes, so the weight's sign moves onto the
 * activation (|w| * (x * sign w)), whose pair sums stay within 2 * 128 * 127 < 2^15. Weights are
 * int8 codes with one float scale per output row; n is a multiple of 32.
 *
 * Decoding reads every weight once, so the codes are laid out to be read in one sequential
 * stream: output rows in groups of four, each group's codes block by block, the four rows' 32
 * codes of a block side by side ((out / 4, n / 32, 4, 32); the out % 4 rows after the last group
 * stay row-major at their row-major offsets). One activation block load serves four dots, the
 * loop prefetches 32 blocks (4 KiB) ahead (measured: 1.4-1.7x the row-major order's bandwidth;
 * 4 KiB 1.04-1.18x 1 KiB on an AVX512 EPYC), and OpenMP threads take whole groups.
 */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

#define BLOCK 32
#define GROUP 4
#define PREFETCH 4096 /* bytes ahead: 32 blocks of a group */
#define PARALLEL_MIN (1 << 16) /* products (codes x rows) worth a second thread */

/* The 32 products of one block summed into eight int32 lanes, as floats times s, plus acc. */
static inline __m256 block_dot(__m256i w, __m256i x, __m256 s, __m256 acc) {
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  const __m256i sums = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), s, acc);
}

/* Each block of 32 activations as int8 codes xq and a scale xs (its largest magnitude / 127).
 * A block holding a NaN or an infinity gets a NaN scale, so its row's products are NaN, as a
 * float product's would be non-finite. (x / top * 127, not x * (127 / top): a subnormal top
 * would make 127 / top infinite.) */
static void quantize_blocks(const float *x, int64_t n, int8_t *xq, float *xs) {
  for (int64_t b = 0; b < n / BLOCK; b++) {
    const float *p = x + b * BLOCK;
    float top = 0.f;
    int finite = 1;
    for (int i = 0; i < BLOCK; i++) {
      const float a = fabsf(p[i]);
      finite &= a <= FLT_MAX; /* (false for NaN too) */
      top = a > top ? a : top;
    }
    xs[b] = finite ? top / 127.f : NAN;
    for (int i = 0; i < BLOCK; i++)
      xq[b * BLOCK + i] = finite && top > 0.f ? (int8_t)lrintf(p[i] / top * 127.f) : 0;
  }
}

/* The four dots of one group (its codes grouped as above) with one activation row. */
static inline void group_dots(const int8_t *xq, const float *xs, const int8_t *w, int64_t n,
                              float *dots) {
  __m256 acc[GROUP];
  for (int k = 0; k < GROUP; k++) acc[k] = _mm256_setzero_ps();
  for (int64_t b = 0; b < n / BLOCK; b++) {
    const int8_t *codes = w + b * GROUP * BLOCK;
    /* (a prefetch past the end of the weight is harmless: it never faults) */
    _mm_prefetch((const char *)(codes + PREFETCH), _MM_HINT_T0);
    _mm_prefetch((const char *)(codes + PREFETCH + 64), _MM_HINT_T0);
    const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + b * BLOCK));
    const __m256 s = _mm256_set1_ps(xs[b]);
    for (int k = 0; k < GROUP; k++)
      acc[k] = block_dot(_mm256_loadu_si256((const __m256i *)(codes + k * BLOCK)), x, s, acc[k]);
  }
  for (int k = 0; k < GROUP; k++) dots[k] = lanes_sum(acc[k]);
}

/* One row-major output row's dot with one activation row (the rows after the last group). */
static inline float row_dot(const int8_t *xq, const float *xs, const int8_t *w, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < n / BLOCK; b++)
    acc = block_dot(_mm256_loadu_si256((const __m256i *)(w + b * BLOCK)),
                    _mm256_loadu_si256((const __m256i *)(xq + b * BLOCK)), _mm256_set1_ps(xs[b]),
                    acc);
  return lanes_sum(acc);
}

/* y (rows, out) = x (rows, n) @ (codes (out, n) * scale[:, None]).T on `threads` threads, the
 * codes grouped as above in w; 0 on success, 1 when the activations' scratch cannot be
 * allocated. */
int attnkit_int8_linear(const float *x, int64_t rows, int64_t n, const int8_t *w,
                        const float *scale, int64_t out, float *y, int threads) {
  const int64_t blocks = n / BLOCK;
  int8_t *xq = malloc((size_t)(rows * n));
  float *xs = malloc((size_t)(rows * blocks) * sizeof(float));
  if (!xq || !xs) {
    free(xq);
    free(xs);
    return 1;
  }
  for (int64_t r = 0; r < rows; r++) quantize_blocks(x + r * n, n, xq + r * n, xs + r * blocks);
  const int64_t groups = out / GROUP;
  (void)threads; /* (unused where built without OpenMP) */
  /* (small products stay on one thread: a parallel region costs more than they do) */
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * out * n >= PARALLEL_MIN)
  for (int64_t g = 0; g < groups; g++) {
    const int64_t o = g * GROUP;
    float dots[GROUP];
    for (int64_t r = 0; r < rows; r++) {
      group_dots(xq + r * n, xs + r * blocks, w + o * n, n, dots);
      for (int k = 0; k < GROUP; k++) y[r * out + o + k] = dots[k] * scale[o + k];
    }
  }
  for (int64_t o = groups * GROUP; o < out; o++)
    for (int64_t r = 0; r < rows; r++)
      y[r * out + o] = row_dot(xq + r * n, xs + r * blocks, w + o * n, n) * scale[o];
  free(xq);
  free(xs);
  return 0;
}
