/* Small AVX2 helpers shared by attnkit's kernels (included, static inline: each kernel file
 * gets its own copy to inline). */
#ifndef ATTNKIT_SIMD_H
#define ATTNKIT_SIMD_H

#include <immintrin.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float lanes_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

static inline float lanes_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* Cephes' expf polynomial: exp(x - n ln 2) for a vector x already clamped and n = round(x /
 * ln 2), ln 2 split in two so that the reduced argument stays exact; the caller multiplies by
 * 2^n. V is the intrinsics' prefix (_mm256, _mm512) and T its vector type, so that every width
 * rounds the same steps alike (a GCC/Clang statement expression). */
#define EXP_REDUCED(V, T, x, n)                                                     \
  ({                                                                                \
    T r_ = V##_fnmadd_ps((n), V##_set1_ps(0.693359375f), (x));                     \
    r_ = V##_fnmadd_ps((n), V##_set1_ps(-2.12194440e-4f), r_);                      \
    T p_ = V##_set1_ps(1.9875691500e-4f);                                           \
    p_ = V##_fmadd_ps(p_, r_, V##_set1_ps(1.3981999507e-3f));                       \
    p_ = V##_fmadd_ps(p_, r_, V##_set1_ps(8.3334519073e-3f));                       \
    p_ = V##_fmadd_ps(p_, r_, V##_set1_ps(4.1665795894e-2f));                       \
    p_ = V##_fmadd_ps(p_, r_, V##_set1_ps(1.6666665459e-1f));                       \
    p_ = V##_fmadd_ps(p_, r_, V##_set1_ps(5.0000001201e-1f));                       \
    V##_fmadd_ps(V##_mul_ps(p_, r_), r_, V##_add_ps(r_, V##_set1_ps(1.0f)));        \
  })

/* exp for eight floats: EXP_REDUCED times 2^n (about 1 ulp). NaN stays NaN (min/max return
 * their second operand when one is NaN); exp(88) is the largest result and anything below
 * exp(-87.3) (near float32's smallest normal) is 0. */
static inline __m256 exp8(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ); /* (false for NaN) */
  x = _mm256_min_ps(_mm256_set1_ps(88.0f), x);
  x = _mm256_max_ps(_mm256_set1_ps(-87.3f), x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 p = EXP_REDUCED(_mm256, __m256, x, n);
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* The same for one float, through the vector code (so every element rounds alike). */
static inline float exp1(float x) { return _mm256_cvtss_f32(exp8(_mm256_set1_ps(x))); }

static inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

static inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* quiet NaN */
  return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* Eight values from w[i] as float32: bf16 widened, or float32 loaded. */
static inline __m256 load8(const void *w, int64_t i, int bf16) {
  if (!bf16) return _mm256_loadu_ps((const float *)w + i);
  const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float load1(const void *w, int64_t i, int bf16) {
  return bf16 ? bf16_to_float(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

/* row[j] = exp(row[j] - shift) in place for n values; returns their sum. */
static inline float exp_shifted(float *row, int64_t n, float shift) {
  const __m256 by = _mm256_set1_ps(shift);
  __m256 total = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), by));
    _mm256_storeu_ps(row + j, e);
    total = _mm256_add_ps(total, e);
  }
  float sum = lanes_sum(total);
  for (; j < n; j++) {
    row[j] = exp1(row[j] - shift);
    sum += row[j];
  }
  return sum;
}

/* 2c sigmoid(t) for eight t (t + 0 t t first unless finite). */
static inline __m256 capped8(__m256 t, __m256 two_c, int finite) {
  if (!finite) t = _mm256_fmadd_ps(_mm256_mul_ps(t, t), _mm256_setzero_ps(), t);
  /* 2c / d with d = 1 + exp(-t) in [1, inf]: the reciprocal estimate (12 bits) and one Newton
   * step (about 2 ulp) cost a third of a division. */
  const __m256 d = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), t)));
  const __m256 y = _mm256_rcp_ps(d);
  const __m256 y1 = _mm256_mul_ps(y, _mm256_fnmadd_ps(d, y, _mm256_set1_ps(2.0f)));
  return _mm256_mul_ps(two_c, y1);
}

/* The keys [a, b) that the query at position `at` may attend within [lo, hi). */
static inline void reach(int64_t at, int causal, int64_t window, int64_t lo, int64_t hi,
                         int64_t *a, int64_t *b) {
  *a = lo;
  *b = hi;
  if (causal && at + 1 < *b) *b = at + 1;
  if (window > 0) {
    if (at - window + 1 > *a) *a = at - window + 1;
    if (at + window < *b) *b = at + window;
  }
}

/* row[j] = 2c sigmoid(row[j]) for n values, in place; returns their maximum (a NaN may or may
 * not win it; it reaches the sum of the exponentials either way, and with it the whole row). */
static inline float capped_row(float *row, int64_t n, float cap, int finite) {
  const __m256 two_c = _mm256_set1_ps(2.f * cap);
  __m256 top = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 c = capped8(_mm256_loadu_ps(row + j), two_c, finite);
    _mm256_storeu_ps(row + j, c);
    top = _mm256_max_ps(top, c);
  }
  float m = lanes_max(top);
  for (; j < n; j++) {
    const float c = _mm256_cvtss_f32(capped8(_mm256_set1_ps(row[j]), two_c, finite));
    row[j] = c;
    m = c > m ? c : m;
  }
  return m;
}

/* Each block of 32 activations as int8 codes xq and a scale xs (its largest magnitude / 127).
 * A block holding a NaN or an infinity gets a NaN scale, so its row's products are NaN, as a
 * float product's would be non-finite. (x / top * 127, not x * (127 / top): a subnormal top
 * would make 127 / top infinite.) Eight lanes at a time, each code rounded to nearest even as
 * lrintf rounds it. */
static inline void quantize_blocks(const float *x, int64_t n, int8_t *xq, float *xs) {
  const __m256 no_sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < n / 32; b++) {
    const float *p = x + b * 32;
    __m256 v[4], top = _mm256_setzero_ps();
    __m256 finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (int i = 0; i < 4; i++) {
      v[i] = _mm256_loadu_ps(p + 8 * i);
      const __m256 a = _mm256_and_ps(v[i], no_sign);
      /* (false for NaN too) */
      finite = _mm256_and_ps(finite, _mm256_cmp_ps(a, _mm256_set1_ps(FLT_MAX), _CMP_LE_OQ));
      top = _mm256_max_ps(top, _mm256_and_ps(a, finite)); /* (a NaN lane counts as 0) */
    }
    const float high = lanes_max(top);
    const int ok = _mm256_movemask_ps(finite) == 0xff;
    xs[b] = ok ? high / 127.f : NAN;
    __m256i q[4];
    for (int i = 0; i < 4; i++) {
      const __m256 scaled =
          _mm256_mul_ps(_mm256_div_ps(v[i], _mm256_set1_ps(high)), _mm256_set1_ps(127.f));
      q[i] = ok && high > 0.f ? _mm256_cvtps_epi32(scaled) : _mm256_setzero_si256();
    }
    /* int32 -> int16 -> int8 (no code saturates: |code| <= 127), lanes back in order */
    const __m256i q16a = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xd8);
    const __m256i q16b = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xd8);
    const __m256i q8 = _mm256_permute4x64_epi64(_mm256_packs_epi16(q16a, q16b), 0xd8);
    _mm256_storeu_si256((__m256i *)(xq + b * 32), q8);
  }
}

#endif
