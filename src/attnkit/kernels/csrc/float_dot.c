/* bf16 and float32 weight x activation products for a few rows (decoding), with AVX2 FMAs, or
 * AVX512 ones where the CPU has them (dots_wide, below).
 *
 * y[r, o] = bias[o] + sum_i x[r, i] * w[o, i], summed in float32, w row-major (out, n).
 *
 * Decoding reads every weight once, so the speed is the weight's read bandwidth. Each OpenMP
 * thread takes a contiguous range of output rows and reads it as one sequential stream, one
 * output row after the other, prefetching 4 KiB ahead (far enough to hide the memory's latency
 * at the stream's rate); the rows of x (a few) are dotted with each weight row while it is in
 * L1, two at a time (row_dot2). The AVX512 dots take up to eight rows of x a pass, so a batch's
 * rows share each weight load. Whether one row runs here or through MKL, and whether a compiled
 * row runs here or through inductor's reduction, is attnkit's policy's choice, measured.
 *
 * bf16 is float32's upper half, so a bf16 value widens by a 16-bit shift; results are rounded
 * back to bf16 to nearest even (a NaN stays a NaN).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define PREFETCH 4096 /* bytes ahead */
#define PARALLEL_MIN (1 << 16) /* products (weights x rows) worth a second thread */

/* One weight row's dot with one float32 activation row (inlined with a constant bf16, so each
 * caller gets its own loop). */
static inline float row_dot(const float *x, const void *w, int64_t n, int bf16) {
  const char *bytes = (const char *)w;
  const int64_t size = bf16 ? 2 : 4;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    /* (a prefetch past the end of the weight is harmless: it never faults) */
    for (int64_t line = 0; line < 32 * size; line += 64)
      _mm_prefetch(bytes + i * size + PREFETCH + line, _MM_HINT_T0);
    a0 = _mm256_fmadd_ps(load8(w, i, bf16), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(load8(w, i + 8, bf16), _mm256_loadu_ps(x + i + 8), a1);
    a2 = _mm256_fmadd_ps(load8(w, i + 16, bf16), _mm256_loadu_ps(x + i + 16), a2);
    a3 = _mm256_fmadd_ps(load8(w, i + 24, bf16), _mm256_loadu_ps(x + i + 24), a3);
  }
  for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(load8(w, i, bf16), _mm256_loadu_ps(x + i), a0);
  float sum = lanes_sum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; i < n; i++) sum += load1(w, i, bf16) * x[i];
  return sum;
}

/* Two activation rows' dots with one weight row: each weight vector is loaded (and widened)
 * once for both, and each row's sums run exactly as row_dot's (the same operations in the same
 * order), so a row's result does not depend on the rows beside it. Rows share the weight's
 * loads and widening, the cost a pass pays beside its sums. */
static inline void row_dot2(const float *x0, const float *x1, const void *w, int64_t n, int bf16,
                            float *s0, float *s1) {
  const char *bytes = (const char *)w;
  const int64_t size = bf16 ? 2 : 4;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int64_t line = 0; line < 32 * size; line += 64)
      _mm_prefetch(bytes + i * size + PREFETCH + line, _MM_HINT_T0);
    const __m256 w0 = load8(w, i, bf16), w1 = load8(w, i + 8, bf16);
    const __m256 w2 = load8(w, i + 16, bf16), w3 = load8(w, i + 24, bf16);
    a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0 + i), a0);
    b0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x1 + i), b0);
    a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x0 + i + 8), a1);
    b1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x1 + i + 8), b1);
    a2 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x0 + i + 16), a2);
    b2 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x1 + i + 16), b2);
    a3 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x0 + i + 24), a3);
    b3 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x1 + i + 24), b3);
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 w0 = load8(w, i, bf16);
    a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0 + i), a0);
    b0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x1 + i), b0);
  }
  float sum0 = lanes_sum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  float sum1 = lanes_sum(_mm256_add_ps(_mm256_add_ps(b0, b1), _mm256_add_ps(b2, b3)));
  for (; i < n; i++) {
    const float v = load1(w, i, bf16);
    sum0 += v * x0[i];
    sum1 += v * x1[i];
  }
  *s0 = sum0;
  *s1 = sum1;
}

#define WIDE __attribute__((target("avx512f,avx512bw,avx512vl")))
#define WIDE_ROWS 8 /* activation rows a pass */

/* Sixteen values from w[i] as float32 (bf16 widened); `mask` picks the lanes read (the rest 0). */
static inline WIDE __attribute__((always_inline)) __m512 load16(const void *w, int64_t i, int bf16,
                                                               __mmask16 mask) {
  if (!bf16) return _mm512_maskz_loadu_ps(mask, (const float *)w + i);
  const __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)w + i);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The dots of R activation rows (R <= WIDE_ROWS, rows n apart) with one weight row, with AVX512
 * FMAs, over the inputs [i0, i1) (i0 a multiple of 32; i1 too unless it is n): each weight vector
 * is loaded (and widened) once for the R rows. Each row sums 32 values a step in two accumulators
 * (16 lanes each), then the last 16 and the last few (masked), in the same order whatever R, so a
 * row's result does not depend on the rows beside it. The accumulators start at zero for i0 = 0,
 * else from `state` (2 R vectors of 16 floats, 64-byte aligned), and go back there unless
 * i1 = n, where their sums go to `sums`: a product split into input ranges sums in the same
 * order as one over all n. With eight
 * rows a pass a step loads 2 weight and 16 activation vectors, where row_dot2's loads 4 and 8 for
 * two rows a pass (8 rows: 48 loads per 32 weights, against 18). The weight is prefetched
 * `ahead` bytes ahead, into L2 only (leaving L1 to the activations, which every weight row
 * meets again). */
