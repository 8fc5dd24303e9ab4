/* Attention in FlashAttention's loop on the CPU, forward (plain or soft-capped scores) and
 * backward, with tiles of scores from the BLAS sgemm torch links.
 *
 * Forward: each thread takes a block of queries of one head and walks the blocks of keys they
 * may attend; the tile of scores comes from sgemm, stays in L2, and is folded into a running
 * maximum and sum per query (the online softmax) before sgemm multiplies it with the block's
 * values into the output, which is divided by the sums at the end. A tile is only as wide as
 * the block's reach: under causal masking a block of 64 queries computes the keys up to its
 * last query, not a whole block of keys, so a causal sequence costs about L^2 / 2 scores.
 *
 * Backward (FlashAttention-2's order): each thread takes one key/value head and the query
 * heads that share it; for each block of keys (outer) and each block of queries that reaches
 * it (inner), the scores are recomputed, turned into probabilities with the forward's
 * log-sum-exp, and five products give the block's key and value gradients (accumulated over the
 * query blocks while they sit in cache, written once) and the query gradients (accumulated over
 * the key blocks).
 *
 * Positions: query i sits at key position first + i; `causal` keeps the keys at or before it,
 * `window` (when > 0) the keys less than `window` away (attnkit.masks.Structure's rules). A query
 * with no key gets a zero row (and log-sum-exp -inf, and zero gradients).
 *
 * Soft cap (cap > 0, forward only): the scores are c tanh(s / c), computed as 2c sigmoid(2 s / c)
 * (softmax ignores the shift by c); see capped_softmax.c.
 *
 * ALiBi (slopes not NULL, no cap): query head h's scaled score of key j at query position p gets
 * slopes[h] * (j - p) added, computed in the tile over the keys the query reaches, before its
 * maximum is taken (forward) or its probabilities recomputed (backward); the bias needs no
 * gradient, so the backward's products are unchanged.
 *
 * dtypes: float32, or bf16. A bf16 forward given MKL's cblas_gemm_bf16bf16f32 multiplies bf16
 * tiles with float32 sums (CPUs with bf16 dot products or matrix tiles run them at bf16's speed):
 * the scores come out float32, the online softmax stays float32, and the probabilities are
 * rounded to bf16 for the product with the values, as FlashAttention does on GPUs. Otherwise (the
 * backward, or no such function) bf16 inputs are widened block by block into float32 for sgemm
 * (for CPUs without bf16 units: the products run at float32's speed on half the bytes). Sums and
 * gradients are float32 either way.
 *
 * Layouts: tensors are (count, heads, rows, dim) with any element strides for the first three
 * dims and a contiguous last dim; query head h of item c reads key/value head h / group of item
 * c. Non-finite inputs: a NaN score makes its row NaN; without `finite` so does an infinite one
 * when capped. Plain scores are assumed finite (attnkit.functional keeps non-finite inputs away).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "simd.h"

/* Fortran BLAS sgemm, column-major. Its integer arguments are passed as pointers to int64: an
 * LP64 library reads their low halves (little-endian), an ILP64 one all of them. */
typedef void (*sgemm_fn)(const char *transa, const char *transb, const int64_t *m,
                         const int64_t *n, const int64_t *k, const float *alpha, const float *a,
                         const int64_t *lda, const float *b, const int64_t *ldb, const float *beta,
                         float *c, const int64_t *ldc);

/* MKL's cblas_gemm_bf16bf16f32: C (float32) = alpha op(A) op(B) + beta C for bf16 A and B.
 * Its layout and transpose arguments are CBLAS enums (ints), its sizes MKL_INT: passed as int64
 * in registers or 8-byte stack slots, an LP64 library reads their low halves (little-endian), an
 * ILP64 one all of them. */
typedef void (*gemm_bf16_fn)(int64_t layout, int64_t transa, int64_t transb, int64_t m,
                             int64_t n, int64_t k, float alpha, const uint16_t *a, int64_t lda,
                             const uint16_t *b, int64_t ldb, float beta, float *c, int64_t ldc);
enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

/* A (count, heads, rows, dim) tensor: its data and the element strides of the first three
 * dims. */
