/* Attention of one query per sequence and head over a key/value cache (a decoding step).
 *
 * The G = H / K query heads that share a key/value head are that head's rows, so every key and
 * value row is read once per step, dotted with the G queries while it sits in L1. Keys the mask
 * leaves out are never read (a static cache's empty slots cost one mask byte each). float32 sums;
 * bf16 inputs are widened on load and the output rounded to nearest even.
 *
 * torch's fused CPU kernel spends most of a call this small on set-up, and a step of a model
 * calls it once a layer.
 *
 * Non-finite inputs follow the textbook math over the keys a query may attend: a NaN score, or
 * a +inf one, makes the row NaN; a -inf score gives that key weight 0. A query with no allowed key
 * gets a zero row.
 *
 * With a cap c > 0 the scores are soft-capped first (Gemma 2), c tanh(x / c), computed as
 * 2c sigmoid(2 x / c) (softmax ignores the shift by c); an infinite score then makes its row NaN.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

#define PARALLEL_MIN (1 << 15) /* key elements (heads x keys x dims) worth a second thread */
#define STACK_FLOATS 8192      /* a head's buffers up to this size live on the stack */

/* Flags returned (or-ed over the heads). */
#define NO_KEY 1     /* some query may attend no key: its row is zero */
#define NON_FINITE 2 /* some output value is NaN or infinite */
#define NO_MEMORY 4  /* a buffer could not be allocated: nothing was written */
#define BAD_INDEX 8  /* a paged key outside its table or the pool: nothing was written */

/* The dots of x (n floats) with four rows (bf16 or float32), as four lanes. */
static inline __m128 dot4(const float *x, const void *r0, const void *r1, const void *r2,
                          const void *r3, int64_t n, int bf16) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 xi = _mm256_loadu_ps(x + i);
    a0 = _mm256_fmadd_ps(load8(r0, i, bf16), xi, a0);
    a1 = _mm256_fmadd_ps(load8(r1, i, bf16), xi, a1);
    a2 = _mm256_fmadd_ps(load8(r2, i, bf16), xi, a2);
    a3 = _mm256_fmadd_ps(load8(r3, i, bf16), xi, a3);
  }
  /* (lanes of a0 a1 | a2 a3 pairwise, then the halves) */
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  __m128 d = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  if (i < n) {
    float tail[4] = {0.f, 0.f, 0.f, 0.f};
    for (; i < n; i++) {
      tail[0] += load1(r0, i, bf16) * x[i];
      tail[1] += load1(r1, i, bf16) * x[i];
      tail[2] += load1(r2, i, bf16) * x[i];
      tail[3] += load1(r3, i, bf16) * x[i];
    }
    d = _mm_add_ps(d, _mm_loadu_ps(tail));
  }
  return d;
}

static inline float dot1(const float *x, const void *w, int64_t n, int bf16) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(load8(w, i, bf16), _mm256_loadu_ps(x + i), acc);
  float sum = lanes_sum(acc);
  for (; i < n; i++) sum += load1(w, i, bf16) * x[i];
  return sum;
}

/* One (sequence, key/value head): G queries q (G, E), keys/values at k/v (S rows `ks`/`vs`
 * elements apart; key s is row rows[s] where rows is given, a block table's slots, else row s),
 * allowed[s] != 0 where a key may be attended (NULL: all, else `ms` apart), into out (G, Ev). */
