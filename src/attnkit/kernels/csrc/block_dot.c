/* Block-quantized weight x float32 activation products (GGUF's Q8_0, Q4_0 and Q4_1 layouts).
 *
 * The weight is cut into blocks of 32 inputs of a row; each group of `group` inputs (a multiple
 * of 32) has an f16 scale d and, for 4-bit codes, an f16 offset m:
 *
 *   8 bits: w[o, i] = d[o, g] * q[o, i],        q int8
 *   4 bits: w[o, i] = d[o, g] * q[o, i] + m,    q in 0..15; m = -8 d without offsets (Q4_0)
 *
 * The activations stay float32: each block's codes are widened to floats and multiplied by the
 * activations (float32 sums), and the group's scale goes on once per block. The offset's term
 * is m times the group's activation sum, computed once per row. This keeps the result the float
 * product of the dequantized weight up to float32 summation order: no rounding of the
 * activations (compare int8_dot.c and int4_dot.c, which round them to int8 for integer dots).
 *
 * Codes are row-major: 8 bits one byte an input ((out, n) int8); 4 bits 16 bytes a block
 * ((out, n / 2) uint8), byte j holding input j in its low nibble and input 16 + j in its high
 * one (ggml's order, so a GGUF tensor's blocks split into codes and scales without a copy of
 * the values). Scales and offsets are (out, n / group) f16.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define BLOCK 32
#define PREFETCH 1024           /* bytes ahead in the row's codes */
#define PARALLEL_MIN (1 << 16) /* products (codes x rows) worth a second thread */

/* An IEEE half as a float: the exponent and mantissa moved into place and rescaled by 2^112
 * (exact for normal and subnormal halves), infinities and NaNs given float's top exponent. */
static inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, body = h & 0x7fffu;
  uint32_t bits = body << 13;
  float f;
  if (body >= 0x7c00u) {
    bits = sign | 0x7f800000u | ((uint32_t)(h & 0x3ffu) << 13);
    memcpy(&f, &bits, sizeof f);
    return f;
  }
  memcpy(&f, &bits, sizeof f);
  f *= 0x1p112f;
  memcpy(&bits, &f, sizeof bits);
  bits |= sign;
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* Eight int8 codes as floats. */
static inline __m256 widen8(const int8_t *q) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
}

/* Eight 4-bit codes (bytes 0-7 of v, one code a byte) as floats. */
static inline __m256 widen_nibbles(__m128i v) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
}

/* The products of a group's codes (widened by `widen`, four vectors of eight a block) and its
 * activations, summed over the group's blocks: four independent sums (one per vector of a
 * block), so consecutive blocks do not wait on one another's additions. */
#define GROUP_SUM(FIRST_BLOCK, PER, LOAD4, x, out)                                  \
  do {                                                                              \
    __m256 t0 = _mm256_setzero_ps(), t1 = t0, t2 = t0, t3 = t0;                     \
    for (int64_t b = (FIRST_BLOCK); b < (FIRST_BLOCK) + (PER); b++) {               \
      __m256 c0, c1, c2, c3;                                                        \
      LOAD4(b, c0, c1, c2, c3);                                                     \
      const float *xb = (x) + b * BLOCK;                                            \
      t0 = _mm256_fmadd_ps(c0, _mm256_loadu_ps(xb), t0);                            \
      t1 = _mm256_fmadd_ps(c1, _mm256_loadu_ps(xb + 8), t1);                        \
      t2 = _mm256_fmadd_ps(c2, _mm256_loadu_ps(xb + 16), t2);                       \
      t3 = _mm256_fmadd_ps(c3, _mm256_loadu_ps(xb + 24), t3);                       \
    }                                                                               \
    (out) = _mm256_add_ps(_mm256_add_ps(t0, t1), _mm256_add_ps(t2, t3));            \
  } while (0)

/* One output of an 8-bit row: sum over groups of d * (q . x); two running sums (even and odd
 * groups) for the same reason. */
static inline float row8(const int8_t *w, const uint16_t *d, const float *x, int64_t groups,
                         int64_t per) {
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
#define LOAD8(b, c0, c1, c2, c3)                                  \
  do {                                                            \
    const int8_t *q = w + (b) * BLOCK;                            \
    _mm_prefetch((const char *)(q + PREFETCH), _MM_HINT_T0);      \
    c0 = widen8(q), c1 = widen8(q + 8), c2 = widen8(q + 16);      \
    c3 = widen8(q + 24);                                          \
  } while (0)
  for (int64_t g = 0; g < groups; g++) {
    __m256 t;
    GROUP_SUM(g * per, per, LOAD8, x, t);
    acc[g & 1] = _mm256_fmadd_ps(t, _mm256_set1_ps(half_to_float(d[g])), acc[g & 1]);
  }
#undef LOAD8
  return lanes_sum(_mm256_add_ps(acc[0], acc[1]));
}