typedef struct {
  char *data;
  int64_t item, head, row;
} view;

/* Head h of item c of `t`, whose elements are `size` bytes. */
static inline char *at(view t, int64_t c, int64_t h, int64_t size) {
  return t.data + (c * t.item + h * t.head) * size;
}

/* rows x dim values, rows `stride` elements apart, as float32 for sgemm: the values themselves
 * when they are float32 (*ld = stride), else bf16 widened into `buf` (*ld = dim). */
static inline const float *as_float(const char *src, int64_t rows, int64_t dim, int64_t stride,
                                    int bf16, float *buf, int64_t *ld) {
  if (!bf16) {
    *ld = stride;
    return (const float *)src;
  }
  const uint16_t *h = (const uint16_t *)src;
  for (int64_t i = 0; i < rows; i++) {
    int64_t j = 0;
    for (; j + 8 <= dim; j += 8) _mm256_storeu_ps(buf + i * dim + j, load8(h + i * stride, j, 1));
    for (; j < dim; j++) buf[i * dim + j] = bf16_to_float(h[i * stride + j]);
  }
  *ld = dim > 0 ? dim : 1;
  return buf;
}

/* row[x] += slope * (d0 + x) for n values: ALiBi's bias of keys d0, d0 + 1, ... positions from
 * the query (offsets as floats are exact below 2^24). */
static inline void add_offsets(float *row, int64_t n, float slope, int64_t d0) {
  const __m256 s = _mm256_set1_ps(slope), eight = _mm256_set1_ps(8.f);
  __m256 d = _mm256_add_ps(_mm256_set1_ps((float)d0), _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7));
  int64_t x = 0;
  for (; x + 8 <= n; x += 8) {
    _mm256_storeu_ps(row + x, _mm256_fmadd_ps(s, d, _mm256_loadu_ps(row + x)));
    d = _mm256_add_ps(d, eight);
  }
  for (; x < n; x++) row[x] += slope * (float)(d0 + x);
}

static inline int threads_for(int64_t tasks, int threads) {
  return tasks < threads ? (tasks > 0 ? (int)tasks : 1) : threads;
}

static inline int this_thread(void) {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

/* The largest of n values (a NaN may or may not win it; it reaches the sum either way). */
static inline float row_max(const float *row, int64_t n) {
  /* (four running maxima: one would wait on each max's latency) */
  __m256 top = _mm256_set1_ps(-INFINITY), t1 = top, t2 = top, t3 = top;
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    top = _mm256_max_ps(top, _mm256_loadu_ps(row + j));
    t1 = _mm256_max_ps(t1, _mm256_loadu_ps(row + j + 8));
    t2 = _mm256_max_ps(t2, _mm256_loadu_ps(row + j + 16));
    t3 = _mm256_max_ps(t3, _mm256_loadu_ps(row + j + 24));
  }
  top = _mm256_max_ps(_mm256_max_ps(top, t1), _mm256_max_ps(t2, t3));
  for (; j + 8 <= n; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(row + j));
  float m = lanes_max(top);
  for (; j < n; j++) m = row[j] > m ? row[j] : m;
  return m;
}

/* Sixteen float32 values (a, then b) rounded to nearest even bf16, in order. (A NaN may become
 * an infinity: the row's sum carries it to the output all the same.) */
static inline __m256i round16(__m256 a, __m256 b) {
  const __m256i half = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
  const __m256i x = _mm256_castps_si256(a), y = _mm256_castps_si256(b);
  const __m256i rx = _mm256_add_epi32(half, _mm256_and_si256(_mm256_srli_epi32(x, 16), one));
  const __m256i ry = _mm256_add_epi32(half, _mm256_and_si256(_mm256_srli_epi32(y, 16), one));
  const __m256i hx = _mm256_srli_epi32(_mm256_add_epi32(x, rx), 16);
  const __m256i hy = _mm256_srli_epi32(_mm256_add_epi32(y, ry), 16);
  /* (packus interleaves the 128-bit lanes: a0-3 b0-3 a4-7 b4-7, put back in order) */
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(hx, hy), 0xD8);
}

