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
 * loop prefetches 32 blocks (4 KiB) ahead (far enough to hide the memory's latency at the
 * stream's rate), and OpenMP threads take whole groups: one stream per thread, where the
 * row-major order would read four.
 *
 * Where the CPU has AVX512-VNNI, a group's dots run two rows to a 512-bit register: the two rows'
 * 32 codes of a block lie side by side, one vpdpbusd sums them against the block's activations
 * (held in both halves) into sixteen int32 lanes, half a row's. Each lane holds the same four
 * products as the AVX2 path's, summed and scaled in the same order, so both paths give the same
 * bits; VNNI takes 6 instructions per 64 codes where AVX2 takes 12. Four (VNNI) or two (AVX2)
 * activation rows a pass share each block's codes (a batch's steps, prompts).
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

/* The four dots of one group (its codes grouped as above) with R activation rows (1 or 2; rows
 * n codes and blocks scales apart), into dots[4 r + k]; each row's sums in the same order
 * whatever R. */
static inline __attribute__((always_inline)) void group_dots(const int8_t *xq, const float *xs,
                                                             int64_t blocks, int R,
                                                             const int8_t *w, int64_t n,
                                                             float *dots) {
  __m256 acc[2][GROUP];
  for (int r = 0; r < R; r++)
    for (int k = 0; k < GROUP; k++) acc[r][k] = _mm256_setzero_ps();
  for (int64_t b = 0; b < n / BLOCK; b++) {
    const int8_t *codes = w + b * GROUP * BLOCK;
    /* (a prefetch past the end of the weight is harmless: it never faults) */
    _mm_prefetch((const char *)(codes + PREFETCH), _MM_HINT_T0);
    _mm_prefetch((const char *)(codes + PREFETCH + 64), _MM_HINT_T0);
    for (int r = 0; r < R; r++) {
      const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + r * n + b * BLOCK));
      const __m256 s = _mm256_set1_ps(xs[r * blocks + b]);
      for (int k = 0; k < GROUP; k++) {
        const __m256i c = _mm256_loadu_si256((const __m256i *)(codes + k * BLOCK));
        acc[r][k] = block_dot(c, x, s, acc[r][k]);
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int k = 0; k < GROUP; k++) dots[4 * r + k] = lanes_sum(acc[r][k]);
}

static void dots1(const int8_t *xq, const float *xs, int64_t blocks, const int8_t *w, int64_t n,
                  float *dots) {
  group_dots(xq, xs, blocks, 1, w, n, dots);
}
static void dots2(const int8_t *xq, const float *xs, int64_t blocks, const int8_t *w, int64_t n,
                  float *dots) {
  group_dots(xq, xs, blocks, 2, w, n, dots);
}

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))

/* group_dots with AVX512-VNNI (see the top) for R activation rows (1, 2 or 4; rows n codes and
 * blocks scales apart), into dots[4 r + k]: rows 0-1 of the group in acc[r][0], rows 2-3 in
 * acc[r][1], each row's eight lanes as the AVX2 path's. The codes' magnitudes and signs are taken
 * once for the R rows (shared work a pass of one row would repeat), each row's sums in the same
 * order whatever R. */