/* One output of a 4-bit row: sum over groups of d * (q . x) + m * sum(x of the group), with
 * xsum the row's group sums and m = -8 d where there are no offsets. */
static inline float row4(const uint8_t *w, const uint16_t *d, const uint16_t *m, const float *x,
                         const float *xsum, int64_t groups, int64_t per) {
  const __m128i nibble = _mm_set1_epi8(0x0f);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  float shift = 0.f;
#define LOAD4BIT(b, c0, c1, c2, c3)                                           \
  do {                                                                        \
    const uint8_t *q = w + (b) * (BLOCK / 2);                                 \
    _mm_prefetch((const char *)(q + PREFETCH), _MM_HINT_T0);                  \
    const __m128i v = _mm_loadu_si128((const __m128i *)q);                    \
    const __m128i lo = _mm_and_si128(v, nibble);                              \
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), nibble);           \
    c0 = widen_nibbles(lo), c1 = widen_nibbles(_mm_srli_si128(lo, 8));        \
    c2 = widen_nibbles(hi), c3 = widen_nibbles(_mm_srli_si128(hi, 8));        \
  } while (0)
  for (int64_t g = 0; g < groups; g++) {
    __m256 t;
    GROUP_SUM(g * per, per, LOAD4BIT, x, t);
    const float scale = half_to_float(d[g]);
    acc[g & 1] = _mm256_fmadd_ps(t, _mm256_set1_ps(scale), acc[g & 1]);
    const float low = m ? half_to_float(m[g]) : -8.f * scale;
    shift += low * xsum[g];
  }
#undef LOAD4BIT
  return lanes_sum(_mm256_add_ps(acc[0], acc[1])) + shift;
}

static inline float row8_rounded(const int8_t *w, const uint16_t *d, const int8_t *xq,
                                 const float *xs, int64_t groups, int64_t per);
static inline float row4_rounded(const uint8_t *w, const uint16_t *d, const uint16_t *m,
                                 const int8_t *xq, const float *xs, const float *xsum,
                                 int64_t groups, int64_t per);

/* y (rows, out): every activation row times every weight row, on `threads` threads. The float
 * activations x with their groups' sums xsum (4 bits), or (x NULL) the rounded ones xq with
 * their blocks' scales xs and sums of codes xsum. */
static inline void products(const float *x, const int8_t *xq, const float *xs,
                            const float *xsum, int64_t rows, int64_t n, const uint8_t *w,
                            const uint16_t *d, const uint16_t *m, int64_t out, int bits,
                            int64_t group, float *y, int threads) {
  const int64_t per = group / BLOCK, groups = n / group, blocks = n / BLOCK;
  const int64_t row_bytes = bits == 8 ? n : n / 2;
  (void)threads; /* (unused where built without OpenMP) */
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * out * n >= PARALLEL_MIN)
  for (int64_t o = 0; o < out; o++) {
    const uint8_t *codes = w + o * row_bytes;
    const uint16_t *scales = d + o * groups;
    const uint16_t *low = m ? m + o * groups : NULL;
    /* (the row's codes stay in cache for the activation rows after the first) */
    for (int64_t r = 0; r < rows; r++) {
      if (x)
        y[r * out + o] = bits == 8 ? row8((const int8_t *)codes, scales, x + r * n, groups, per)
                                   : row4(codes, scales, low, x + r * n, xsum + r * groups,
                                          groups, per);
      else
        y[r * out + o] =
            bits == 8 ? row8_rounded((const int8_t *)codes, scales, xq + r * n, xs + r * blocks,
                                     groups, per)
                      : row4_rounded(codes, scales, low, xq + r * n, xs + r * blocks,
                                     xsum + r * blocks, groups, per);
    }
  }
}

/* y (rows, out) = x (rows, n) @ W.T for the block-quantized W above (bits 8 or 4; offsets m
 * NULL for 8 bits and for symmetric 4 bits), on `threads` threads. n is a multiple of group,
 * group a multiple of 32. 0 on success, 1 when the block sums' scratch cannot be allocated. */
