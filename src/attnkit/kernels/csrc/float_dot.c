/* bf16 and float32 weight x activation products for a few rows (decoding), with AVX2 FMAs, or
 * AVX512 ones where the CPU has them (dots_wide, below).
 *
 * y[r, o] = bias[o] + sum_i x[r, i] * w[o, i], summed in float32, w row-major (out, n).
 *
 * Decoding reads every weight once, so the speed of one row is the weight's read bandwidth; a few
 * rows (a verified proposal, a server's batch) also spend arithmetic on each weight read. The AVX2
 * products take the weight in tiles of TILE_OUT output rows (contiguous in memory) and the
 * activations TILE_ROWS rows a pass: a pass keeps TILE_OUT x TILE_ROWS sums in registers, so each
 * weight vector load serves TILE_ROWS FMAs and each activation load TILE_OUT. A single row takes
 * ROW_TILE_OUT output rows a tile instead, for more independent sums in flight. Each OpenMP thread
 * takes a contiguous range of tiles, one sequential stream; each pass over a tile prefetches the
 * next tile, so the memory reads one tile ahead while the arithmetic of the passes runs.
 * Whether rows run here or through MKL, and whether a compiled row runs here or through
 * inductor's reduction, is attnkit's policy's choice, measured.
 *
 * bf16 is float32's upper half, so a bf16 value widens by a 16-bit shift; results are rounded
 * back to bf16 to nearest even (a NaN stays a NaN).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define PREFETCH 4096 /* bytes ahead (AVX512 dots) */
#define PARALLEL_MIN (1 << 16) /* products (weights x rows) worth a second thread */
#define TILE_OUT 3 /* output rows of an AVX2 tile */
#define TILE_ROWS 4 /* activation rows of an AVX2 pass (TILE_OUT x TILE_ROWS sums in registers) */
#define ROW_TILE_OUT 8 /* output rows of an AVX2 tile when there is one activation row */

/* y[at] = v + bias[o] (bias may be NULL), bf16 (rounded to nearest even) or float32. */
static inline void store(void *y, int64_t at, float v, const void *bias, int64_t o, int bf16) {
  if (bf16) {
    const float b = bias ? bf16_to_float(((const uint16_t *)bias)[o]) : 0.f;
    ((uint16_t *)y)[at] = float_to_bf16(v + b);
  } else {
    ((float *)y)[at] = v + (bias ? ((const float *)bias)[o] : 0.f);
  }
}

/* The sums of O weight rows (n apart) with R activation rows (n apart) into y (rows `out`
 * apart), O <= TILE_OUT and R <= TILE_ROWS (or O <= ROW_TILE_OUT and R = 1), with AVX2 FMAs,
 * prefetching `ahead` bytes past each weight row as it goes. Each sum (o, r) has one
 * accumulator of 8 lanes stepping through the inputs 8 at a time, then its lanes' sum, then the
 * last n % 8 inputs one by one: the same operations in the same order whatever O, R and the
 * rows beside it, so a row's result does not depend on the batch it came in. Inlined with
 * constant O, R and bf16 (see TILE below), so the loops over them unroll and the sums stay in
 * registers. */
static inline __attribute__((always_inline)) void tile_dots(const float *x, int R, const char *w,
                                                            int64_t n, int O, int bf16,
                                                            int64_t ahead, const void *bias,
                                                            int64_t o0, int64_t out, void *y) {
  const int64_t size = bf16 ? 2 : 4;
  __m256 acc[ROW_TILE_OUT][TILE_ROWS];
  for (int o = 0; o < O; o++)
    for (int r = 0; r < R; r++) acc[o][r] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    if (i % 16 == 0) /* (a line of float32 weights; past the end never faults) */
      for (int o = 0; o < O; o++) _mm_prefetch(w + (o * n + i) * size + ahead, _MM_HINT_T0);
    __m256 wv[ROW_TILE_OUT];
    for (int o = 0; o < O; o++) wv[o] = load8(w + o * n * size, i, bf16);
    for (int r = 0; r < R; r++) {
      const __m256 xv = _mm256_loadu_ps(x + r * n + i);
      for (int o = 0; o < O; o++) acc[o][r] = _mm256_fmadd_ps(wv[o], xv, acc[o][r]);
    }
  }
  for (int o = 0; o < O; o++)
    for (int r = 0; r < R; r++) {
      float sum = lanes_sum(acc[o][r]);
      for (int64_t j = i; j < n; j++) sum += load1(w + o * n * size, j, bf16) * x[r * n + j];
      store(y, r * out + o0 + o, sum, bias, o0 + o, bf16);
    }
}

