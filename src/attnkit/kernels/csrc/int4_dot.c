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
 * float order, so both give the same bits, and a row's result does not depend on the rows
 * beside it. Two or four activation rows share each unpacked block (a batch's steps).
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

int attnkit_int8_wide(int wanted); /* (int8_dot.c) */

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

/* The activations of R rows (1 or 2) as the dots read them: each row's int8 codes (n), block
 * scales (n / 32) and group sums xz (n / group) at strides of a row. */
typedef struct {
  const int8_t *xq;
  const float *xs, *xz;
  int64_t n, blocks, groups;
} Rows;

/* The four dots of one group of weight rows with R activation rows (AVX2, R <= 2), into
 * dots[4 r + k]: weight rows 0-1 in acc[r][0] (four lanes each), rows 2-3 in acc[r][1]. Each
 * 64-byte block of codes is unpacked once for the R rows; each row's sums run in the same order
 * whatever R. */
static inline __attribute__((always_inline)) void group_dots(const Rows *x, int R,
                                                             const uint8_t *w, const uint16_t *sm,
                                                             int64_t group, float *dots) {
  const __m256i nibble = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  __m256 acc[2][2], zacc[2][2];
  for (int r = 0; r < R; r++)
    for (int k = 0; k < 2; k++) acc[r][k] = zacc[r][k] = _mm256_setzero_ps();
  const int64_t per = group / BLOCK;
  for (int64_t g = 0; g < x->groups; g++) {
    __m256 gacc[2][2];
    for (int r = 0; r < R; r++) gacc[r][0] = gacc[r][1] = _mm256_setzero_ps();
    for (int64_t b = g * per; b < (g + 1) * per; b++) {
      const uint8_t *codes = w + b * BLOCK_BYTES;
      /* (a prefetch past the end of the weight is harmless: it never faults) */
      _mm_prefetch((const char *)(codes + PREFETCH), _MM_HINT_T0);
      __m256i lo[2], hi[2];
      for (int k = 0; k < 2; k++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(codes + 32 * k));
        lo[k] = _mm256_and_si256(v, nibble);
        hi[k] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
      }
      for (int r = 0; r < R; r++) {
        const int8_t *q = x->xq + r * x->n + b * BLOCK;
        const __m256i lo_x = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)q));
        const __m256i hi_x =
            _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(q + 16)));
        const __m256 s = _mm256_set1_ps(x->xs[r * x->blocks + b]);
        for (int k = 0; k < 2; k++) {
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo[k], lo_x),
                                                 _mm256_maddubs_epi16(hi[k], hi_x));
          const __m256i sums = _mm256_madd_epi16(pairs, ones);
          gacc[r][k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), s, gacc[r][k]);
        }
      }
    }
    const __m256 scales = _mm256_castps128_ps256(widen4(sm + 8 * g));
    const __m256 offsets = _mm256_castps128_ps256(widen4(sm + 8 * g + 4));
    for (int k = 0; k < 2; k++) {
      /* lanes 0-3 row 2k, lanes 4-7 row 2k + 1 */
      const __m256i spread = _mm256_setr_epi32(2 * k, 2 * k, 2 * k, 2 * k, 2 * k + 1, 2 * k + 1,
                                               2 * k + 1, 2 * k + 1);
      const __m256 sv = _mm256_permutevar8x32_ps(scales, spread);
      const __m256 ov = _mm256_permutevar8x32_ps(offsets, spread);
      for (int r = 0; r < R; r++) {
        acc[r][k] = _mm256_fmadd_ps(gacc[r][k], sv, acc[r][k]);
        zacc[r][k] = _mm256_fmadd_ps(ov, _mm256_set1_ps(x->xz[r * x->groups + g]), zacc[r][k]);
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int k = 0; k < 2; k++) {
      dots[4 * r + 2 * k] =
          sum4(_mm256_castps256_ps128(acc[r][k])) + _mm256_cvtss_f32(zacc[r][k]);
      dots[4 * r + 2 * k + 1] = sum4(_mm256_extractf128_ps(acc[r][k], 1)) +
                                _mm_cvtss_f32(_mm256_extractf128_ps(zacc[r][k], 1));
    }
}

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))