int attnkit_block_linear(const float *x, int64_t rows, int64_t n, const uint8_t *w,
                         const uint16_t *d, const uint16_t *m, int64_t out, int bits,
                         int64_t group, float *y, int threads) {
  const int64_t groups = n / group;
  float *xsum = NULL;
  if (bits == 4) {
    xsum = malloc((size_t)(rows * groups + 1) * sizeof(float));
    if (!xsum) return 1;
    for (int64_t r = 0; r < rows; r++)
      for (int64_t g = 0; g < groups; g++) {
        __m256 s = _mm256_setzero_ps();
        for (int64_t i = g * group; i < (g + 1) * group; i += 8)
          s = _mm256_add_ps(s, _mm256_loadu_ps(x + r * n + i));
        xsum[r * groups + g] = lanes_sum(s);
      }
  }
  products(x, NULL, NULL, xsum, rows, n, w, d, m, out, bits, group, y, threads);
  free(xsum);
  return 0;
}

/* The rounded variant: the activations rounded to int8 per block of 32 (quantize_blocks, as
 * int8_dot.c rounds them, x ~ xs[b] * xq), each block's products summed in integers, then
 *
 *   8 bits: y = sum_b d[g] * xs[b] * (q . xq)
 *   4 bits: y = sum_b d[g] * xs[b] * (q . xq) + m[g] * xs[b] * sum(xq of the block)
 *
 * Faster where integer dots outrun float ones, and less exact: the activations' rounding adds
 * its error to the weights'. */
static inline float row8_rounded(const int8_t *w, const uint16_t *d, const int8_t *xq,
                                 const float *xs, int64_t groups, int64_t per) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    const float scale = half_to_float(d[g]);
    for (int64_t b = g * per; b < (g + 1) * per; b++) {
      const __m256i c = _mm256_loadu_si256((const __m256i *)(w + b * BLOCK));
      const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + b * BLOCK));
      _mm_prefetch((const char *)(w + b * BLOCK + PREFETCH), _MM_HINT_T0);
      const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(c, c), _mm256_sign_epi8(x, c));
      const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
      acc = _mm256_fmadd_ps(sums, _mm256_set1_ps(scale * xs[b]), acc);
    }
  }
  return lanes_sum(acc);
}

static inline float row4_rounded(const uint8_t *w, const uint16_t *d, const uint16_t *m,
                                 const int8_t *xq, const float *xs, const float *xsum,
                                 int64_t groups, int64_t per) {
  const __m128i nibble = _mm_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc = _mm256_setzero_ps();
  float shift = 0.f;
  for (int64_t g = 0; g < groups; g++) {
    const float scale = half_to_float(d[g]);
    const float low = m ? half_to_float(m[g]) : -8.f * scale;
    for (int64_t b = g * per; b < (g + 1) * per; b++) {
      const uint8_t *q = w + b * (BLOCK / 2);
      _mm_prefetch((const char *)(q + PREFETCH), _MM_HINT_T0);
      const __m128i v = _mm_loadu_si128((const __m128i *)q);
      /* inputs 0-15 (low nibbles), then 16-31 (high ones): the activations' order */
      const __m256i c = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), nibble),
                                         _mm_and_si128(v, nibble));
      const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + b * BLOCK));
      const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(c, x), ones));
      acc = _mm256_fmadd_ps(sums, _mm256_set1_ps(scale * xs[b]), acc);
      shift += low * xs[b] * xsum[b];
    }
  }
  return lanes_sum(acc) + shift;
}

/* attnkit_block_linear with the activations rounded to int8 (above); the same arguments and
 * results, 1 when the rounded activations' scratch cannot be allocated. */
int attnkit_block_linear_rounded(const float *x, int64_t rows, int64_t n, const uint8_t *w,
                                 const uint16_t *d, const uint16_t *m, int64_t out, int bits,
                                 int64_t group, float *y, int threads) {
  const int64_t blocks = n / BLOCK;
  int8_t *xq = malloc((size_t)(rows * n + 1));
  float *xs = malloc((size_t)(2 * rows * blocks + 1) * sizeof(float));
  if (!xq || !xs) {
    free(xq);
    free(xs);
    return 1;
  }
  float *xsum = xs + rows * blocks; /* each block's sum of codes */
  for (int64_t r = 0; r < rows; r++) {
    quantize_blocks(x + r * n, n, xq + r * n, xs + r * blocks);
    for (int64_t b = 0; b < blocks; b++) {
      int sum = 0;
      for (int i = 0; i < BLOCK; i++) sum += xq[r * n + b * BLOCK + i];
      xsum[r * blocks + b] = (float)sum;
    }
  }
  products(NULL, xq, xs, xsum, rows, n, w, d, m, out, bits, group, y, threads);
  free(xq);
  free(xs);
  return 0;
}