/* dst[j] = src[j] rounded to nearest even bf16, for n values. */
static inline void round_row(const float *src, uint16_t *dst, int64_t n) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    _mm256_storeu_si256((__m256i *)(dst + j),
                        round16(_mm256_loadu_ps(src + j), _mm256_loadu_ps(src + j + 8)));
  for (; j < n; j++) dst[j] = float_to_bf16(src[j]);
}

/* exp_bf16's elements from j on, one at a time: added to sum, which is returned. */
static inline float exp_bf16_tail(const float *src, uint16_t *dst, int64_t j, int64_t n,
                                  float shift, float sum) {
  for (; j < n; j++) {
    const float e = exp1(src[j] - shift);
    dst[j] = float_to_bf16(e);
    sum += e;
  }
  return sum;
}

/* dst[j] = exp(src[j] - shift) rounded to bf16 for n values; returns the sum of the float32
 * exponentials (exp_shifted's, without writing them back). */
static inline float exp_bf16(const float *src, uint16_t *dst, int64_t n, float shift) {
  const __m256 by = _mm256_set1_ps(shift);
  __m256 total = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m256 e0 = exp8(_mm256_sub_ps(_mm256_loadu_ps(src + j), by));
    const __m256 e1 = exp8(_mm256_sub_ps(_mm256_loadu_ps(src + j + 8), by));
    _mm256_storeu_si256((__m256i *)(dst + j), round16(e0, e1));
    total = _mm256_add_ps(total, _mm256_add_ps(e0, e1));
  }
  return exp_bf16_tail(src, dst, j, n, shift, lanes_sum(total));
}

#define WIDE __attribute__((target("avx512f")))

/* exp8's polynomial (simd.h's EXP_REDUCED) for sixteen x <= 0 (or NaN, which stays NaN): the
 * power of two applied by scalef, so that no clamp above is needed; below -87.3 (where exp8
 * gives 0) the result is exp(-87.3), near float32's smallest normal. */
WIDE static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.3f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_scalef_ps(EXP_REDUCED(_mm512, __m512, x, n), n);
}

/* exp_bf16 with 512-bit vectors (where the CPU has them; src[j] <= shift, as exp_bf16's
 * callers give them). */
WIDE static float exp_bf16_wide(const float *src, uint16_t *dst, int64_t n, float shift) {
  const __m512 by = _mm512_set1_ps(shift);
  const __m512i half = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
  __m512 total = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(src + j), by));
    const __m512i x = _mm512_castps_si512(e);
    const __m512i up = _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(x, 16), one));
    const __m512i h = _mm512_srli_epi32(_mm512_add_epi32(x, up), 16);
    _mm256_storeu_si256((__m256i *)(dst + j), _mm512_cvtepi32_epi16(h));
    total = _mm512_add_ps(total, e);
  }
  return exp_bf16_tail(src, dst, j, n, shift, _mm512_reduce_add_ps(total));
}

typedef float (*exp_bf16_fn)(const float *src, uint16_t *dst, int64_t n, float shift);

/* One block of r queries (positions p0 ..) of one head: out (r x Ev, rows out_row apart) and,
 * if lse is not NULL, each query's log-sum-exp of its scaled scores. Keys and values are float32
 * rows ldk/ldv apart; queries and output float32, or bf16 (`bf16`: the queries widened into qf,
 * the output rounded to nearest even). With `gb` (bf16 only) the keys and values are the bf16
 * rows themselves, the queries are not widened, and both products run through gb, the
 * probabilities rounded into pb by expb. A nonzero `slope` adds ALiBi's bias to the scores. */