static inline __attribute__((always_inline)) int one_head(const void *q, int64_t G, int64_t E,
                                                          const void *k, int64_t ks, const void *v,
                                                          int64_t vs, int64_t Ev, int64_t S,
                                                          const int32_t *rows,
                                                          const uint8_t *allowed, int64_t ms,
                                                          float scale, float cap, void *out,
                                                          int bf16) {
  float small[STACK_FLOATS];
  const int64_t need = G * (E + S + Ev) + S;
  float *work = need <= STACK_FLOATS ? small : malloc((size_t)need * sizeof(float));
  if (!work) return NO_MEMORY;
  float *qf = work, *p = qf + G * E, *acc = p + G * S;
  int32_t *kept = (int32_t *)(acc + G * Ev); /* the allowed keys, in order */
  const int64_t size = bf16 ? 2 : 4;
  const char *kb = (const char *)k, *vb = (const char *)v;
  int64_t n = 0;
  for (int64_t s = 0; s < S; s++)
    if (!allowed || allowed[s * ms]) kept[n++] = rows ? rows[s] : (int32_t)s;
  const float factor = cap > 0.f ? scale * 2.f / cap : scale; /* (2 / c: the capped form) */
  for (int64_t i = 0; i < G * E; i++) qf[i] = load1(q, i, bf16) * factor;
  for (int64_t i = 0; i < G * Ev; i++) acc[i] = 0.f;
  int flags = n ? 0 : NO_KEY;
  /* Scores: each key row read once (four at a time), dotted with the G queries. */
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    /* The key rows two steps ahead, and the value rows of these keys for the pass over the
     * values below (into L2): a batch's cache comes from memory after the step's weights
     * streamed past. */
    for (int64_t a = j; a < j + 4; a++) {
      const char *next = kb + kept[a + 8 < n ? a + 8 : n - 1] * ks * size;
      const char *value = vb + kept[a] * vs * size;
      for (int64_t line = 0; line < E * size; line += 64) _mm_prefetch(next + line, _MM_HINT_T0);
      for (int64_t line = 0; line < Ev * size; line += 64) _mm_prefetch(value + line, _MM_HINT_T1);
    }
    const void *r0 = kb + kept[j] * ks * size, *r1 = kb + kept[j + 1] * ks * size;
    const void *r2 = kb + kept[j + 2] * ks * size, *r3 = kb + kept[j + 3] * ks * size;
    for (int64_t g = 0; g < G; g++)
      _mm_storeu_ps(p + g * S + j, dot4(qf + g * E, r0, r1, r2, r3, E, bf16));
  }
  for (; j < n; j++)
    for (int64_t g = 0; g < G; g++) p[g * S + j] = dot1(qf + g * E, kb + kept[j] * ks * size, E, bf16);
  for (int64_t g = 0; g < G && n; g++) {
    /* softmax over the kept keys (a NaN never wins the maximum; it reaches the sum) */
    float *row = p + g * S;
    if (cap > 0.f) {
      const __m256 two_c = _mm256_set1_ps(2.f * cap);
      for (j = 0; j + 8 <= n; j += 8)
        _mm256_storeu_ps(row + j, capped8(_mm256_loadu_ps(row + j), two_c, 0));
      for (; j < n; j++) row[j] = _mm256_cvtss_f32(capped8(_mm256_set1_ps(row[j]), two_c, 0));
    }
    __m256 top8 = _mm256_set1_ps(-INFINITY);
    for (j = 0; j + 8 <= n; j += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(row + j));
    float top = lanes_max(top8);
    for (; j < n; j++) top = row[j] > top ? row[j] : top;
    /* out = p V / sum, 32 outputs at a time held in registers over the keys */
    const float inverse = 1.f / exp_shifted(row, n, top);
    float *o = acc + g * Ev;
    int64_t i = 0;
    for (; i + 32 <= Ev; i += 32) {
      __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0;
      for (j = 0; j < n; j++) {
        const void *r = vb + kept[j] * vs * size;
        const __m256 pj = _mm256_set1_ps(row[j]);
        o0 = _mm256_fmadd_ps(pj, load8(r, i, bf16), o0);
        o1 = _mm256_fmadd_ps(pj, load8(r, i + 8, bf16), o1);
        o2 = _mm256_fmadd_ps(pj, load8(r, i + 16, bf16), o2);
        o3 = _mm256_fmadd_ps(pj, load8(r, i + 24, bf16), o3);
      }
      const __m256 inv = _mm256_set1_ps(inverse);
      _mm256_storeu_ps(o + i, _mm256_mul_ps(o0, inv));
      _mm256_storeu_ps(o + i + 8, _mm256_mul_ps(o1, inv));
      _mm256_storeu_ps(o + i + 16, _mm256_mul_ps(o2, inv));
      _mm256_storeu_ps(o + i + 24, _mm256_mul_ps(o3, inv));
    }
    for (; i + 8 <= Ev; i += 8) {
      __m256 o0 = _mm256_setzero_ps();
      for (j = 0; j < n; j++)
        o0 = _mm256_fmadd_ps(_mm256_set1_ps(row[j]), load8(vb + kept[j] * vs * size, i, bf16), o0);
      _mm256_storeu_ps(o + i, _mm256_mul_ps(o0, _mm256_set1_ps(inverse)));
    }
    for (; i < Ev; i++) {
      float sum_i = 0.f;
      for (j = 0; j < n; j++) sum_i += row[j] * load1(vb + kept[j] * vs * size, i, bf16);
      o[i] = sum_i * inverse;
    }
  }
  for (int64_t i = 0; i < G * Ev; i++) {
    if (!isfinite(acc[i])) flags |= NON_FINITE;
    if (bf16)
      ((uint16_t *)out)[i] = float_to_bf16(acc[i]);
    else
      ((float *)out)[i] = acc[i];
  }
  if (work != small) free(work);
  return flags;
}

/* The same with a constant dtype, so each gets its own loops. */
static int one_head_float(const void *q, int64_t G, int64_t E, const void *k, int64_t ks,
                          const void *v, int64_t vs, int64_t Ev, int64_t S, const int32_t *rows,
                          const uint8_t *allowed, int64_t ms, float scale, float cap, void *out) {
  return one_head(q, G, E, k, ks, v, vs, Ev, S, rows, allowed, ms, scale, cap, out, 0);
}

static int one_head_bf16(const void *q, int64_t G, int64_t E, const void *k, int64_t ks,
                         const void *v, int64_t vs, int64_t Ev, int64_t S, const int32_t *rows,
                         const uint8_t *allowed, int64_t ms, float scale, float cap, void *out) {
  return one_head(q, G, E, k, ks, v, vs, Ev, S, rows, allowed, ms, scale, cap, out, 1);
}

