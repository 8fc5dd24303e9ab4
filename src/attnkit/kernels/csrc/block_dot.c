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
/* Bytes ahead in a row's codes to prefetch: the tile's rows are contiguous, so this runs a few
 * tiles ahead of the stream the kernel reads. */
#define PREFETCH 4096
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

#define TILE 4   /* weight rows a pass: each loaded activation block serves all of them */
#define CHUNK 64 /* groups whose scales a pass widens to floats at once */

/* Eight IEEE halves as floats (half_to_float's steps, eight lanes at once). */
static inline __m256 halves_to_floats(const uint16_t *h) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)h));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x8000)), 16);
  const __m256i body = _mm256_and_si256(v, _mm256_set1_epi32(0x7fff));
  const __m256 scaled =
      _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(body, 13)), _mm256_set1_ps(0x1p112f));
  const __m256i special = _mm256_cmpgt_epi32(body, _mm256_set1_epi32(0x7bff));
  const __m256i top = _mm256_or_si256(
      _mm256_set1_epi32(0x7f800000),
      _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x3ff)), 13));
  const __m256i bits = _mm256_blendv_epi8(_mm256_castps_si256(scaled), top, special);
  return _mm256_castsi256_ps(_mm256_or_si256(bits, sign));
}

/* f[0:count] = the halves h[0:count] as floats. */
static inline void widen_halves(const uint16_t *h, int64_t count, float *f) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) _mm256_storeu_ps(f + i, halves_to_floats(h + i));
  for (; i < count; i++) f[i] = half_to_float(h[i]);
}

/* The four vectors of eight codes of block b of an 8-bit row, as floats. */
static inline void codes8(const uint8_t *w, int64_t b, int64_t ahead, __m256 c[4]) {
  const int8_t *q = (const int8_t *)w + b * BLOCK;
  _mm_prefetch((const char *)(q + ahead), _MM_HINT_T0);
  for (int k = 0; k < 4; k++)
    c[k] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * k))));
}

/* The same for a 4-bit row: bytes 0-7 zero-extended to 32 bits hold inputs 0-7 in their low
 * nibbles and 16-23 in their high ones; bytes 8-15 inputs 8-15 and 24-31. */
static inline void codes4(const uint8_t *w, int64_t b, int64_t ahead, __m256 c[4]) {
  const uint8_t *q = w + b * (BLOCK / 2);
  _mm_prefetch((const char *)(q + ahead), _MM_HINT_T0);
  const __m256i nibble = _mm256_set1_epi32(0x0f);
  const __m256i first = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
  const __m256i second = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)));
  c[0] = _mm256_cvtepi32_ps(_mm256_and_si256(first, nibble));
  c[1] = _mm256_cvtepi32_ps(_mm256_and_si256(second, nibble));
  c[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(first, 4));
  c[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(second, 4));
}

/* sum_i a[i] * b[i] for i < count. */
static inline float dot(const float *a, const float *b, int64_t count) {
  __m256 s = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s);
  float total = lanes_sum(s);
  for (; i < count; i++) total += a[i] * b[i];
  return total;
}

/* s[i] = the products of block b of weight row i (i < R) and of the activations xr, eight
 * partial sums; the block of activations is loaded once for the R rows. */
static inline __attribute__((always_inline)) void block_sums(const int R, const float *xr,
                                                             const uint8_t *w, int64_t row_bytes,
                                                             int64_t b, int bits, int64_t ahead,
                                                             __m256 *s) {
  const float *xb = xr + b * BLOCK;
  const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
  const __m256 x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
  for (int i = 0; i < R; i++) {
    __m256 c[4];
    if (bits == 8) codes8(w + i * row_bytes, b, ahead, c);
    else codes4(w + i * row_bytes, b, ahead, c);
    /* two short chains a block, so the rows' sums do not wait on one another */
    const __m256 a = _mm256_fmadd_ps(c[1], x1, _mm256_mul_ps(c[0], x0));
    const __m256 e = _mm256_fmadd_ps(c[3], x3, _mm256_mul_ps(c[2], x2));
    s[i] = _mm256_add_ps(a, e);
  }
}

/* `R` (at most TILE) outputs o..o+R-1 for every activation row: sum over groups of
 * d * (q . x) (+ m * sum(x of the group) for 4 bits, xsum holding the rows' group sums). The
 * rows' scales (and offsets) are widened to floats a chunk of groups at a time; each block of
 * activations is loaded once for the R weight rows, whose sums stay in registers. */