static void forward_block(sgemm_fn sgemm, gemm_bf16_fn gb, exp_bf16_fn expb, uint16_t *pb,
                          const char *q, int64_t q_row, const float *k, int64_t ldk,
                          const float *v, int64_t ldv, char *out, int64_t out_row, float *lse,
                          int64_t r, int64_t S, int64_t E, int64_t Ev, int64_t p0,
                          int causal, int64_t window, float scale, float cap, int finite,
                          float slope, int64_t kb, int bf16, float *tile, float *acc, float *top,
                          float *sum, float *qf) {
  int64_t lo, hi, a, b, ldq;
  reach(p0, causal, window, 0, S, &lo, &b);         /* the first query's reach starts the span */
  reach(p0 + r - 1, causal, window, 0, S, &a, &hi); /* the last one's ends it */
  memset(acc, 0, (size_t)(r * Ev) * sizeof(float));
  for (int64_t i = 0; i < r; i++) {
    top[i] = -INFINITY;
    sum[i] = 0.f;
  }
  const float zero = 0.f, one = 1.f, alpha = cap > 0.f ? 2.f * scale / cap : scale;
  const float *qs = gb ? NULL : as_float(q, r, E, q_row, bf16, qf, &ldq);
  for (int64_t j0 = lo; j0 < hi; j0 += kb) {
    const int64_t j1 = j0 + kb < hi ? j0 + kb : hi, w = j1 - j0;
    /* tile (r x w, row-major) = alpha q k^T: column-major w x r = k (w x E) q^T */
    if (gb)
      gb(ROW_MAJOR, NO_TRANS, TRANS, r, w, E, alpha, (const uint16_t *)q, q_row,
         (const uint16_t *)k + j0 * ldk, ldk, zero, tile, w);
    else
      sgemm("T", "N", &w, &r, &E, &alpha, k + j0 * ldk, &ldk, qs, &ldq, &zero, tile, &w);
    for (int64_t i = 0; i < r; i++) {
      float *row = tile + i * w;
      uint16_t *prow = pb + i * w; /* (gb: the row's bf16 probabilities) */
      reach(p0 + i, causal, window, j0, j1, &a, &b);
      if (b <= a) {
        memset(gb ? (void *)prow : (void *)row, 0, (size_t)w * (gb ? 2 : sizeof(float)));
        continue;
      }
      if (gb) {
        memset(prow, 0, (size_t)(a - j0) * 2);
        memset(prow + (b - j0), 0, (size_t)(j1 - b) * 2);
      } else {
        memset(row, 0, (size_t)(a - j0) * sizeof(float));
        memset(row + (b - j0), 0, (size_t)(j1 - b) * sizeof(float));
      }
      if (slope != 0.f) add_offsets(row + (a - j0), b - a, slope, a - (p0 + i));
      const float m = cap > 0.f ? capped_row(row + (a - j0), b - a, cap, finite)
                                : row_max(row + (a - j0), b - a);
      if (m > top[i]) { /* a new maximum: rescale what was summed under the old one */
        if (top[i] > -INFINITY) {
          const float f = exp1(top[i] - m);
          float *o = acc + i * Ev;
          sum[i] *= f;
          for (int64_t c = 0; c < Ev; c++) o[c] *= f;
        }
        top[i] = m;
      }
      if (gb)
        sum[i] += expb(row + (a - j0), prow + (a - j0), b - a, top[i]);
      else
        sum[i] += exp_shifted(row + (a - j0), b - a, top[i]);
    }
    /* acc (r x Ev, row-major) += tile v: column-major Ev x r = v^T (Ev x w) tile^T (w x r) */
    if (gb) {
      gb(ROW_MAJOR, NO_TRANS, NO_TRANS, r, Ev, w, one, pb, w, (const uint16_t *)v + j0 * ldv,
         ldv, one, acc, Ev);
    } else {
      sgemm("N", "N", &Ev, &r, &w, &one, v + j0 * ldv, &ldv, tile, &w, &one, acc, &Ev);
    }
  }
  for (int64_t i = 0; i < r; i++) {
    /* (the maximum's term is 1, so a row with keys sums to at least 1, or NaN) */
    const float inverse = sum[i] > 0.f ? 1.f / sum[i] : (sum[i] == 0.f ? 0.f : sum[i]);
    for (int64_t c = 0; c < Ev; c++) {
      const float x = acc[i * Ev + c] * inverse;
      if (bf16)
        ((uint16_t *)out)[i * out_row + c] = float_to_bf16(x);
      else
        ((float *)out)[i * out_row + c] = x;
    }
    if (lse) lse[i] = sum[i] > 0.f ? top[i] + logf(sum[i]) : (sum[i] == 0.f ? -INFINITY : sum[i]);
  }
}