static inline WIDE __attribute__((always_inline)) void dots_wide(const float *x, int R,
                                                                 const void *w, int64_t n,
                                                                 int64_t i0, int64_t i1,
                                                                 int64_t ahead, int bf16,
                                                                 float *state, float *sums) {
  const char *bytes = (const char *)w;
  const int64_t size = bf16 ? 2 : 4;
  const __mmask16 all = 0xffff;
  /* (one variable per accumulator, not an array: GCC kept an array in memory) */
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  __m512 b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0, b6 = a0, b7 = a0;
#define EACH(DO) DO(0) DO(1) DO(2) DO(3) DO(4) DO(5) DO(6) DO(7)
#define LOAD(k)                                                                               \
  if (R > k) {                                                                                \
    a##k = _mm512_load_ps(state + 32 * k);                                                    \
    b##k = _mm512_load_ps(state + 32 * k + 16);                                               \
  }
#define SAVE(k)                                                                               \
  if (R > k) {                                                                                \
    _mm512_store_ps(state + 32 * k, a##k);                                                    \
    _mm512_store_ps(state + 32 * k + 16, b##k);                                               \
  }
#define FMA(acc, k, w, at, mask)                                                              \
  acc = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(mask, x + (k) * n + (at)), acc)
#define STEP(k)                                                                               \
  if (R > k) {                                                                                \
    FMA(a##k, k, w0, i, all);                                                                 \
    FMA(b##k, k, w1, i + 16, all);                                                            \
  }
#define LAST(k)                                                                               \
  if (R > k) FMA(a##k, k, w0, i, mask);
  if (i0 > 0) {
    EACH(LOAD)
  }
  int64_t i = i0;
  for (; i + 32 <= i1; i += 32) {
    for (int64_t line = 0; line < 32 * size; line += 64)
      _mm_prefetch(bytes + i * size + ahead + line, _MM_HINT_T1);
    const __m512 w0 = load16(w, i, bf16, all), w1 = load16(w, i + 16, bf16, all);
    EACH(STEP)
  }
  if (i1 < n) {
    EACH(SAVE)
    return;
  }
  for (; i < n; i += 16) {
    const __mmask16 mask = n - i >= 16 ? all : (__mmask16)((1u << (n - i)) - 1);
    const __m512 w0 = load16(w, i, bf16, mask);
    EACH(LAST)
  }
#undef EACH
#undef LOAD
#undef SAVE
#undef FMA
#undef STEP
#undef LAST
  const __m512 sum[WIDE_ROWS] = {_mm512_add_ps(a0, b0), _mm512_add_ps(a1, b1),
                                 _mm512_add_ps(a2, b2), _mm512_add_ps(a3, b3),
                                 _mm512_add_ps(a4, b4), _mm512_add_ps(a5, b5),
                                 _mm512_add_ps(a6, b6), _mm512_add_ps(a7, b7)};
  for (int r = 0; r < R; r++) sums[r] = _mm512_reduce_add_ps(sum[r]);
}

/* dots_wide for each R (constant in each copy, so its loops over rows unroll). */
#define DOTS_WIDE(R)                                                                          \
  static WIDE void dots_wide##R(const float *x, const void *w, int64_t n, int64_t i0,        \
                                int64_t i1, int64_t ahead, int bf16, float *state,           \
                                float *sums) {                                               \
    dots_wide(x, R, w, n, i0, i1, ahead, bf16, state, sums);                                 \
  }
DOTS_WIDE(1)
DOTS_WIDE(2)
DOTS_WIDE(3)
DOTS_WIDE(4)
DOTS_WIDE(5)
DOTS_WIDE(6)
DOTS_WIDE(7)
DOTS_WIDE(8)
typedef void (*dots_fn)(const float *, const void *, int64_t, int64_t, int64_t, int64_t, int,
                        float *, float *);
static const dots_fn DOTS[WIDE_ROWS + 1] = {NULL,        dots_wide1, dots_wide2,
                                            dots_wide3,  dots_wide4, dots_wide5,
                                            dots_wide6,  dots_wide7, dots_wide8};

/* Activation bytes (R rows of n floats) up to which dots_wide runs over all n inputs at once;
 * more would not stay in L1 (48 KiB here) while the weight streams past, so the inputs go in
 * CHUNKs, each over BLOCK output rows while the chunk stays in L1: a wide product of several
 * rows reads its weight faster so than with its activations spilling to L2, and small chunks
 * would pay the partial sums' stores more often than they save. */
#define L1_ROWS_BYTES (40 << 10)
#define CHUNK 512
#define BLOCK 8

/* Whether the products run dots_wide: -1 until asked, then 0 or 1 (see attnkit_float_wide). */
static int wide = -1;

/* Ask for the AVX512 dots (wanted 1) or the AVX2 ones (0), -1 to leave the choice; returns
 * whether the AVX512 ones run from now on: 1 only where the CPU has AVX512F, BW and VL. By
 * default they do where they can. The two sum in different orders (results differ in the last
 * bits): one process keeps one choice. */
int attnkit_float_wide(int wanted) {
  if (wanted < 0 && wide >= 0) return wide; /* (every product asks: the CPU is probed once) */
  __builtin_cpu_init();
  const int able = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl");
  wide = able && wanted != 0;
  return wide;
}

/* y[at] = v + bias[o] (bias may be NULL), bf16 (rounded to nearest even) or float32. */
static inline void store(void *y, int64_t at, float v, const void *bias, int64_t o, int bf16) {
  if (bf16) {
    const float b = bias ? bf16_to_float(((const uint16_t *)bias)[o]) : 0.f;
    ((uint16_t *)y)[at] = float_to_bf16(v + b);
  } else {
    ((float *)y)[at] = v + (bias ? ((const float *)bias)[o] : 0.f);
  }
}

/* y (rows, out) = x (rows, n) @ w.T + bias, x float32, w, bias and y bf16 or all float32, with
 * the dots of dots_wide or of row_dot2 / row_dot. */
static void products(const float *x, int64_t rows, int64_t n, const void *w, const void *bias,
                     int64_t out, void *y, int bf16, int threads) {
  const int64_t size = bf16 ? 2 : 4;
  (void)threads; /* (unused where built without OpenMP) */
  if (!attnkit_float_wide(-1)) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * out * n >= PARALLEL_MIN)
    for (int64_t o = 0; o < out; o++) {
      const char *row = (const char *)w + o * n * size;
      int64_t r = 0;
      for (; r + 2 <= rows; r += 2) {
        float s0, s1;
        row_dot2(x + r * n, x + (r + 1) * n, row, n, bf16, &s0, &s1);
        store(y, r * out + o, s0, bias, o, bf16);
        store(y, (r + 1) * out + o, s1, bias, o, bf16);
      }
      if (r < rows) store(y, r * out + o, row_dot(x + r * n, row, n, bf16), bias, o, bf16);
    }
    return;
  }
  const int64_t blocks = (out + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * out * n >= PARALLEL_MIN)
  for (int64_t blk = 0; blk < blocks; blk++) {
    const int64_t o0 = blk * BLOCK, o1 = o0 + BLOCK < out ? o0 + BLOCK : out;
    float state[BLOCK][32 * WIDE_ROWS] __attribute__((aligned(64)));
    float sums[WIDE_ROWS];
    for (int64_t r = 0; r < rows; r += WIDE_ROWS) {
      const int R = rows - r >= WIDE_ROWS ? WIDE_ROWS : (int)(rows - r);
      /* all inputs at once, prefetching along the row; or a chunk over the block's rows,
       * prefetching the row two ahead */
      const int whole = R * n * (int64_t)sizeof(float) <= L1_ROWS_BYTES;
      const int64_t step = whole ? n : CHUNK, ahead = whole ? PREFETCH : 2 * n * size;
      int64_t i0 = 0, i1;
      do { /* (once at least: n = 0 stores the bias) */
        i1 = n - i0 > step ? i0 + step : n;
        for (int64_t o = o0; o < o1; o++) {
          DOTS[R](x + r * n, (const char *)w + o * n * size, n, i0, i1, ahead, bf16,
                  state[o - o0], sums);
          if (i1 == n)
            for (int k = 0; k < R; k++) store(y, (r + k) * out + o, sums[k], bias, o, bf16);
        }
        i0 = i1;
      } while (i1 < n);
    }
  }
}

/* y (rows, out) = x (rows, n) @ w.T + bias, all bf16 (bias may be NULL), on `threads` threads;
 * 0 on success, 1 when the float32 copy of x cannot be allocated. */
int attnkit_bf16_linear(const uint16_t *x, int64_t rows, int64_t n, const uint16_t *w,
                        const uint16_t *bias, int64_t out, uint16_t *y, int threads) {
  float *xf = malloc((size_t)(rows * n) * sizeof(float) + 1); /* (+1: never malloc(0)) */
  if (!xf) return 1;
  for (int64_t i = 0; i < rows * n; i++) xf[i] = bf16_to_float(x[i]);
  products(xf, rows, n, w, bias, out, y, 1, threads);
  free(xf);
  return 0;
}

/* The same with float32 x, w, bias and y. */
int attnkit_float_linear(const float *x, int64_t rows, int64_t n, const float *w,
                         const float *bias, int64_t out, float *y, int threads) {
  products(x, rows, n, w, bias, out, y, 0, threads);
  return 0;
}
