/* A bf16 GEMM with float32 sums for the flash kernels' tiles, on the CPU's bf16 pair dot
 * products (one instruction multiplies 16 pairs of bf16 and adds each pair's sum to a float32
 * lane). It has the calling convention of MKL's cblas_gemm_bf16bf16f32 (row-major only), so
 * csrc/flash.c takes either through one function pointer, and the policy times both: MKL's
 * runs its best code only on some vendors' CPUs.
 *
 * C (m x n, float32) = alpha op(A) op(B) + beta C, op(A) m x k and op(B) k x n in bf16. Both
 * operands are first packed into thread-local scratch as k/2 rows of pairs, one 32-bit word
 * each: op(B)'s rows 2p and 2p+1 interleaved column by column, op(A)'s columns 2p and 2p+1
 * likewise (each of its words is broadcast to all lanes), zero-padded to whole register blocks.
 * A block of MR rows and NR columns then keeps its 2 MR accumulators in registers over the
 * whole of k.
 * Called by one thread on its own tiles; threads never share scratch.
 *
 * The caller (attnkit.kernels.attention) only passes this function's address where the CPU has
 * the instructions and attnkit_bf16_gemm_native() says the build has them; compiled for every
 * CPU, the packed product runs on none that lacks them.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
enum { MR = 6, NR = 32 };

/* Compilers that know the bf16 dot product instructions (older ones build only the plain loop,
 * and attnkit_bf16_gemm_native() says so). */
#if (defined(__clang__) && __clang_major__ >= 9) || (!defined(__clang__) && __GNUC__ >= 10)
#define BF16_DOT_BUILT 1
#else
#define BF16_DOT_BUILT 0
#endif

/* op(X)[r][c] of a row-major X with leading dimension ld. */
static inline uint16_t at(const uint16_t *x, int64_t ld, int trans, int64_t r, int64_t c) {
  return trans ? x[c * ld + r] : x[r * ld + c];
}

/* The same product one sum at a time, without scratch (where none can be had, or the compiler
 * lacks the instructions). */
static void unpacked(int ta, int tb, int64_t m, int64_t n, int64_t k, float alpha,
                     const uint16_t *a, int64_t lda, const uint16_t *b, int64_t ldb, float beta,
                     float *c, int64_t ldc) {
  for (int64_t i = 0; i < m; i++)
    for (int64_t j = 0; j < n; j++) {
      float sum = 0.0f;
      for (int64_t x = 0; x < k; x++) {
        uint32_t u = (uint32_t)at(a, lda, ta, i, x) << 16, w = (uint32_t)at(b, ldb, tb, x, j) << 16;
        float fa, fb;
        memcpy(&fa, &u, sizeof fa);
        memcpy(&fb, &w, sizeof fb);
        sum += fa * fb;
      }
      c[i * ldc + j] = alpha * sum + (beta != 0.0f ? beta * c[i * ldc + j] : 0.0f);
    }
}

#if BF16_DOT_BUILT
#define BF16_DOT __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

static __thread uint32_t *scratch;
static __thread size_t scratch_words;

/* At least `words` 32-bit words of this thread's scratch, or NULL. */
static uint32_t *workspace(size_t words) {
  if (words > scratch_words) {
    size_t bytes = (words * sizeof(uint32_t) + 63) / 64 * 64;
    uint32_t *grown = aligned_alloc(64, bytes);
    if (!grown) return NULL;
    free(scratch);
    scratch = grown;
    scratch_words = bytes / sizeof(uint32_t);
  }
  return scratch;
}

/* Packs a k x n operand held as rows of x (leading dimension ld): word (p, j) of `out` (kp rows
 * of np words) holds element (2p, j) in its low half and (2p+1, j) in its high half, zero past
 * k or n. Rows 2p and 2p+1 are interleaved 32 columns at a time. */
BF16_DOT static void interleave(const uint16_t *x, int64_t ld, int64_t k, int64_t n, int64_t kp,
                                int64_t np, uint32_t *out) {
  const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40,
                                       8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  for (int64_t p = 0; p < kp; p++) {
    const uint16_t *r0 = x + 2 * p * ld;
    const uint16_t *r1 = 2 * p + 1 < k ? r0 + ld : NULL;
    uint32_t *dst = out + p * np;
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
      __m512i x0 = _mm512_loadu_si512(r0 + j);
      __m512i x1 = r1 ? _mm512_loadu_si512(r1 + j) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + j, _mm512_permutex2var_epi16(x0, low, x1));
      _mm512_storeu_si512(dst + j + 16, _mm512_permutex2var_epi16(x0, high, x1));
    }
    for (; j < n; j++) dst[j] = r0[j] | (uint32_t)(r1 ? r1[j] : 0) << 16;
    for (; j < np; j++) dst[j] = 0;
  }
}

/* Packs the same k x n operand held as columns of x (element (c, j) at x[j * ld + c]), whose
 * pairs already lie side by side in memory: word (p, j) is gathered, 16 columns at a time. */