/* bf16 keys/values [lo, hi) of a head widened into kc/vc (its rows at their positions), where
 * the thread's copy of [*clo, *chi) of the same head does not hold them yet: consecutive tasks
 * of a thread mostly share a head and their reach, so a key is widened about once per thread. */
static void widen_span(const char *k, int64_t k_row, const char *v, int64_t v_row, int64_t E,
                       int64_t Ev, int64_t lo, int64_t hi, float *kc, float *vc, int64_t *clo,
                       int64_t *chi) {
  int64_t ld;
  if (hi <= lo) return;
  if (hi < *clo || lo > *chi || *chi <= *clo) { /* disjoint (or nothing yet): start again */
    *clo = *chi = lo;
  }
  if (lo < *clo) {
    as_float(k + lo * k_row * 2, *clo - lo, E, k_row, 1, kc + lo * E, &ld);
    as_float(v + lo * v_row * 2, *clo - lo, Ev, v_row, 1, vc + lo * Ev, &ld);
    *clo = lo;
  }
  if (hi > *chi) {
    as_float(k + *chi * k_row * 2, hi - *chi, E, k_row, 1, kc + *chi * E, &ld);
    as_float(v + *chi * v_row * 2, hi - *chi, Ev, v_row, 1, vc + *chi * Ev, &ld);
    *chi = hi;
  }
}

/* dims: count, H, K, L, S, E, Ev. q, k, v, out as views, all float32 or all bf16 (`bf16`);
 * lse (count, H, L) float32 with strides lse_item, lse_head (rows contiguous), or NULL.
 * slopes: ALiBi's slope of each query head (H floats), or NULL.
 * gemm_bf16: cblas_gemm_bf16bf16f32 for a bf16 call's products, or NULL (widened for sgemm).
 * Returns 0, or 1 where a buffer could not be allocated (nothing written). */
int attnkit_flash_forward(view q, view k, view v, view out, float *lse, int64_t lse_item,
                          int64_t lse_head, const int64_t *dims, int64_t first, int causal,
                          int64_t window, float scale, float cap, int finite,
                          const float *slopes, int64_t qb, int64_t kb, int bf16, void *sgemm,
                          void *gemm_bf16, int threads) {
  const int64_t count = dims[0], H = dims[1], K = dims[2], L = dims[3], S = dims[4];
  const int64_t E = dims[5], Ev = dims[6], G = H / K, size = bf16 ? 2 : 4;
  const gemm_bf16_fn gb = bf16 ? (gemm_bf16_fn)gemm_bf16 : NULL;
  const int widen = bf16 && !gb;
  const exp_bf16_fn expb = __builtin_cpu_supports("avx512f") ? exp_bf16_wide : exp_bf16;
  const int64_t blocks = (L + qb - 1) / qb, tasks = count * H * blocks;
  threads = threads_for(tasks, threads);
  /* floats a thread works in: tile, sums, maxima; then either the widened bf16 copies of a
   * query block and of a head's keys and values, or the bf16 probabilities of a tile */
  const int64_t extra = widen ? qb * E + S * (E + Ev) : gb ? (qb * kb + 1) / 2 : 0;
  const int64_t each = qb * kb + qb * Ev + 2 * qb + extra;
  float *work = malloc((size_t)(threads * each) * sizeof(float));
  if (!work) return 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    float *mine = work + this_thread() * each;
    float *acc = mine + qb * kb, *top = acc + qb * Ev, *sum = top + qb, *qf = sum + qb;
    float *kc = qf + qb * E, *vc = kc + S * E;
    int64_t widened = -1, clo = 0, chi = 0; /* the head (item * K + kv) kc/vc hold, and where */
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; t++) {
      /* the last blocks (the most keys under causal masking) first, so that the threads end
       * together */
      const int64_t n = t / blocks, c = n / H, h = n % H, i0 = (blocks - 1 - t % blocks) * qb;
      const int64_t r = i0 + qb < L ? qb : L - i0;
      const char *kh = at(k, c, h / G, size), *vh = at(v, c, h / G, size);
      const float *ks = (const float *)kh, *vs = (const float *)vh;
      int64_t ldk = k.row, ldv = v.row;
      if (widen) {
        int64_t lo, hi, a, b;
        reach(first + i0, causal, window, 0, S, &lo, &b);
        reach(first + i0 + r - 1, causal, window, 0, S, &a, &hi);
        if (widened != c * K + h / G) {
          widened = c * K + h / G;
          clo = chi = 0;
        }
        widen_span(kh, k.row, vh, v.row, E, Ev, lo, hi, kc, vc, &clo, &chi);
        ks = kc, vs = vc, ldk = E > 0 ? E : 1, ldv = Ev > 0 ? Ev : 1;
      }
      forward_block((sgemm_fn)sgemm, gb, expb, (uint16_t *)qf,
                    at(q, c, h, size) + i0 * q.row * size, q.row, ks, ldk, vs, ldv,
                    at(out, c, h, size) + i0 * out.row * size, out.row,
                    lse ? lse + c * lse_item + h * lse_head + i0 : NULL, r, S, E, Ev, first + i0,
                    causal, window, scale, cap, finite, slopes ? slopes[h] : 0.f, kb, bf16, mine,
                    acc, top, sum, qf);
    }
  }
  free(work);
  return 0;
}

