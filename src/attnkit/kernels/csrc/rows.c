/* Row-wise steps of a forward pass that torch runs as several passes through fresh tensors.
 *
 * attnkit_rms_norm: RMSNorm, y = x / sqrt(mean(x^2) + eps) * w, in float32 for bf16 rows too;
 * attnkit_rms_norm_plus_one: the same scaled by 1 + w (Gemma's).
 * torch's CPU rms_norm is a composite of about ten kernels (a float32 copy of a bf16 input, its
 * square, the mean, the scale, the weight, the cast back); here a row is read twice (its sum of
 * squares, then the scaled product, from L1) and written once.
 *
 * attnkit_rotate: rotary positions, y = x cos + partner(x) signed_sin, where partner swaps the
 * channels of each pair (adjacent ones, or the two halves) and the tables hold each channel's
 * cosine and its sine with the sign of the pair's formula (attnkit.positional._full_width).
 * Each product and their sum are rounded to float32 (no fused multiply-add: torch's vector
 * kernels round so, its scalar tails may fuse), then once to bf16 for bf16 rows. torch's form
 * makes a float32 copy of bf16 queries and keys and a swapped copy of them first.
 *
 * Both write a new tensor and leave the input as it is; rows run in parallel.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "simd.h"

#define PARALLEL_MIN (1 << 14) /* values worth a second thread */

/* Eight float32 values stored at dst[i]: as they are, or rounded to nearest even bf16 (a NaN
 * stays a quiet NaN, as float_to_bf16). */
static inline void store8(void *dst, int64_t i, __m256 v, int bf16) {
  if (!bf16) {
    _mm256_storeu_ps((float *)dst + i, v);
    return;
  }
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i high = _mm256_srli_epi32(bits, 16);
  const __m256i odd = _mm256_and_si256(high, _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), odd);
  r = _mm256_srli_epi32(r, 16);
  const __m256i quiet = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  r = _mm256_blendv_epi8(r, quiet, _mm256_castps_si256(nan));
  const __m128i packed =
      _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128((__m128i *)((uint16_t *)dst + i), packed);
}

static inline void store1(void *dst, int64_t i, float v, int bf16) {
  if (bf16)
    ((uint16_t *)dst)[i] = float_to_bf16(v);
  else
    ((float *)dst)[i] = v;
}

/* a b + c d, rounded after each step as the vector code rounds (no fused multiply-add, which
 * the compiler may otherwise make of the plain expression). */
static inline float two_products(float a, float b, float c, float d) {
  const __m128 ab = _mm_mul_ss(_mm_set_ss(a), _mm_set_ss(b));
  return _mm_cvtss_f32(_mm_add_ss(ab, _mm_mul_ss(_mm_set_ss(c), _mm_set_ss(d))));
}

/* Rows k = 0 .. rows - 1 of x (dim values each, x_stride elements apart) normalised into the
 * contiguous rows of out and scaled by weight + offset (weight: dim values of the rows' dtype, or
 * NULL for none; offset 1: Gemma's scale, 1 + weight, in float32). */
static void norm_rows(const void *x, int64_t rows, int64_t dim, int64_t x_stride,
                      const void *weight, float offset, void *out, float eps, int bf16,
                      int threads) {
  (void)threads; /* (unused where built without OpenMP) */
  const int64_t size = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * dim >= PARALLEL_MIN)
  for (int64_t k = 0; k < rows; k++) {
    const void *row = (const char *)x + k * x_stride * size;
    void *dst = (char *)out + k * dim * size;
    __m256 squares = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= dim; j += 8) {
      const __m256 v = load8(row, j, bf16);
      squares = _mm256_fmadd_ps(v, v, squares);
    }
    float total = lanes_sum(squares);
    for (; j < dim; j++) total += load1(row, j, bf16) * load1(row, j, bf16);
    const float scale = 1.f / sqrtf(total / (float)dim + eps);
    const __m256 by = _mm256_set1_ps(scale);
    const __m256 shift = _mm256_set1_ps(offset);
    for (j = 0; j + 8 <= dim; j += 8) {
      __m256 v = _mm256_mul_ps(load8(row, j, bf16), by);
      if (weight && offset != 0.f)
        v = _mm256_mul_ps(v, _mm256_add_ps(load8(weight, j, bf16), shift));
      else if (weight)
        v = _mm256_mul_ps(v, load8(weight, j, bf16));
      store8(dst, j, v, bf16);
    }
    for (; j < dim; j++) {
      float v = load1(row, j, bf16) * scale;
      if (weight) v *= offset != 0.f ? load1(weight, j, bf16) + offset : load1(weight, j, bf16);
      store1(dst, j, v, bf16);
    }
  }
}

