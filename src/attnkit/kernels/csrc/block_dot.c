/* Block-quantized weight x float32 activation products (GGUF's Q8_0, Q4_0 and Q4_1 layouts).
 *
 * The weight is cut into blocks of 32 inputs of a row; each group of `group` inputs (a multiple
 * of 32) has an f16 scale d and, for 4-bit codes, an f16 offset m:
 *
 *   8 bits: w[o, i] = d[o, g] * q[o, i],        q int8
 *   4 bits: w[o, i] = d[o, g] * q[o, i] + m,    q in 0..15; m = -8 d without offsets (Q4_0)
 *
 * The activations stay float32: each block's codes are widened to floats and multiplied by the
 * activations (float32 sums), and the group's scale goes on once per group. The offset's term
 * is m times the group's activation sum, computed once per activation row. Weight rows go a
 * few at a time (a tile), so each block of activations loaded serves every row of the tile (the
 * weight streams from memory once; the activations stay in cache). This keeps the result the float
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

/* The most weight rows a pass (the caller's `tile`, 2 or 4): each loaded activation block
 * serves all of them. Four rows' sums, the block of activations and the widened codes fit
 * AVX2's sixteen vector registers; fewer rows read fewer streams of codes at once, which some
 * memory systems serve faster (the policy measures it). */
#define TILE 4
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
  for (; i + 8 <= count; i += 8)
    s = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s);
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

/* block_sums for the rounded activations (xq, with the block's scale xs): each weight row's
 * block summed in integers, then scaled by xs. */
static inline __attribute__((always_inline)) void rounded_block_sums(
    const int R, const int8_t *xq, const float *xs, const uint8_t *w, int64_t row_bytes,
    int64_t b, int bits, __m256 *s) {
  const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + b * BLOCK));
  const __m256 scale = _mm256_broadcast_ss(xs + b);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int i = 0; i < R; i++) {
    __m256i pairs;
    if (bits == 8) {
      const uint8_t *q = w + i * row_bytes + b * BLOCK;
      _mm_prefetch((const char *)(q + PREFETCH), _MM_HINT_T0);
      const __m256i c = _mm256_loadu_si256((const __m256i *)q);
      pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(c, c), _mm256_sign_epi8(x, c));
    } else {
      const uint8_t *q = w + i * row_bytes + b * (BLOCK / 2);
      _mm_prefetch((const char *)(q + PREFETCH), _MM_HINT_T0);
      const __m128i v = _mm_loadu_si128((const __m128i *)q), nibble = _mm_set1_epi8(0x0f);
      /* inputs 0-15 (low nibbles), then 16-31 (high ones): the activations' order */
      const __m256i c = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), nibble),
                                         _mm_and_si128(v, nibble));
      pairs = _mm256_maddubs_epi16(c, x);
    }
    s[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones)), scale);
  }
}

/* `R` (at most TILE) outputs o..o+R-1 for every activation row: sum over groups of
 * d * (q . x) (+ m * sum(x of the group) for 4 bits, xsum holding the rows' group sums), with
 * the float activations x or (x NULL) the rounded ones xq and their blocks' scales xs. The
 * rows' scales (and offsets) are widened to floats a chunk of groups at a time; each block of
 * activations is loaded once for the R weight rows, whose sums stay in registers. */