static inline __attribute__((always_inline)) void tile_float(
    const int R, const float *x, const float *xsum, int64_t rows, int64_t n, const uint8_t *w,
    int64_t row_bytes, const uint16_t *d, const uint16_t *m, int64_t groups, int64_t per,
    int bits, float *y, int64_t out) {
  float scale[TILE][CHUNK], low[TILE][CHUNK];
  for (int64_t g0 = 0; g0 < groups; g0 += CHUNK) {
    const int64_t count = groups - g0 < CHUNK ? groups - g0 : CHUNK;
    for (int i = 0; i < R; i++) {
      widen_halves(d + i * groups + g0, count, scale[i]);
      if (bits == 4 && m) widen_halves(m + i * groups + g0, count, low[i]);
      else if (bits == 4)
        for (int64_t g = 0; g < count; g++) low[i][g] = -8.f * scale[i][g];
    }
    for (int64_t r = 0; r < rows; r++) {
      const float *xr = x + r * n;
      __m256 acc[TILE];
      for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();
      for (int64_t g = 0; g < count; g++) {
        const int64_t first = (g0 + g) * per;
        __m256 t[TILE], s[TILE];
        block_sums(R, xr, w, row_bytes, first, bits, PREFETCH, t);
        for (int64_t b = first + 1; b < first + per; b++) {
          block_sums(R, xr, w, row_bytes, b, bits, PREFETCH, s);
          for (int i = 0; i < R; i++) t[i] = _mm256_add_ps(t[i], s[i]);
        }
        for (int i = 0; i < R; i++)
          acc[i] = _mm256_fmadd_ps(t[i], _mm256_broadcast_ss(&scale[i][g]), acc[i]);
      }
      for (int i = 0; i < R; i++) {
        float s = lanes_sum(acc[i]);
        if (bits == 4) s += dot(low[i], xsum + r * groups + g0, count);
        y[r * out + i] = g0 ? y[r * out + i] + s : s;
      }
    }
  }
}

/* y (rows, out) for the float activations x (rows, n) with their groups' sums xsum (4 bits):
 * TILE weight rows a pass, on `threads` threads. */
static void float_products(const float *x, const float *xsum, int64_t rows, int64_t n,
                           const uint8_t *w, const uint16_t *d, const uint16_t *m, int64_t out,
                           int bits, int64_t group, float *y, int threads) {
  const int64_t per = group / BLOCK, groups = n / group, tiles = (out + TILE - 1) / TILE;
  const int64_t row_bytes = bits == 8 ? n : n / 2;
  (void)threads; /* (unused where built without OpenMP) */
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * out * n >= PARALLEL_MIN)
  for (int64_t t = 0; t < tiles; t++) {
    const int64_t o = t * TILE;
    const uint16_t *low = m ? m + o * groups : NULL;
    if (o + TILE <= out && bits == 8)
      tile_float(TILE, x, xsum, rows, n, w + o * row_bytes, row_bytes, d + o * groups, low,
                 groups, per, 8, y + o, out);
    else if (o + TILE <= out)
      tile_float(TILE, x, xsum, rows, n, w + o * row_bytes, row_bytes, d + o * groups, low,
                 groups, per, 4, y + o, out);
    else /* (the last rows, one at a time) */
      for (int64_t i = o; i < out; i++)
        tile_float(1, x, xsum, rows, n, w + i * row_bytes, row_bytes, d + i * groups,
                   m ? m + i * groups : NULL, groups, per, bits, y + i, out);
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
  float_products(x, xsum, rows, n, w, d, m, out, bits, group, y, threads);
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

/* y (rows, out) for the rounded activations xq with their blocks' scales xs and sums of codes
 * xsum: every activation row times every weight row, on `threads` threads. */
static void rounded_products(const int8_t *xq, const float *xs, const float *xsum, int64_t rows,
                             int64_t n, const uint8_t *w, const uint16_t *d, const uint16_t *m,
                             int64_t out, int bits, int64_t group, float *y, int threads) {
  const int64_t per = group / BLOCK, groups = n / group, blocks = n / BLOCK;
  const int64_t row_bytes = bits == 8 ? n : n / 2;
  (void)threads; /* (unused where built without OpenMP) */
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * out * n >= PARALLEL_MIN)
  for (int64_t o = 0; o < out; o++) {
    const uint8_t *codes = w + o * row_bytes;
    const uint16_t *scales = d + o * groups;
    const uint16_t *low = m ? m + o * groups : NULL;
    /* (the row's codes stay in cache for the activation rows after the first) */
    for (int64_t r = 0; r < rows; r++)
      y[r * out + o] =
          bits == 8 ? row8_rounded((const int8_t *)codes, scales, xq + r * n, xs + r * blocks,
                                   groups, per)
                    : row4_rounded(codes, scales, low, xq + r * n, xs + r * blocks,
                                   xsum + r * blocks, groups, per);
  }
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
  rounded_products(xq, xs, xsum, rows, n, w, d, m, out, bits, group, y, threads);
  free(xq);
  free(xs);
  return 0;
}