/* tile_dots for each O, R and weight type (constant in each copy). */
typedef void (*tile_fn)(const float *, const char *, int64_t, int64_t, const void *, int64_t,
                        int64_t, void *);
#define TILE(O, R, B, NAME)                                                                   \
  static void NAME(const float *x, const char *w, int64_t n, int64_t ahead, const void *bias,  \
                   int64_t o0, int64_t out, void *y) {                                         \
    tile_dots(x, R, w, n, O, B, ahead, bias, o0, out, y);                                      \
  }
#define TILES_OF(B, P)                                                                        \
  TILE(1, 1, B, P##1_1) TILE(1, 2, B, P##1_2) TILE(1, 3, B, P##1_3) TILE(1, 4, B, P##1_4)      \
  TILE(2, 1, B, P##2_1) TILE(2, 2, B, P##2_2) TILE(2, 3, B, P##2_3) TILE(2, 4, B, P##2_4)      \
  TILE(3, 1, B, P##3_1) TILE(3, 2, B, P##3_2) TILE(3, 3, B, P##3_3) TILE(3, 4, B, P##3_4)      \
  TILE(4, 1, B, P##4_1) TILE(5, 1, B, P##5_1) TILE(6, 1, B, P##6_1) TILE(7, 1, B, P##7_1)      \
  TILE(8, 1, B, P##8_1)                                                                       \
  static const tile_fn P[ROW_TILE_OUT + 1][TILE_ROWS + 1] = {                                 \
      {NULL},                                                                                 \
      {NULL, P##1_1, P##1_2, P##1_3, P##1_4},                                                 \
      {NULL, P##2_1, P##2_2, P##2_3, P##2_4},                                                 \
      {NULL, P##3_1, P##3_2, P##3_3, P##3_4},                                                 \
      {NULL, P##4_1}, {NULL, P##5_1}, {NULL, P##6_1}, {NULL, P##7_1}, {NULL, P##8_1}};
TILES_OF(0, float_tiles)
TILES_OF(1, bf16_tiles)

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
 * order as one over all n. With eight rows a pass a step loads 2 weight and 16 activation
 * vectors for 16 FMAs. The weight is prefetched
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

/* y (rows, out) = x (rows, n) @ w.T + bias, x float32, w, bias and y bf16 or all float32, with
 * the dots of dots_wide or of tile_dots. */
static void products(const float *x, int64_t rows, int64_t n, const void *w, const void *bias,
                     int64_t out, void *y, int bf16, int threads) {
  const int64_t size = bf16 ? 2 : 4;
  (void)threads; /* (unused where built without OpenMP) */
  if (!attnkit_float_wide(-1)) {
    const tile_fn(*tiles)[TILE_ROWS + 1] = bf16 ? bf16_tiles : float_tiles;
    const int64_t width = rows == 1 ? ROW_TILE_OUT : TILE_OUT;
    const int64_t count = (out + width - 1) / width;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * out * n >= PARALLEL_MIN)
    for (int64_t t = 0; t < count; t++) {
      const int64_t o0 = t * width;
      const int O = out - o0 >= width ? (int)width : (int)(out - o0);
      const char *tile = (const char *)w + o0 * n * size;
      for (int64_t r = 0; r < rows; r += TILE_ROWS) {
        const int R = rows - r >= TILE_ROWS ? TILE_ROWS : (int)(rows - r);
        /* every pass prefetches the next tile: a line already on its way costs little, and a
         * prefetch the memory system dropped in one pass is asked for again in the next */
        char *y_rows = (char *)y + r * out * size; /* (y's values are as wide as w's) */
        tiles[O][R](x + r * n, tile, n, width * n * size, bias, o0, out, y_rows);
      }
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