/* norm_rows scaled by the weight itself. Returns 0. */
int attnkit_rms_norm(const void *x, int64_t rows, int64_t dim, int64_t x_stride,
                     const void *weight, void *out, float eps, int bf16, int threads) {
  norm_rows(x, rows, dim, x_stride, weight, 0.f, out, eps, bf16, threads);
  return 0;
}

/* norm_rows scaled by 1 + weight (Gemma's RMSNorm). Returns 0. */
int attnkit_rms_norm_plus_one(const void *x, int64_t rows, int64_t dim, int64_t x_stride,
                              const void *weight, void *out, float eps, int bf16, int threads) {
  norm_rows(x, rows, dim, x_stride, weight, 1.f, out, eps, bf16, threads);
  return 0;
}

/* x is (count, heads, length, dim) with a contiguous last dim and the given strides (in
 * elements); the float32 tables are (length, dim) rows, table_item elements apart per item (0:
 * shared by every item). out is contiguous, of x's dtype. dim is even. Returns 0. */
int attnkit_rotate(const void *x, int64_t count, int64_t heads, int64_t length, int64_t dim,
                   int64_t item_stride, int64_t head_stride, int64_t row_stride,
                   const float *cos, const float *signed_sin, int64_t table_item, void *out,
                   int interleaved, int bf16, int threads) {
  (void)threads;
  const int64_t size = bf16 ? 2 : 4, half = dim / 2, rows = count * heads * length;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * dim >= PARALLEL_MIN)
  for (int64_t r = 0; r < rows; r++) {
    const int64_t b = r / (heads * length), h = (r / length) % heads, l = r % length;
    const void *row =
        (const char *)x + (b * item_stride + h * head_stride + l * row_stride) * size;
    const float *c = cos + b * table_item + l * dim, *s = signed_sin + b * table_item + l * dim;
    void *dst = (char *)out + r * dim * size;
    int64_t j = 0;
    if (interleaved) {
      for (; j + 8 <= dim; j += 8) {
        const __m256 v = load8(row, j, bf16);
        const __m256 partner = _mm256_permute_ps(v, 0xB1); /* (x1 x0 x3 x2 ...) */
        const __m256 y = _mm256_add_ps(_mm256_mul_ps(v, _mm256_loadu_ps(c + j)),
                                       _mm256_mul_ps(partner, _mm256_loadu_ps(s + j)));
        store8(dst, j, y, bf16);
      }
      for (; j < dim; j++) {
        const float y = two_products(load1(row, j, bf16), c[j], load1(row, j ^ 1, bf16), s[j]);
        store1(dst, j, y, bf16);
      }
    } else {
      for (; j + 8 <= half; j += 8) {
        const __m256 a = load8(row, j, bf16), z = load8(row, j + half, bf16);
        const __m256 y0 = _mm256_add_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + j)),
                                        _mm256_mul_ps(z, _mm256_loadu_ps(s + j)));
        const __m256 y1 = _mm256_add_ps(_mm256_mul_ps(z, _mm256_loadu_ps(c + j + half)),
                                        _mm256_mul_ps(a, _mm256_loadu_ps(s + j + half)));
        store8(dst, j, y0, bf16);
        store8(dst, j + half, y1, bf16);
      }
      for (; j < half; j++) {
        const float a = load1(row, j, bf16), z = load1(row, j + half, bf16);
        store1(dst, j, two_products(a, c[j], z, s[j]), bf16);
        store1(dst, j + half, two_products(z, c[j + half], a, s[j + half]), bf16);
      }
    }
  }
  return 0;
}
