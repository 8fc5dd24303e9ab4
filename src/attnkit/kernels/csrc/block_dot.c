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

/* Weight rows a tile multiplies with each activation vector: the activations are loaded once for
 * them, and each row keeps one accumulator (with the activations' four vectors and the codes
 * being widened, they fill AVX2's sixteen registers). */
#define OUTS 4

/* x (count blocks of 32) in the order tile_rows widens 8-bit codes: each block's activations
 * 0, 4, ..., 28, then 1, 5, ..., 29, then 2, 6, ..., then 3, 7, ... */
static void interleave_blocks(const float *x, int64_t count, float *out) {
  for (int64_t b = 0; b < count; b++)
    for (int k = 0; k < 4; k++)
      for (int i = 0; i < 8; i++) out[b * BLOCK + k * 8 + i] = x[b * BLOCK + 4 * i + k];
}

/* The outputs of T (<= OUTS) consecutive weight rows (codes `row_bytes` apart, scales and
 * offsets `groups` apart) with one activation row x (8 bits: interleave_blocks' order): each
 * block's codes are widened (`bits` 8 or 4) and multiplied by the block's activations, the block's sum scaled into the row's
 * accumulator; 4-bit rows add m times the group's activation sum (xsum) per group. The next
 * tile's codes are prefetched as the tile reads its own. */
/* (F16C's conversion for the scales: every CPU with AVX2 has it) */
#define TILE_TARGET __attribute__((target("avx2,fma,f16c")))
static inline __attribute__((always_inline)) TILE_TARGET void tile_rows(
    const uint8_t *w, int64_t row_bytes, const uint16_t *d, const uint16_t *m, const float *x,
    const float *xsum, int64_t groups, int64_t per, int bits, int T, float *out) {
  const __m256i nibble = _mm256_set1_epi32(0x0f);
  const int64_t block_bytes = bits == 8 ? BLOCK : BLOCK / 2;
  __m256 acc[OUTS];
  float shift[OUTS];
  for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps(), shift[t] = 0.f;
  for (int64_t g = 0; g < groups; g++) {
    float scale[OUTS];
    for (int t = 0; t < T; t++) {
      scale[t] = _cvtsh_ss(d[t * groups + g]);
      if (bits == 4)
        shift[t] += (m ? _cvtsh_ss(m[t * groups + g]) : -8.f * scale[t]) * xsum[g];
    }
    for (int64_t b = g * per; b < (g + 1) * per; b++) {
      const float *xb = x + b * BLOCK;
      const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
      const __m256 x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
      for (int t = 0; t < T; t++) {
        const uint8_t *q = w + t * row_bytes + b * block_bytes;
        _mm_prefetch((const char *)(q + OUTS * row_bytes), _MM_HINT_T0);
        __m256 c0, c1, c2, c3;
        if (bits == 8) { /* byte k of each 32-bit lane, sign-extended by shifts: no shuffles */
          const __m256i v = _mm256_loadu_si256((const __m256i *)q);
          c0 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24), 24));
          c1 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 24));
          c2 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 8), 24));
          c3 = _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 24));
        } else { /* each byte widened once: its low nibble, and its high one shifted down */
          const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
          const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)));
          c0 = _mm256_cvtepi32_ps(_mm256_and_si256(b0, nibble));
          c1 = _mm256_cvtepi32_ps(_mm256_and_si256(b1, nibble));
          c2 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
          c3 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
        }
        const __m256 s0 = _mm256_fmadd_ps(c2, x2, _mm256_mul_ps(c0, x0));
        const __m256 s1 = _mm256_fmadd_ps(c3, x3, _mm256_mul_ps(c1, x1));
        acc[t] = _mm256_fmadd_ps(_mm256_add_ps(s0, s1), _mm256_set1_ps(scale[t]), acc[t]);
      }
    }
  }
  for (int t = 0; t < T; t++) out[t] = lanes_sum(acc[t]) + shift[t];
}

/* tile_rows for a whole tile and for one row, per bit count (constants in each copy). */
#define TILE_ROWS(NAME, BITS, T)                                                              \
  static TILE_TARGET void NAME(const uint8_t *w, int64_t row_bytes, const uint16_t *d,         \
                               const uint16_t *m, const float *x, const float *xsum,          \
                               int64_t groups, int64_t per, float *out) {                     \
    tile_rows(w, row_bytes, d, m, x, xsum, groups, per, BITS, T, out);                        \
  }
TILE_ROWS(tile8, 8, OUTS)
TILE_ROWS(tile4, 4, OUTS)
TILE_ROWS(one8, 8, 1)
TILE_ROWS(one4, 4, 1)

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
  if (x) { /* float activations: tiles of OUTS weight rows, then the last rows one at a time */
    const int64_t tiles = out / OUTS;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * out * n >= PARALLEL_MIN)
    for (int64_t k = 0; k < tiles + out % OUTS; k++) {
      const int64_t o = k < tiles ? k * OUTS : tiles * OUTS + (k - tiles);
      const int T = k < tiles ? OUTS : 1;
      const uint16_t *low = m ? m + o * groups : NULL;
      for (int64_t r = 0; r < rows; r++) {
        float sums[OUTS];
        const float *xr = x + r * n, *sr = xsum ? xsum + r * groups : NULL;
        if (bits == 8)
          (T == OUTS ? tile8 : one8)(w + o * row_bytes, row_bytes, d + o * groups, NULL, xr, sr,
                                     groups, per, sums);
        else
          (T == OUTS ? tile4 : one4)(w + o * row_bytes, row_bytes, d + o * groups, low, xr, sr,
                                     groups, per, sums);
        for (int t = 0; t < T; t++) y[r * out + o + t] = sums[t];
      }
    }
    return;
  }
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

/* y (rows, out) = x (rows, n) @ W.T for the block-quantized W above (bits 8 or 4; offsets m
 * NULL for 8 bits and for symmetric 4 bits), on `threads` threads. n is a multiple of group,
 * group a multiple of 32. 0 on success, 1 when the scratch (the activations interleaved for 8
 * bits, the group sums for 4) cannot be allocated. */
int attnkit_block_linear(const float *x, int64_t rows, int64_t n, const uint8_t *w,
                         const uint16_t *d, const uint16_t *m, int64_t out, int bits,
                         int64_t group, float *y, int threads) {
  const int64_t groups = n / group;
  float *xsum = NULL;
  if (bits == 8) {
    float *xi = malloc((size_t)(rows * n + 1) * sizeof(float));
    if (!xi) return 1;
    interleave_blocks(x, rows * n / BLOCK, xi);
    products(xi, NULL, NULL, NULL, rows, n, w, d, m, out, bits, group, y, threads);
    free(xi);
    return 0;
  }
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
