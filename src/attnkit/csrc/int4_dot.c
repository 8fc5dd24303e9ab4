/* Int4 weight x float activation products for a few rows (decoding), with integer dots.
 *
 * w[o, i] = q[o, i] * scale[o, g] + offset[o, g], q in 0..15, g = i / group (group a multiple
 * of 32). With the activations rounded to int8 per block of 32 inputs as the int8 kernel rounds
 * them (x[i] ~ xs[b] * xq[i]), a row's product splits into integer dots and one term a group:
 *
 *   y[r, o] = sum_g scale[o, g] * sum_{b in g} xs[b] * sum_{i in b} xq[i] * q[o, i]
 *                 + offset[o, g] * sum_{b in g} xs[b] * sum_{i in b} xq[i]
 *
 * The second sum (xz[g]) depends on the activations alone, once per row and group.
 *
 * Decoding reads every weight once, so the codes are laid out as one sequential stream, as
 * int8_dot.c's: output rows in groups of four (the weight padded to whole groups), each group's
 * codes block by block, the four rows' 16 bytes of a block side by side ((out / 4, n / 32, 4,
 * 16)). Byte j of a row's block holds input j in its low nibble and input 16 + j in its high
 * one, so a 64-byte load gives, after a shift and two masks, the four rows' codes of inputs
 * 0-15 and of 16-31, each to multiply by one broadcast half of the block's activations. The
 * scales and offsets are bf16, per group of four rows and input group (scale[4], offset[4]).
 *
 * AVX2 multiplies unsigned codes (0..15) by signed activations in byte pairs (at most
 * 2 * 15 * 127 < 2^15); AVX512-VNNI sums four products to an int32 lane in one instruction. A
 * lane holds the same eight products either way (four of each nibble), summed in the same
 * float order, so both give the same bits.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

#define BLOCK 32
#define GROUP 4
#define BLOCK_BYTES (GROUP * BLOCK / 2) /* a group's codes of one block */
#define PREFETCH 4096                   /* bytes ahead */
#define PARALLEL_MIN (1 << 17)          /* products (codes x rows) worth a second thread */

int attnkit_int8_vnni(int wanted); /* (int8_dot.c) */

/* Four bf16 values as float32 lanes 0-3. */
static inline __m128 widen4(const uint16_t *h) {
  const __m128i v = _mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i *)h));
  return _mm_castsi128_ps(_mm_slli_epi32(v, 16));
}

/* A row's four lanes summed, in the same order on both paths. */
static inline float sum4(__m128 v) {
  const __m128 pairs = _mm_add_ps(v, _mm_movehl_ps(v, v));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
}

/* The four dots of one group of rows with one activation row (AVX2): rows 0-1 in acc[0] (four
 * lanes each), rows 2-3 in acc[1]. */
static inline void group_dots(const int8_t *xq, const float *xs, const float *xz,
                              const uint8_t *w, const uint16_t *sm, int64_t n, int64_t group,
                              float *dots) {
  const __m256i nibble = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, zacc[2] = {acc[0], acc[1]};
  const int64_t per = group / BLOCK;
  for (int64_t g = 0; g < n / group; g++) {
    __m256 gacc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = g * per; b < (g + 1) * per; b++) {
      const uint8_t *codes = w + b * BLOCK_BYTES;
      /* (a prefetch past the end of the weight is harmless: it never faults) */
      _mm_prefetch((const char *)(codes + PREFETCH), _MM_HINT_T0);
      const __m256i lo_x =
          _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(xq + b * BLOCK)));
      const __m256i hi_x =
          _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(xq + b * BLOCK + 16)));
      const __m256 s = _mm256_set1_ps(xs[b]);
      for (int k = 0; k < 2; k++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(codes + 32 * k));
        const __m256i lo = _mm256_and_si256(v, nibble);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        const __m256i pairs =
            _mm256_add_epi16(_mm256_maddubs_epi16(lo, lo_x), _mm256_maddubs_epi16(hi, hi_x));
        const __m256i sums = _mm256_madd_epi16(pairs, ones);
        gacc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), s, gacc[k]);
      }
    }
    const __m256 scales = _mm256_castps128_ps256(widen4(sm + 8 * g));
    const __m256 offsets = _mm256_castps128_ps256(widen4(sm + 8 * g + 4));
    const __m256 z = _mm256_set1_ps(xz[g]);
    for (int k = 0; k < 2; k++) {
      /* lanes 0-3 row 2k, lanes 4-7 row 2k + 1 */
      const __m256i spread = _mm256_setr_epi32(2 * k, 2 * k, 2 * k, 2 * k, 2 * k + 1, 2 * k + 1,
                                               2 * k + 1, 2 * k + 1);
      acc[k] = _mm256_fmadd_ps(gacc[k], _mm256_permutevar8x32_ps(scales, spread), acc[k]);
      zacc[k] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(offsets, spread), z, zacc[k]);
    }
  }
  for (int k = 0; k < 2; k++) {
    dots[2 * k] = sum4(_mm256_castps256_ps128(acc[k])) + _mm256_cvtss_f32(zacc[k]);
    dots[2 * k + 1] = sum4(_mm256_extractf128_ps(acc[k], 1)) +
                      _mm_cvtss_f32(_mm256_extractf128_ps(zacc[k], 1));
  }
}