BF16_DOT static void transpose_pairs(const uint16_t *x, int64_t ld, int64_t k, int64_t n,
                                     int64_t kp, int64_t np, uint32_t *out) {
  const int64_t whole = k / 2;  // pairs read as one word (an odd last one is read alone)
  const int gathers = ld < (INT64_C(1) << 26);  // (16 columns' offsets fit 32-bit indices)
  const __m512i lanes = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi32(gathers ? (int)ld : 0));
  int64_t j = 0;
  for (; gathers && j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
    const uint16_t *base = x + j * ld;
    for (int64_t p = 0; p < whole; p++) {
      __m512i w = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, lanes, base + 2 * p, 2);
      _mm512_mask_storeu_epi32(out + p * np + j, m, w);
    }
  }
  for (; j < n; j++)
    for (int64_t p = 0; p < whole; p++) memcpy(out + p * np + j, x + j * ld + 2 * p, 4);
  for (int64_t p = whole; p < kp; p++)  // the odd last element of each column
    for (int64_t c = 0; c < n; c++) out[p * np + c] = x[c * ld + k - 1];
  for (int64_t p = 0; p < kp; p++)
    for (int64_t c = n; c < np; c++) out[p * np + c] = 0;
}

/* Copies the m rows of x (k elements each, leading dimension ld) into `mp` rows of `kp` words,
 * where their pairs already lie side by side (zero past k or m). */
static void copy_rows(const uint16_t *x, int64_t ld, int64_t k, int64_t m, int64_t kp,
                      int64_t mp, uint32_t *out) {
  for (int64_t i = 0; i < mp; i++) {
    uint32_t *row = out + i * kp;
    if (kp > 0) row[kp - 1] = 0;  // (the high half of an odd last pair)
    if (i < m)
      memcpy(row, x + i * ld, (size_t)k * sizeof(uint16_t));
    else
      memset(row, 0, (size_t)kp * sizeof(uint32_t));
  }
}

/* Rows [0, rows) and columns [0, cols) of C from one MR x NR block: A's word (r, p) at
 * a[r * si + p * sp], B's NR words of pair row p at b + p * np. */
BF16_DOT static void block(int64_t kp, const uint32_t *a, int64_t si, int64_t sp,
                           const uint32_t *b, int64_t np, float *c, int64_t ldc, int64_t rows,
                           int64_t cols, float alpha, float beta) {
  __m512 acc[MR][2];
  for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kp; p++) {
    __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + p * np);
    __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + p * np + 16);
    const uint32_t *ap = a + p * sp;
    for (int r = 0; r < MR; r++) {
      __m512bh ar = (__m512bh)_mm512_set1_epi32((int)ap[r * si]);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], ar, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], ar, b1);
    }
  }
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
  for (int r = 0; r < MR && r < rows; r++) {
    for (int h = 0; h < 2; h++) {
      int64_t left = cols - 16 * h;
      if (left <= 0) break;
      __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
      float *dst = c + r * ldc + 16 * h;
      __m512 y = _mm512_mul_ps(va, acc[r][h]);
      if (beta != 0.0f) y = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m, dst), y);
      _mm512_mask_storeu_ps(dst, m, y);
    }
  }
}

/* The product through packed scratch: 1, or 0 where the scratch cannot be had. */
BF16_DOT static int packed(int ta, int tb, int64_t m, int64_t n, int64_t k, float alpha,
                           const uint16_t *a, int64_t lda, const uint16_t *b, int64_t ldb,
                           float beta, float *c, int64_t ldc) {
  const int64_t kp = (k + 1) / 2, mp = (m + MR - 1) / MR * MR, np = (n + NR - 1) / NR * NR;
  uint32_t *work = workspace((size_t)(mp * kp + kp * np));
  if (!work) return 0;
  uint32_t *pa = work, *pb = work + mp * kp;
  // op(A): its rows as they are (pairs side by side), or, transposed, interleaved into pair rows
  // (p-major); op(B): pair rows, interleaved from B's rows or gathered from its transposed ones
  const int64_t si = ta ? 1 : kp, sp = ta ? mp : 1;
  if (ta)
    interleave(a, lda, k, m, kp, mp, pa);
  else
    copy_rows(a, lda, k, m, kp, mp, pa);
  if (tb)
    transpose_pairs(b, ldb, k, n, kp, np, pb);
  else
    interleave(b, ldb, k, n, kp, np, pb);
  for (int64_t j = 0; j < n; j += NR)  // (one panel of B stays in cache over every row block)
    for (int64_t i = 0; i < m; i += MR)
      block(kp, pa + i * si, si, sp, pb + j, np, c + i * ldc + j, ldc, m - i, n - j, alpha, beta);
  return 1;
}
#endif

/* Whether the packed product on bf16 dot products was built (else only the plain loop runs). */
int attnkit_bf16_gemm_native(void) { return BF16_DOT_BUILT; }

void attnkit_gemm_bf16(int64_t layout, int64_t transa, int64_t transb, int64_t m, int64_t n,
                       int64_t k, float alpha, const uint16_t *a, int64_t lda, const uint16_t *b,
                       int64_t ldb, float beta, float *c, int64_t ldc) {
  if (layout != ROW_MAJOR || m <= 0 || n <= 0) return;
  const int ta = transa == TRANS, tb = transb == TRANS;
#if BF16_DOT_BUILT
  if (packed(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)) return;
#endif
  unpacked(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