/* One call's heads for run_heads: task = b * K + h. A dense call's sequence b attends S keys
 * (rows NULL) at element offsets b * kb / b * vb under its mask row (or none); a paged call's
 * (paged set, kb = vb = 0, mask NULL) attends count[b] keys, the pool rows at
 * rows + b * width + first[b]. */
struct heads {
  const char *q, *k, *v;
  char *out;
  int64_t K, G, E, Ev, size, kb, kh, ks, vb, vh, vs, S, mb, msk, width;
  const uint8_t *mask;
  const int32_t *rows;
  const int64_t *first, *count;
  float scale, cap;
  int bf16, paged;
};

static inline int one_task(const struct heads *p, int64_t task) {
  const int64_t b = task / p->K, h = task % p->K;
  const int paged = p->paged;
  return (p->bf16 ? one_head_bf16 : one_head_float)(
      p->q + task * p->G * p->E * p->size, p->G, p->E,
      p->k + (b * p->kb + h * p->kh) * p->size, p->ks,
      p->v + (b * p->vb + h * p->vh) * p->size, p->vs, p->Ev, paged ? p->count[b] : p->S,
      paged ? p->rows + b * p->width + p->first[b] : NULL,
      p->mask ? p->mask + b * p->mb : NULL, p->msk, p->scale, p->cap,
      p->out + task * p->G * p->Ev * p->size);
}

/* Runs every task of a call and returns the or of their flags; in a serial loop outside any parallel region unless
 * `parallel`: an OpenMP region, even of one thread, costs more than a small call's work. */
static int run_heads(const struct heads *p, int64_t tasks, int parallel, int threads) {
  int flags = 0;
  (void)threads; /* (unused where built without OpenMP) */
  if (parallel) {
#pragma omp parallel for schedule(static) num_threads(threads) reduction(| : flags)
    for (int64_t task = 0; task < tasks; task++) flags |= one_task(p, task);
  } else {
    for (int64_t task = 0; task < tasks; task++) flags |= one_task(p, task);
  }
  return flags;
}

/* q (B, K, G, E) contiguous; k/v (B, K, S, E/Ev) with rows contiguous and the given element
 * strides for b, h and s; mask (B or 1, S) bytes with strides mb (0: broadcast) and msk, or NULL;
 * out (B, K, G, Ev) contiguous; all bf16 or all float32; cap > 0 soft-caps the scores (0: no
 * cap). Returns the or of the flags above. */
int attnkit_one_query_attention(const void *q, int64_t B, int64_t K, int64_t G, int64_t E,
                                const void *k, int64_t kb, int64_t kh, int64_t ks, const void *v,
                                int64_t vb, int64_t vh, int64_t vs, int64_t Ev, int64_t S,
                                const uint8_t *mask, int64_t mb, int64_t msk, float scale,
                                float cap, void *out, int bf16, int threads) {
  const int64_t size = bf16 ? 2 : 4, tasks = B * K;
  const struct heads p = {.q = q, .k = k, .v = v, .out = out, .K = K, .G = G, .E = E, .Ev = Ev,
                          .size = size, .kb = kb, .kh = kh, .ks = ks, .vb = vb, .vh = vh,
                          .vs = vs, .S = S, .mb = mb, .msk = msk, .mask = mask, .scale = scale,
                          .cap = cap, .bf16 = bf16};
  return run_heads(&p, tasks, tasks > 1 && threads > 1 && tasks * S * E >= PARALLEL_MIN, threads);
}

/* The same over a paged cache: every sequence's keys/values are rows of one pool, k/v (slots, K,
 * E/Ev) with rows `ks`/`vs` and heads `kh`/`vh` elements apart; sequence b attends keys
 * first[b] .. first[b] + count[b] - 1, the slots of its key j at rows[b * width + j] (its block
 * table spelled out), so no key is copied; every such row must be below `slots`. q and out as
 * above. */
int attnkit_paged_one_query_attention(const void *q, int64_t B, int64_t K, int64_t G, int64_t E,
                                      const void *k, int64_t kh, int64_t ks, const void *v,
                                      int64_t vh, int64_t vs, int64_t Ev, const int32_t *rows,
                                      int64_t width, const int64_t *first, const int64_t *count,
                                      int64_t slots, float scale, float cap, void *out, int bf16,
                                      int threads) {
  const int64_t size = bf16 ? 2 : 4, tasks = B * K;
  int64_t keys = 0;
  for (int64_t b = 0; b < B; b++) {
    if (first[b] < 0 || count[b] < 0 || first[b] + count[b] > width) return BAD_INDEX;
    for (int64_t j = first[b]; j < first[b] + count[b]; j++)
      if (rows[b * width + j] < 0 || rows[b * width + j] >= slots) return BAD_INDEX;
    keys += count[b];
  }
  const struct heads p = {.q = q, .k = k, .v = v, .out = out, .K = K, .G = G, .E = E, .Ev = Ev,
                          .size = size, .kh = kh, .ks = ks, .vh = vh, .vs = vs, .width = width,
                          .rows = rows, .first = first, .count = count, .scale = scale,
                          .cap = cap, .bf16 = bf16, .paged = 1};
  return run_heads(&p, tasks, tasks > 1 && threads > 1 && keys * K * E >= PARALLEL_MIN, threads);
}