static void zero_rows(float *t, int64_t rows, int64_t dim, int64_t stride) {
  for (int64_t i = 0; i < rows; i++) memset(t + i * stride, 0, (size_t)dim * sizeof(float));
}

/* The gradients of one key/value head (kv) of item c and its G query heads: inputs float32 or
 * bf16 (`bf16`, widened block by block into qf, kf, vf, df), gradients float32. With `gb` (bf16
 * only) nothing is widened: the five products take the bf16 inputs themselves, and the
 * probabilities and score gradients rounded to bf16 (pb, dsb), with float32 sums. slopes: ALiBi's
 * slope of each query head, or NULL. */
static void backward_head(sgemm_fn sgemm, gemm_bf16_fn gb, uint16_t *pb, uint16_t *dsb, view q,
                          view k, view v, view out, view dout,
                          const float *lse, int64_t lse_item, int64_t lse_head, view dq, view dk,
                          view dv, int64_t c, int64_t kv, int64_t G, int64_t L, int64_t S,
                          int64_t E, int64_t Ev, int64_t first, int causal, int64_t window,
                          float scale, const float *slopes, int64_t qb, int64_t kb, int bf16,
                          int accumulate,
                          float *p, float *dp, float *D, float *qf, float *kf, float *vf,
                          float *df, float *dkb, float *dvb) {
  const float one = 1.f, zero = 0.f;
  const int64_t size = bf16 ? 2 : 4, ldkb = E > 0 ? E : 1, ldvb = Ev > 0 ? Ev : 1;
  float *dkh = (float *)at(dk, c, kv, 4), *dvh = (float *)at(dv, c, kv, 4);
  for (int64_t g = 0; g < G; g++) {
    const int64_t h = kv * G + g;
    const char *o = at(out, c, h, size), *d = at(dout, c, h, size);
    if (!accumulate) zero_rows((float *)at(dq, c, h, 4), L, E, dq.row);
    for (int64_t i = 0; i < L; i++) { /* D_i = sum(dO_i * O_i) */
      float s = 0.f;
      for (int64_t e = 0; e < Ev; e++)
        s += load1(d, i * dout.row + e, bf16) * load1(o, i * out.row + e, bf16);
      D[g * L + i] = s;
    }
  }
  for (int64_t j0 = 0; j0 < S; j0 += kb) {
    const int64_t j1 = j0 + kb < S ? j0 + kb : S;
    int64_t ldk = k.row, ldv = v.row, ldq = q.row, ldd = dout.row;
    const char *kh = at(k, c, kv, size) + j0 * k.row * size;
    const char *vh = at(v, c, kv, size) + j0 * v.row * size;
    const float *ks = gb ? NULL : as_float(kh, j1 - j0, E, k.row, bf16, kf, &ldk);
    const float *vs = gb ? NULL : as_float(vh, j1 - j0, Ev, v.row, bf16, vf, &ldv);
    /* the block's key/value gradients start from zero here and reach dk/dv once, after every
     * query block: small partial sums, one rounding against the running total */
    memset(dkb, 0, (size_t)((j1 - j0) * E) * sizeof(float));
    memset(dvb, 0, (size_t)((j1 - j0) * Ev) * sizeof(float));
    for (int64_t g = 0; g < G; g++) {
      const int64_t h = kv * G + g;
      const float *lh = lse + c * lse_item + h * lse_head;
      const float slope = slopes ? slopes[h] : 0.f;
      float *dqh = (float *)at(dq, c, h, 4);
      for (int64_t i0 = 0; i0 < L; i0 += qb) {
        const int64_t r = i0 + qb < L ? qb : L - i0, p0 = first + i0;
        int64_t lo, hi, a, b;
        reach(p0, causal, window, j0, j1, &lo, &b);
        reach(p0 + r - 1, causal, window, j0, j1, &a, &hi);
        if (hi <= lo) continue; /* the block reaches none of these keys */
        const int64_t w = hi - lo;
        const char *qh = at(q, c, h, size) + i0 * q.row * size;
        const char *dh = at(dout, c, h, size) + i0 * dout.row * size;
        const uint16_t *kbl = (const uint16_t *)kh + (lo - j0) * k.row;
        const uint16_t *vbl = (const uint16_t *)vh + (lo - j0) * v.row;
        const float *kl = gb ? NULL : ks + (lo - j0) * ldk, *vl = gb ? NULL : vs + (lo - j0) * ldv;
        const float *qs = gb ? NULL : as_float(qh, r, E, q.row, bf16, qf, &ldq);
        const float *ds = gb ? NULL : as_float(dh, r, Ev, dout.row, bf16, df, &ldd);
        /* p (r x w) = scale q k^T, then exp(. - lse) over each query's reach;
         * dp (r x w) = dO v^T */
        if (gb) {
          gb(ROW_MAJOR, NO_TRANS, TRANS, r, w, E, scale, (const uint16_t *)qh, q.row, kbl, k.row,
             zero, p, w);
          gb(ROW_MAJOR, NO_TRANS, TRANS, r, w, Ev, one, (const uint16_t *)dh, dout.row, vbl,
             v.row, zero, dp, w);
        } else {
          sgemm("T", "N", &w, &r, &E, &scale, kl, &ldk, qs, &ldq, &zero, p, &w);
          sgemm("T", "N", &w, &r, &Ev, &one, vl, &ldv, ds, &ldd, &zero, dp, &w);
        }
        for (int64_t i = 0; i < r; i++) {
          float *pi = p + i * w, *dpi = dp + i * w;
          reach(p0 + i, causal, window, lo, hi, &a, &b);
          if (b <= a || lh[i0 + i] == -INFINITY) {
            memset(pi, 0, (size_t)w * sizeof(float));
            memset(dpi, 0, (size_t)w * sizeof(float));
            continue;
          }
          memset(pi, 0, (size_t)(a - lo) * sizeof(float));
          memset(pi + (b - lo), 0, (size_t)(hi - b) * sizeof(float));
          if (slope != 0.f) add_offsets(pi + (a - lo), b - a, slope, a - (p0 + i));
          exp_shifted(pi + (a - lo), b - a, lh[i0 + i]);
          /* ds = p (dp - D_i), in dp's place (zero where p is) */
          const float di = D[g * L + i0 + i];
          const __m256 d8 = _mm256_set1_ps(di);
          int64_t j = 0;
          for (; j + 8 <= w; j += 8) {
            const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(dpi + j), d8);
            _mm256_storeu_ps(dpi + j, _mm256_mul_ps(_mm256_loadu_ps(pi + j), x));
          }
          for (; j < w; j++) dpi[j] = pi[j] * (dpi[j] - di);
        }
        if (gb) {
          round_row(p, pb, r * w);
          round_row(dp, dsb, r * w);
          /* dv (w x Ev) += p^T dO; dk (w x E) += scale ds^T q; dq (r x E) += scale ds k */
          gb(ROW_MAJOR, TRANS, NO_TRANS, w, Ev, r, one, pb, w, (const uint16_t *)dh, dout.row,
             one, dvb + (lo - j0) * Ev, ldvb);
          gb(ROW_MAJOR, TRANS, NO_TRANS, w, E, r, scale, dsb, w, (const uint16_t *)qh, q.row, one,
             dkb + (lo - j0) * E, ldkb);
          gb(ROW_MAJOR, NO_TRANS, NO_TRANS, r, E, w, scale, dsb, w, kbl, k.row, one,
             dqh + i0 * dq.row, dq.row);
          continue;
        }
        /* dv (w x Ev) += p^T dO: column-major Ev x w = dO^T (Ev x r) p (r x w) */
        sgemm("N", "T", &Ev, &w, &r, &one, ds, &ldd, p, &w, &one, dvb + (lo - j0) * Ev, &ldvb);
        /* dk (w x E) += scale ds^T q */
        sgemm("N", "T", &E, &w, &r, &scale, qs, &ldq, dp, &w, &one, dkb + (lo - j0) * E, &ldkb);
        /* dq (r x E) += scale ds k: column-major E x r = k^T (E x w) ds^T (w x r) */
        sgemm("N", "N", &E, &r, &w, &scale, kl, &ldk, dp, &w, &one, dqh + i0 * dq.row, &dq.row);
      }
    }
    for (int64_t j = j0; j < j1; j++) {
      float *kr = dkh + j * dk.row, *vr = dvh + j * dv.row;
      const float *kg = dkb + (j - j0) * E, *vg = dvb + (j - j0) * Ev;
      for (int64_t e = 0; e < E; e++) kr[e] = accumulate ? kr[e] + kg[e] : kg[e];
      for (int64_t e = 0; e < Ev; e++) vr[e] = accumulate ? vr[e] + vg[e] : vg[e];
    }
  }
}