/* group_dots with AVX512-VNNI: the four rows in one register, four lanes each. */
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static void group_dots_vnni(
    const int8_t *xq, const float *xs, const float *xz, const uint8_t *w, const uint16_t *sm,
    int64_t n, int64_t group, float *dots) {
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  __m512 acc = _mm512_setzero_ps(), zacc = _mm512_setzero_ps();
  const int64_t per = group / BLOCK;
  for (int64_t g = 0; g < n / group; g++) {
    __m512 gacc = _mm512_setzero_ps();
    for (int64_t b = g * per; b < (g + 1) * per; b++) {
      const uint8_t *codes = w + b * BLOCK_BYTES;
      _mm_prefetch((const char *)(codes + PREFETCH), _MM_HINT_T0);
      const __m512i lo_x =
          _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(xq + b * BLOCK)));
      const __m512i hi_x =
          _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(xq + b * BLOCK + 16)));
      const __m512i v = _mm512_loadu_si512((const void *)codes);
      const __m512i lo = _mm512_and_si512(v, nibble);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      const __m512i low = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, lo_x);
      const __m512i sums = _mm512_dpbusd_epi32(low, hi, hi_x);
      gacc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(xs[b]), gacc);
    }
    const __m512 scales = _mm512_castps128_ps512(widen4(sm + 8 * g));
    const __m512 offsets = _mm512_castps128_ps512(widen4(sm + 8 * g + 4));
    acc = _mm512_fmadd_ps(gacc, _mm512_permutexvar_ps(spread, scales), acc);
    zacc = _mm512_fmadd_ps(_mm512_permutexvar_ps(spread, offsets), _mm512_set1_ps(xz[g]), zacc);
  }
  dots[0] = sum4(_mm512_castps512_ps128(acc)) + _mm512_cvtss_f32(zacc);
  dots[1] = sum4(_mm512_extractf32x4_ps(acc, 1)) + _mm_cvtss_f32(_mm512_extractf32x4_ps(zacc, 1));
  dots[2] = sum4(_mm512_extractf32x4_ps(acc, 2)) + _mm_cvtss_f32(_mm512_extractf32x4_ps(zacc, 2));
  dots[3] = sum4(_mm512_extractf32x4_ps(acc, 3)) + _mm_cvtss_f32(_mm512_extractf32x4_ps(zacc, 3));
}

/* y (rows, out) = x (rows, n) @ W.T for the int4 weight W of codes w and scales/offsets sm in
 * the order above (ceil(out / 4) groups of rows), on `threads` threads; 0 on success, 1 when
 * the activations' scratch cannot be allocated. n and group are multiples of 32, group divides
 * n. The VNNI dots run where int8_dot.c's do (attnkit_int8_vnni). */
int attnkit_int4_linear(const float *x, int64_t rows, int64_t n, const uint8_t *w,
                        const uint16_t *sm, int64_t out, int64_t group, float *y, int threads) {
  const int64_t blocks = n / BLOCK, groups = n / group, per = group / BLOCK;
  int8_t *xq = malloc((size_t)(rows * n));
  float *xs = malloc((size_t)(rows * (blocks + groups)) * sizeof(float));
  if (!xq || !xs) {
    free(xq);
    free(xs);
    return 1;
  }
  float *xz = xs + rows * blocks;
  for (int64_t r = 0; r < rows; r++) {
    int8_t *q = xq + r * n;
    const float *s = xs + r * blocks;
    quantize_blocks(x + r * n, n, q, xs + r * blocks);
    for (int64_t g = 0; g < groups; g++) {
      float z = 0.f;
      for (int64_t b = g * per; b < (g + 1) * per; b++) {
        int sum = 0;
        for (int i = 0; i < BLOCK; i++) sum += q[b * BLOCK + i];
        z += s[b] * (float)sum;
      }
      xz[r * groups + g] = z;
    }
  }
  const int64_t row_groups = (out + GROUP - 1) / GROUP;
  const int wide = attnkit_int8_vnni(-1);
  (void)threads; /* (unused where built without OpenMP) */
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * out * n >= PARALLEL_MIN)
  for (int64_t rg = 0; rg < row_groups; rg++) {
    const int64_t o = rg * GROUP;
    const uint8_t *codes = w + o * (n / 2);
    const uint16_t *scales = sm + rg * groups * 2 * GROUP;
    float dots[GROUP];
    for (int64_t r = 0; r < rows; r++) {
      if (wide)
        group_dots_vnni(xq + r * n, xs + r * blocks, xz + r * groups, codes, scales, n, group,
                        dots);
      else
        group_dots(xq + r * n, xs + r * blocks, xz + r * groups, codes, scales, n, group, dots);
      for (int k = 0; k < GROUP && o + k < out; k++) y[r * out + o + k] = dots[k];
    }
  }
  free(xq);
  free(xs);
  return 0;
}