static inline __attribute__((always_inline)) void run_tile(
    const int R, const float *x, const int8_t *xq, const float *xs, const float *xsum,
    int64_t rows, int64_t n, const uint8_t *w, int64_t row_bytes, const uint16_t *d,
    const uint16_t *m, int64_t groups, int64_t per, int bits, float *y, int64_t out) {
  const int64_t blocks = n / BLOCK;
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
      const float *xr = x ? x + r * n : NULL, *xsr = xs ? xs + r * blocks : NULL;
      const int8_t *xqr = xq ? xq + r * n : NULL;
      __m256 acc[TILE];
      for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();
      for (int64_t g = 0; g < count; g++) {
        const int64_t first = (g0 + g) * per;
        __m256 t[TILE], s[TILE];
        if (x) block_sums(R, xr, w, row_bytes, first, bits, PREFETCH, t);
        else rounded_block_sums(R, xqr, xsr, w, row_bytes, first, bits, t);
        for (int64_t b = first + 1; b < first + per; b++) {
          if (x) block_sums(R, xr, w, row_bytes, b, bits, PREFETCH, s);
          else rounded_block_sums(R, xqr, xsr, w, row_bytes, b, bits, s);
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

/* The tile for R rows of `bits` bits with float (x) or rounded (xq, xs) activations: each
 * combination its own copy, its branches decided when compiled. */
#define TILE_CALL(R, BITS, ROUNDED, o)                                                          \
  run_tile(R, ROUNDED ? NULL : x, ROUNDED ? xq : NULL, ROUNDED ? xs : NULL, xsum, rows, n,   \
       w + (o) * row_bytes, row_bytes, d + (o) * groups, m ? m + (o) * groups : NULL, groups, \
       per, BITS, y + (o), out)

/* y (rows, out) for the float activations x (rows, n) or (x NULL) the rounded ones xq with
 * their blocks' scales xs, xsum the rows' group sums of the activations (4 bits): `tile` weight
 * rows a pass (2 or 4; others run 4), on `threads` threads. */
static void products(const float *x, const int8_t *xq, const float *xs, const float *xsum,
                     int64_t rows, int64_t n, const uint8_t *w, const uint16_t *d,
                     const uint16_t *m, int64_t out, int bits, int64_t group, float *y,
                     int threads, int tile) {
  const int64_t per = group / BLOCK, groups = n / group;
  const int64_t row_bytes = bits == 8 ? n : n / 2;
  const int64_t step = tile == 2 ? 2 : TILE, tiles = (out + step - 1) / step;
  (void)threads; /* (unused where built without OpenMP) */
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * out * n >= PARALLEL_MIN)
  for (int64_t t = 0; t < tiles; t++) {
    const int64_t o = t * step;
    if (o + step > out) /* (the last rows, one at a time) */
      for (int64_t i = o; i < out; i++) {
        if (x) TILE_CALL(1, bits, 0, i);
        else TILE_CALL(1, bits, 1, i);
      }
    else if (step == 2) {
      if (x && bits == 8) TILE_CALL(2, 8, 0, o);
      else if (x) TILE_CALL(2, 4, 0, o);
      else if (bits == 8) TILE_CALL(2, 8, 1, o);
      else TILE_CALL(2, 4, 1, o);
    } else if (x && bits == 8) TILE_CALL(TILE, 8, 0, o);
    else if (x) TILE_CALL(TILE, 4, 0, o);
    else if (bits == 8) TILE_CALL(TILE, 8, 1, o);
    else TILE_CALL(TILE, 4, 1, o);
  }
}
#undef TILE_CALL

/* y (rows, out) = x (rows, n) @ W.T for the block-quantized W above (bits 8 or 4; offsets m
 * NULL for 8 bits and for symmetric 4 bits), on `threads` threads, `tile` weight rows a pass.
 * n is a multiple of group, group a multiple of 32. 0 on success, 1 when the block sums'
 * scratch cannot be allocated. */
int attnkit_block_linear(const float *x, int64_t rows, int64_t n, const uint8_t *w,
                         const uint16_t *d, const uint16_t *m, int64_t out, int bits,
                         int64_t group, float *y, int threads, int tile) {
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
  products(x, NULL, NULL, xsum, rows, n, w, d, m, out, bits, group, y, threads, tile);
  free(xsum);
  return 0;
}

/* The rounded variant: the activations rounded to int8 per block of 32 (quantize_blocks, as
 * int8_dot.c rounds them, x ~ xs[b] * xq), each block's products summed in integers, then
 *
 *   8 bits: y = sum_g d[g] * sum_(b in g) xs[b] * (q . xq)
 *   4 bits: the same + sum_g m[g] * sum_(b in g) xs[b] * sum(xq of the block)
 *
 * The offsets' term takes each group's sum of the rounded activations, worked out once per
 * activation row. Faster where integer dots outrun float ones, and less exact: the
 * activations' rounding adds its error to the weights'.
 *
 * attnkit_block_linear with the activations rounded to int8; the same arguments and results, 1
 * when the rounded activations' scratch cannot be allocated. */
int attnkit_block_linear_rounded(const float *x, int64_t rows, int64_t n, const uint8_t *w,
                                 const uint16_t *d, const uint16_t *m, int64_t out, int bits,
                                 int64_t group, float *y, int threads, int tile) {
  const int64_t blocks = n / BLOCK, groups = n / group, per = group / BLOCK;
  int8_t *xq = malloc((size_t)(rows * n + 1));
  float *xs = malloc((size_t)(rows * (blocks + groups) + 1) * sizeof(float));
  if (!xq || !xs) {
    free(xq);
    free(xs);
    return 1;
  }
  float *xsum = xs + rows * blocks; /* each group's sum of the rounded activations */
  for (int64_t r = 0; r < rows; r++) {
    quantize_blocks(x + r * n, n, xq + r * n, xs + r * blocks);
    for (int64_t g = 0; g < groups; g++) {
      float total = 0.f;
      for (int64_t b = g * per; b < (g + 1) * per; b++) {
        int sum = 0;
        for (int i = 0; i < BLOCK; i++) sum += xq[r * n + b * BLOCK + i];
        total += xs[r * blocks + b] * (float)sum;
      }
      xsum[r * groups + g] = total;
    }
  }
  products(NULL, xq, xs, xsum, rows, n, w, d, m, out, bits, group, y, threads, tile);
  free(xq);
  free(xs);
  return 0;
}