/* dims and slopes as attnkit_flash_forward's; inputs (q, k, v, out, dout) all float32 or all bf16;
 * lse as the forward wrote it (the log-sum-exp of the scaled scores), or any merged one (ring
 * attention's blocks). Writes dq, dk, dv (float32, every row of every head), or with
 * `accumulate` adds to them. Returns 0, or 1 where a buffer could not be allocated (nothing
 * written). */
int attnkit_flash_backward(view q, view k, view v, view out, view dout, const float *lse,
                           int64_t lse_item, int64_t lse_head, view dq, view dk, view dv,
                           const int64_t *dims, int64_t first, int causal, int64_t window,
                           float scale, const float *slopes, int64_t qb, int64_t kb, int bf16,
                           int accumulate, void *sgemm, void *gemm_bf16, int threads) {
  const int64_t count = dims[0], H = dims[1], K = dims[2], L = dims[3], S = dims[4];
  const int64_t E = dims[5], Ev = dims[6], G = H / K, tasks = count * K;
  const gemm_bf16_fn gb = bf16 ? (gemm_bf16_fn)gemm_bf16 : NULL;
  threads = threads_for(tasks, threads);
  /* floats a thread works in: p, dp, D, a key block's gradients; then bf16's float32 copies of
   * q, dO, k, v blocks, or with gb the bf16 p and ds (two halves of a float each) */
  const int64_t copies = gb ? qb * kb : (bf16 ? (qb + kb) * (E + Ev) : 0);
  const int64_t each = 2 * qb * kb + G * L + kb * (E + Ev) + copies;
  float *work = malloc((size_t)(threads * each) * sizeof(float));
  if (!work) return 1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (int64_t t = 0; t < tasks; t++) {
    float *mine = work + this_thread() * each;
    float *dp = mine + qb * kb, *D = dp + qb * kb, *dkb = D + G * L, *dvb = dkb + kb * E;
    float *qf = dvb + kb * Ev, *df = qf + qb * E, *kf = df + qb * Ev, *vf = kf + kb * E;
    uint16_t *pb = (uint16_t *)(dvb + kb * Ev), *dsb = pb + qb * kb;
    backward_head((sgemm_fn)sgemm, gb, pb, dsb, q, k, v, out, dout, lse, lse_item, lse_head, dq,
                  dk, dv, t / K, t % K, G, L, S, E, Ev, first, causal, window, scale, slopes, qb,
                  kb, bf16, accumulate, mine, dp, D, qf, kf, vf, df, dkb, dvb);
  }
  free(work);
  return 0;
}