/* group_dots with AVX512-VNNI (R <= 4): the four weight rows in one register, four lanes each. */
static inline VNNI __attribute__((always_inline)) void group_dots_vnni(
    const Rows *x, int R, const uint8_t *w, const uint16_t *sm, int64_t group, float *dots) {
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  __m512 acc[4], zacc[4];
  for (int r = 0; r < R; r++) acc[r] = zacc[r] = _mm512_setzero_ps();
  const int64_t per = group / BLOCK;
  for (int64_t g = 0; g < x->groups; g++) {
    __m512 gacc[4];
    for (int r = 0; r < R; r++) gacc[r] = _mm512_setzero_ps();
    for (int64_t b = g * per; b < (g + 1) * per; b++) {
      const uint8_t *codes = w + b * BLOCK_BYTES;
      _mm_prefetch((const char *)(codes + PREFETCH), _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512((const void *)codes);
      const __m512i lo = _mm512_and_si512(v, nibble);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      for (int r = 0; r < R; r++) {
        const int8_t *q = x->xq + r * x->n + b * BLOCK;
        const __m512i lo_x = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)q));
        const __m512i hi_x = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(q + 16)));
        const __m512i low = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, lo_x);
        const __m512i sums = _mm512_dpbusd_epi32(low, hi, hi_x);
        const __m512 s = _mm512_set1_ps(x->xs[r * x->blocks + b]);
        gacc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), s, gacc[r]);
      }
    }
    const __m512 sv = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(widen4(sm + 8 * g)));
    const __m512 ov =
        _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(widen4(sm + 8 * g + 4)));
    for (int r = 0; r < R; r++) {
      acc[r] = _mm512_fmadd_ps(gacc[r], sv, acc[r]);
      zacc[r] = _mm512_fmadd_ps(ov, _mm512_set1_ps(x->xz[r * x->groups + g]), zacc[r]);
    }
  }
  for (int r = 0; r < R; r++) {
    float *d = dots + 4 * r;
    d[0] = sum4(_mm512_castps512_ps128(acc[r])) + _mm512_cvtss_f32(zacc[r]);
    for (int k = 1; k < 4; k++)
      d[k] = sum4(_mm512_extractf32x4_ps(acc[r], k)) +
             _mm_cvtss_f32(_mm512_extractf32x4_ps(zacc[r], k));
  }
}

/* Activation rows through a group of weight rows, each path compiled per row count: two at a
 * time with AVX2 (its 16 registers hold two rows' sums), four with AVX512 (its 32 hold four):
 * the rows of a pass share each load and unpacking of the codes. */
static void dots1(const Rows *x, const uint8_t *w, const uint16_t *sm, int64_t g, float *d) {
  group_dots(x, 1, w, sm, g, d);
}
static void dots2(const Rows *x, const uint8_t *w, const uint16_t *sm, int64_t g, float *d) {
  group_dots(x, 2, w, sm, g, d);
}
static VNNI void dots1_vnni(const Rows *x, const uint8_t *w, const uint16_t *sm, int64_t g,
                            float *d) {
  group_dots_vnni(x, 1, w, sm, g, d);
}
static VNNI void dots2_vnni(const Rows *x, const uint8_t *w, const uint16_t *sm, int64_t g,
                            float *d) {
  group_dots_vnni(x, 2, w, sm, g, d);
}
static VNNI void dots4_vnni(const Rows *x, const uint8_t *w, const uint16_t *sm, int64_t g,
                            float *d) {
  group_dots_vnni(x, 4, w, sm, g, d);
}

/* y (rows, out) = x (rows, n) @ W.T for the int4 weight W of codes w and scales/offsets sm in
 * the order above (ceil(out / 4) groups of rows), on `threads` threads; 0 on success, 1 when
 * the activations' scratch cannot be allocated. n and group are multiples of 32, group divides
 * n. The VNNI dots run where int8_dot.c's do (attnkit_int8_wide). */
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
  typedef void (*Dots)(const Rows *, const uint8_t *, const uint16_t *, int64_t, float *);
  const int wide = attnkit_int8_wide(-1);
  const Dots one = wide ? dots1_vnni : dots1, two = wide ? dots2_vnni : dots2;
  const int most = wide ? 4 : 2;
  (void)threads; /* (unused where built without OpenMP) */
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * out * n >= PARALLEL_MIN)
  for (int64_t rg = 0; rg < row_groups; rg++) {
    const int64_t o = rg * GROUP;
    const uint8_t *codes = w + o * (n / 2);
    const uint16_t *scales = sm + rg * groups * 2 * GROUP;
    float dots[4 * GROUP];
    for (int64_t r = 0; r < rows;) {
      const Rows x = {xq + r * n, xs + r * blocks, xz + r * groups, n, blocks, groups};
      const int R = rows - r >= most ? most : rows - r >= 2 ? 2 : 1;
      (R == 4 ? dots4_vnni : R == 2 ? two : one)(&x, codes, scales, group, dots);
      for (int i = 0; i < R; i++)
        for (int k = 0; k < GROUP && o + k < out; k++) y[(r + i) * out + o + k] = dots[4 * i + k];
      r += R;
    }
  }
  free(xq);
  free(xs);
  return 0;
}