static inline VNNI __attribute__((always_inline)) void group_dots_vnni(
    const int8_t *xq, const float *xs, int64_t blocks, int R, const int8_t *w, int64_t n,
    float *dots) {
  __m512 acc[4][2];
  for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t b = 0; b < n / BLOCK; b++) {
    const int8_t *codes = w + b * GROUP * BLOCK;
    /* (into L2 only: L1 keeps the activation codes, read for every group) */
    _mm_prefetch((const char *)(codes + PREFETCH), _MM_HINT_T1);
    _mm_prefetch((const char *)(codes + PREFETCH + 64), _MM_HINT_T1);
    __m512i size[2];
    __mmask64 negative[2];
    for (int k = 0; k < 2; k++) {
      const __m512i c = _mm512_loadu_si512((const void *)(codes + k * 2 * BLOCK));
      /* |w| (unsigned: code -128 is 128) times x with w's sign, four products to a lane */
      size[k] = _mm512_abs_epi8(c);
      negative[k] = _mm512_movepi8_mask(c);
    }
    for (int r = 0; r < R; r++) {
      const __m256i *row = (const __m256i *)(xq + r * n + b * BLOCK);
      const __m512i x = _mm512_broadcast_i64x4(_mm256_loadu_si256(row));
      const __m512 s = _mm512_set1_ps(xs[r * blocks + b]);
      for (int k = 0; k < 2; k++) {
        const __m512i signed_x = _mm512_mask_sub_epi8(x, negative[k], zero, x);
        const __m512i sums = _mm512_dpbusd_epi32(zero, size[k], signed_x);
        acc[r][k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), s, acc[r][k]);
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int k = 0; k < 2; k++) {
      dots[4 * r + 2 * k] = lanes_sum(_mm512_castps512_ps256(acc[r][k]));
      const __m512d halves = _mm512_castps_pd(acc[r][k]);
      dots[4 * r + 2 * k + 1] = lanes_sum(_mm256_castpd_ps(_mm512_extractf64x4_pd(halves, 1)));
    }
}

static VNNI void dots1_vnni(const int8_t *xq, const float *xs, int64_t blocks, const int8_t *w,
                            int64_t n, float *dots) {
  group_dots_vnni(xq, xs, blocks, 1, w, n, dots);
}
static VNNI void dots2_vnni(const int8_t *xq, const float *xs, int64_t blocks, const int8_t *w,
                            int64_t n, float *dots) {
  group_dots_vnni(xq, xs, blocks, 2, w, n, dots);
}
static VNNI void dots4_vnni(const int8_t *xq, const float *xs, int64_t blocks, const int8_t *w,
                            int64_t n, float *dots) {
  group_dots_vnni(xq, xs, blocks, 4, w, n, dots);
}

/* Whether group dots run with AVX512-VNNI: -1 until asked, then 0 or 1 (see attnkit_int8_wide). */
static int vnni = -1;

/* Ask for the VNNI group dots (wanted 1) or the AVX2 ones (0), -1 to leave the choice; returns
 * whether VNNI runs from now on: 1 only where the CPU has AVX512-VNNI and AVX512-BW. By default
 * it does where it can. */
int attnkit_int8_wide(int wanted) {
  if (wanted < 0 && vnni >= 0) return vnni; /* (every product asks: the CPU is probed once) */
  __builtin_cpu_init();
  const int able = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
  vnni = able && wanted != 0;
  return vnni;
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
  const int wide = attnkit_int8_wide(-1);
  const int most = wide ? 4 : 2; /* activation rows a pass */
  (void)threads; /* (unused where built without OpenMP) */
  /* (small products stay on one thread: a parallel region costs more than they do) */
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * out * n >= PARALLEL_MIN)
  for (int64_t g = 0; g < groups; g++) {
    const int64_t o = g * GROUP;
    float dots[4 * GROUP];
    for (int64_t r = 0; r < rows;) {
      const int R = rows - r >= most ? most : rows - r >= 2 ? 2 : 1;
      const int8_t *q = xq + r * n;
      const float *qs = xs + r * blocks;
      if (!wide)
        (R == 2 ? dots2 : dots1)(q, qs, blocks, w + o * n, n, dots);
      else
        (R == 4 ? dots4_vnni : R == 2 ? dots2_vnni : dots1_vnni)(q, qs, blocks, w + o * n, n, dots);
      for (int i = 0; i < R; i++)
        for (int k = 0; k < GROUP; k++) y[(r + i) * out + o + k] = dots[4 * i + k] * scale[o + k];
      r += R;
    }
  }
  for (int64_t o = groups * GROUP; o < out; o++)
    for (int64_t r = 0; r < rows; r++)
      y[r * out + o] = row_dot(xq + r * n, xs + r * blocks, w + o * n, n) * scale[o];
  free(xq);
  free(xs);
  return 0;
}
