/* A decoding step of a whole decoder stack in one call: every layer of a pre-norm stack with
 * RMSNorms (plain, or Gemma's scaling by 1 + weight, with its norms of the attention's and the
 * feed-forward's outputs), one fused query/key/value projection, optional RMSNorms of the query
 * and key heads, rotary positions, grouped-query attention over a key/value cache (optionally
 * windowed and soft-capped) and a gated feed-forward (SwiGLU or tanh-GeGLU), for a few new
 * tokens.
 *
 * Called from Python, each layer is a dozen small calls (a norm, four products, a rotation,
 * the cache's copies, the attention, the activation, two residual adds), and on a small model
 * their overhead outweighs the arithmetic. Here the same kernels run back to back: the products
 * of float_dot.c, int8_dot.c, int4_dot.c or block_dot.c (each layer's own), rms_norm and rotate
 * of rows.c, the attention of one_query.c. The new tokens are one sequence's over a dense cache
 * (each attends the cached keys and the new ones up to its own, a mask row per token), or one
 * token each of several sequences over a paged pool (a serving engine's decoding step, each
 * token over its own block table). A token's result does not depend on how many came with it,
 * since every kernel computes a row alone.
 *
 * Nothing outside the scratch, the residual stream x and the new tokens' cache slots is
 * written, so a caller can redo a step another way (which writes the same slots).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

/* (the kernels of the other files) */
int attnkit_float_linear(const float *x, int64_t rows, int64_t n, const float *w,
                         const float *bias, int64_t out, float *y, int threads);
int attnkit_bf16_linear(const uint16_t *x, int64_t rows, int64_t n, const uint16_t *w,
                        const uint16_t *bias, int64_t out, uint16_t *y, int threads);
int attnkit_int8_linear(const float *x, int64_t rows, int64_t n, const int8_t *w,
                        const float *scale, int64_t out, float *y, int threads);
int attnkit_int4_linear(const float *x, int64_t rows, int64_t n, const uint8_t *w,
                        const uint16_t *sm, int64_t out, int64_t group, float *y, int threads);
int attnkit_block_linear(const float *x, int64_t rows, int64_t n, const uint8_t *w,
                         const uint16_t *d, const uint16_t *m, int64_t out, int bits,
                         int64_t group, float *y, int threads, int tile);
int attnkit_block_linear_rounded(const float *x, int64_t rows, int64_t n, const uint8_t *w,
                                 const uint16_t *d, const uint16_t *m, int64_t out, int bits,
                                 int64_t group, float *y, int threads, int tile);
int attnkit_rms_norm(const void *x, int64_t rows, int64_t dim, int64_t x_stride,
                     const void *weight, void *out, float eps, int bf16, int threads);
int attnkit_rms_norm_plus_one(const void *x, int64_t rows, int64_t dim, int64_t x_stride,
                              const void *weight, void *out, float eps, int bf16, int threads);
int attnkit_rotate(const void *x, int64_t count, int64_t heads, int64_t length, int64_t dim,
                   int64_t item_stride, int64_t head_stride, int64_t row_stride,
                   const float *cos, const float *signed_sin, int64_t table_item, void *out,
                   int interleaved, int bf16, int threads);
int attnkit_one_query_attention(const void *q, int64_t B, int64_t K, int64_t G, int64_t E,
                                const void *k, int64_t kb, int64_t kh, int64_t ks, const void *v,
                                int64_t vb, int64_t vh, int64_t vs, int64_t Ev, int64_t S,
                                const uint8_t *mask, int64_t mb, int64_t msk, float scale,
                                float cap, void *out, int bf16, int threads);
int attnkit_paged_one_query_attention(const void *q, int64_t B, int64_t K, int64_t G, int64_t E,
                                      const void *k, int64_t kh, int64_t ks, const void *v,
                                      int64_t vh, int64_t vs, int64_t Ev, const int32_t *rows,
                                      int64_t width, const int64_t *first, const int64_t *count,
                                      int64_t slots, float scale, float cap, void *out, int bf16,
                                      int threads);

/* How a product's weight is stored (attnkit.fused names them). */
enum { FLOAT = 0, INT8 = 1, INT4 = 2, BLOCK = 3, BLOCK_ROUNDED = 4 };

/* Results: 0, or why the step stopped (it wrote nothing a caller keeps). */
#define STEP_NO_MEMORY 1 /* a scratch buffer could not be allocated */
#define STEP_REDO 2      /* the attention met a non-finite score: the general path's rules apply */

/* One product y = x @ W.T + bias: float32 activations and results; the weight as `kind` says
 * (float32 rows; int8 codes and row scales; int4 codes and scales/offsets; block codes, scales
 * and offsets of `bits` bits); bias float32 or NULL. */
typedef struct {
  int64_t kind, n, out, group, bits, tile;
  const void *w, *scales, *offsets;
  const float *bias;
} step_linear;

/* One layer: its norms' weights and epsilons, its attention's sliding window (keys within
 * `window` positions of the query, 0: all) and soft cap (0: none), the RMSNorms of its query
 * and key heads before the rotation (weights of head_dim values; NULL: none), the norms of the
 * attention's and the feed-forward's outputs before their residual adds (Gemma's; NULL: none),
 * whether it rotates by the local tables (Gemma 3's sliding layers), and its four products. */
typedef struct {
  const void *norm1, *norm2;
  float eps1, eps2;
  int64_t window;
  float cap, q_eps;
  const void *q_norm, *k_norm;
  float k_eps, post_eps1;
  const void *post1, *post2;
  float post_eps2;
  int64_t local;
  step_linear qkv, out, gate_up, down;
} step_layer;

/* Where the new tokens' keys and values go and which keys each attends.
 *
 * A dense cache: each layer's storage (batch, kv_heads, capacity, head_dim), sequences `batch`
 * elements apart. Either the rows are one sequence's tokens at slots length .. length + rows - 1
 * (batched 0), or each row is one token of its own sequence, all at slot `length` (batched 1).
 * A token attends the slots up to its own, where padding (NULL: everywhere) holds a nonzero
 * byte for its sequence (padding_row apart) and the slot (padding_key apart).
 *
 * A paged pool (slots set): each layer's storage (capacity slots, kv_heads, head_dim), token t at
 * slot slots[t], attending the slots keys[t * width + first[t]] .. keys[t * width + first[t] +
 * count[t] - 1] (its block table spelled out, its own slot last). */
typedef struct {
  float *const *storage; /* 2 * count: each layer's keys and values */
  int64_t head, row;     /* element strides of a key/value head and of a slot */
  int64_t length, capacity;
  const int64_t *slots;
  const int32_t *keys;
  int64_t width;
  const int64_t *first, *count;
  int64_t batched, batch;
  const uint8_t *padding;
  int64_t padding_row, padding_key;
} step_cache;

/* The stack's sizes: model dim, query and key/value heads, head dim, the feed-forward's hidden
 * size, the attention's scale, whether rotary pairs are adjacent channels, whether the
 * activations, norms, float weights and caches are bf16 (else float32), whether its RMSNorms
 * scale by 1 + weight (Gemma's), and the gate's activation (GATE_SILU or GATE_GELU_TANH). */
typedef struct {
  int64_t dim, heads, kv_heads, head_dim, hidden;
  float scale;
  int64_t interleaved, bf16, plus_one, gate;
} step_shape;

enum { GATE_SILU = 0, GATE_GELU_TANH = 1 };

/* RMSNorm of rows x into out with the stack's kind of scale. */
static void norm(const step_shape *shape, const void *x, int64_t rows, int64_t dim,
                 int64_t stride, const void *w, void *out, float eps, int threads) {
  (shape->plus_one ? attnkit_rms_norm_plus_one : attnkit_rms_norm)(x, rows, dim, stride, w, out,
                                                                   eps, (int)shape->bf16, threads);
}

/* y = x @ W.T + bias for float32 rows x through a weight of any kind (float32 results). */
static int float_product(const step_linear *p, const float *x, int64_t rows, float *y,
                         int threads) {
  int failed = 0;
  switch (p->kind) {
    case FLOAT: /* (the kernel adds the bias) */
      return attnkit_float_linear(x, rows, p->n, p->w, p->bias, p->out, y, threads);
    case INT8:
      failed = attnkit_int8_linear(x, rows, p->n, p->w, p->scales, p->out, y, threads);
      break;
    case INT4:
      failed = attnkit_int4_linear(x, rows, p->n, p->w, p->scales, p->out, p->group, y, threads);
      break;
    default:
      failed = (p->kind == BLOCK ? attnkit_block_linear : attnkit_block_linear_rounded)(
          x, rows, p->n, p->w, p->scales, p->offsets, p->out, (int)p->bits, p->group, y,
          threads, (int)p->tile);
  }
  if (!failed && p->bias)
    for (int64_t r = 0; r < rows; r++)
      for (int64_t o = 0; o < p->out; o++) y[r * p->out + o] += p->bias[o];
  return failed;
}

/* y = x @ W.T + bias for rows of x: float32 rows as float_product; bf16 rows through bf16
 * weights as attnkit_bf16_linear (bf16 results), or through a quantized weight as the model's
 * forward takes them: widened to float32, multiplied, the product rounded to bf16 and the bf16
 * bias added (the bias has the rows' dtype). */
static int product(const step_linear *p, const void *x, int64_t rows, void *y, int bf16,
                   int threads) {
  if (!bf16) return float_product(p, x, rows, y, threads);
  if (p->kind == FLOAT)
    return attnkit_bf16_linear(x, rows, p->n, p->w, (const void *)p->bias, p->out, y, threads);
  const int64_t n = p->n, out = p->out;
  float *xf = malloc((size_t)(rows * (n + out) + 1) * sizeof(float)), *yf = xf + rows * n;
  if (!xf) return 1;
  const uint16_t *xb = x, *bias = (const uint16_t *)p->bias;
  uint16_t *yb = y;
  for (int64_t i = 0; i < rows * n; i++) xf[i] = bf16_to_float(xb[i]);
  step_linear unbiased = *p;
  unbiased.bias = NULL;
  const int failed = float_product(&unbiased, xf, rows, yf, threads);
  for (int64_t r = 0; r < rows && !failed; r++)
    for (int64_t o = 0; o < out; o++) {
      uint16_t v = float_to_bf16(yf[r * out + o]);
      if (bias) v = float_to_bf16(bf16_to_float(v) + bf16_to_float(bias[o]));
      yb[r * out + o] = v;
    }
  free(xf);
  return failed;
}

/* Eight float32 values stored at dst[i], or rounded to bf16 as float_to_bf16 rounds them. */
static inline void put8(void *dst, int64_t i, __m256 v, int bf16) {
  if (!bf16) {
    _mm256_storeu_ps((float *)dst + i, v);
    return;
  }
  float f[8];
  _mm256_storeu_ps(f, v);
  for (int j = 0; j < 8; j++) ((uint16_t *)dst)[i + j] = float_to_bf16(f[j]);
}

static inline void put1(void *dst, int64_t i, float v, int bf16) {
  if (bf16)
    ((uint16_t *)dst)[i] = float_to_bf16(v);
  else
    ((float *)dst)[i] = v;
}

/* x += y over n values (bf16: the float32 sum rounded once, as torch adds bf16 tensors). */
static void add_into(void *x, const void *y, int64_t n, int bf16) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) put8(x, i, _mm256_add_ps(load8(x, i, bf16), load8(y, i, bf16)), bf16);
  for (; i < n; i++) put1(x, i, load1(x, i, bf16) + load1(y, i, bf16), bf16);
}

/* The gate's activation of eight values: silu(g) = g / (1 + exp(-g)), or the tanh form of
 * GELU, g / 2 (1 + tanh(u)) with u = sqrt(2 / pi) (g + 0.044715 g^3) and 1 + tanh(u) =
 * 2 / (1 + exp(-2u)). */
static inline __m256 gate8(__m256 g, int gate) {
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  if (gate == GATE_SILU)
    return _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g))));
  const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
  const __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                 _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), cube, g));
  const __m256 e = exp8(_mm256_mul_ps(_mm256_set1_ps(-2.f), u));
  return _mm256_div_ps(g, _mm256_add_ps(one, e)); /* (g / 2 * 2 / (1 + e)) */
}

static inline float gate1(float g, int gate) {
  return _mm256_cvtss_f32(gate8(_mm256_set1_ps(g), gate));
}

/* a = act(gate) * up for each row of gu = [gate | up] (hidden values each), act as `gate` says;
 * bf16 rounds act(gate) and the product, as torch's two bf16 ops do. */
static void gated(const void *gu, int64_t rows, int64_t hidden, void *a, int bf16, int gate) {
  const int64_t size = bf16 ? 2 : 4;
  uint16_t rounded[8];
  for (int64_t r = 0; r < rows; r++) {
    const char *gate_in = (const char *)gu + r * 2 * hidden * size;
    const char *up = gate_in + hidden * size;
    char *dst = (char *)a + r * hidden * size;
    int64_t i = 0;
    for (; i + 8 <= hidden; i += 8) {
      __m256 act = gate8(load8(gate_in, i, bf16), gate);
      if (bf16) {
        put8(rounded, 0, act, 1);
        act = load8(rounded, 0, 1);
      }
      put8(dst, i, _mm256_mul_ps(act, load8(up, i, bf16)), bf16);
    }
    for (; i < hidden; i++) {
      float act = gate1(load1(gate_in, i, bf16), gate);
      if (bf16) act = bf16_to_float(float_to_bf16(act));
      put1(dst, i, act * load1(up, i, bf16), bf16);
    }
  }
}

/* Runs `count` layers over the residual stream x (rows, dim), in place: rows new tokens whose
 * rotary rows are tables[0] / tables[1] (cos and signed sin, (rows, head_dim) float32 each;
 * tables[2] / tables[3] for the layers that rotate by the local ones), their keys and values
 * stored and attended as `cache` says. x, the caches, the norms' weights and float weights are
 * bf16 where shape->bf16, else float32. Returns 0, or STEP_NO_MEMORY / STEP_REDO (also for a
 * slot outside the storage: nothing is written then). */
int attnkit_decoder_step(const step_layer *layers, int64_t count, const step_shape *shape,
                         void *x, int64_t rows, const float *const *tables,
                         const step_cache *cache, int threads) {
  const int64_t D = shape->dim, H = shape->heads, K = shape->kv_heads, E = shape->head_dim;
  const int64_t F = shape->hidden, width = (H + 2 * K) * E;
  const int64_t length = cache->length, head = cache->head, row = cache->row;
  const int paged = cache->slots != NULL, bf16 = (int)shape->bf16;
  const int batched = !paged && cache->batched;
  const int64_t S = length + (batched ? 1 : rows), size = bf16 ? 2 : 4;
  /* token t's slot and its sequence's storage offset (elements) */
#define SLOT(t) (paged ? cache->slots[t] : batched ? length : length + (t))
#define BASE(t) (batched ? (t) * cache->batch : 0)
  for (int64_t t = 0; t < rows; t++)
    if (SLOT(t) < 0 || SLOT(t) >= cache->capacity) return STEP_REDO;
  const int64_t big = D > H * E ? D : H * E;
  /* scratch: the normed rows, q/k/v, rotated queries and keys, the attention, a product's
   * rows, gate and up, the activation, a paged pool's windowed key spans, a dense cache's
   * mask */
  const int64_t values = rows * (big + width + 2 * (H + K) * E + H * E + big + 2 * F + F);
  const int64_t mask_bytes = paged ? 0 : rows * S;
  char *work = malloc((size_t)(values * size + 2 * rows * 8 + mask_bytes + 1));
  if (!work) return STEP_NO_MEMORY;
  char *h = work, *qkv = h + rows * big * size, *q = qkv + rows * width * size;
  char *k = q + rows * H * E * size, *qn = k + rows * K * E * size;
  char *kn = qn + rows * H * E * size, *att = kn + rows * K * E * size;
  char *y = att + rows * H * E * size, *gu = y + rows * big * size;
  char *a = gu + rows * 2 * F * size;
  int64_t *reach_first = (int64_t *)(a + rows * F * size), *reach_count = reach_first + rows;
  uint8_t *mask = (uint8_t *)(reach_count + rows);
  int64_t masked = -1; /* the window the mask holds (0: none; -1: not made yet) */
  int result = 0;
  for (int64_t i = 0; i < count && !result; i++) {
    const step_layer *l = layers + i;
    char *kc = (char *)cache->storage[2 * i], *vc = (char *)cache->storage[2 * i + 1];
    const float *cos = tables[2 * l->local], *signed_sin = tables[2 * l->local + 1];
    norm(shape, x, rows, D, D, l->norm1, h, l->eps1, threads);
    if (product(&l->qkv, h, rows, qkv, bf16, threads)) {
      result = STEP_NO_MEMORY;
      break;
    }
    /* queries (rows, H, E) and keys (rows, K, E) normed where the layer norms them, rotated;
     * keys and values into their slots */
    const char *qs = qkv, *ks = qkv + H * E * size;
    int64_t q_item = width, k_item = width;
    if (l->q_norm) {
      for (int64_t t = 0; t < rows; t++)
        norm(shape, qkv + t * width * size, H, E, E, l->q_norm, qn + t * H * E * size,
             l->q_eps, threads);
      qs = qn, q_item = H * E;
    }
    if (l->k_norm) {
      for (int64_t t = 0; t < rows; t++)
        norm(shape, qkv + (t * width + H * E) * size, K, E, E, l->k_norm, kn + t * K * E * size,
             l->k_eps, threads);
      ks = kn, k_item = K * E;
    }
    attnkit_rotate(qs, rows, H, 1, E, q_item, E, E, cos, signed_sin, E, q,
                   (int)shape->interleaved, bf16, threads);
    attnkit_rotate(ks, rows, K, 1, E, k_item, E, E, cos, signed_sin, E, k,
                   (int)shape->interleaved, bf16, threads);
    for (int64_t t = 0; t < rows; t++) {
      for (int64_t g = 0; g < K; g++) {
        const int64_t at = (BASE(t) + g * head + SLOT(t) * row) * size;
        memcpy(kc + at, k + (t * K + g) * E * size, (size_t)(E * size));
        memcpy(vc + at, qkv + (t * width + (H + K + g) * E) * size, (size_t)(E * size));
      }
    }
    /* each token a "sequence" of its own: over the shared dense cache up to its own slot (its
     * mask row), or over its own slots of the pool; within the layer's window */
    const int64_t w = l->window;
    if (paged)
      for (int64_t t = 0; t < rows; t++) {
        const int64_t n = cache->count[t], keep = w > 0 && n > w ? w : n;
        reach_first[t] = cache->first[t] + n - keep;
        reach_count[t] = keep;
      }
    else if ((rows > 1 || w > 0 || cache->padding) && masked != w) {
      for (int64_t t = 0; t < rows; t++) {
        const int64_t own = SLOT(t);
        const uint8_t *pad = cache->padding ? cache->padding + t * cache->padding_row : NULL;
        for (int64_t j = 0; j < S; j++)
          mask[t * S + j] = j <= own && (w <= 0 || j > own - w) &&
                            (!pad || pad[j * cache->padding_key] != 0);
      }
      masked = w;
    }
    const int flags =
        paged ? attnkit_paged_one_query_attention(
                    q, rows, K, H / K, E, kc, head, row, vc, head, row, E, cache->keys,
                    cache->width, reach_first, reach_count, cache->capacity, shape->scale, l->cap,
                    att, bf16, threads)
              : attnkit_one_query_attention(
                    q, rows, K, H / K, E, kc, batched ? cache->batch : 0, head, row, vc,
                    batched ? cache->batch : 0, head, row, E, S,
                    rows > 1 || w > 0 || cache->padding ? mask : NULL, S, 1, shape->scale,
                    l->cap, att, bf16, threads);
    if (flags & 4) {
      result = STEP_NO_MEMORY;
      break;
    }
    if (flags) { /* a non-finite score, no key, a bad table: the general path's rules */
      result = STEP_REDO;
      break;
    }
    if (product(&l->out, att, rows, y, bf16, threads)) {
      result = STEP_NO_MEMORY;
      break;
    }
    if (l->post1) /* (into h: the layer's first norm is used up) */
      norm(shape, y, rows, D, D, l->post1, h, l->post_eps1, threads);
    add_into(x, l->post1 ? h : y, rows * D, bf16);
    norm(shape, x, rows, D, D, l->norm2, h, l->eps2, threads);
    if (product(&l->gate_up, h, rows, gu, bf16, threads)) {
      result = STEP_NO_MEMORY;
      break;
    }
    gated(gu, rows, F, a, bf16, (int)shape->gate);
    if (product(&l->down, a, rows, y, bf16, threads)) {
      result = STEP_NO_MEMORY;
      break;
    }
    if (l->post2) /* (into h: the second norm is used up) */
      norm(shape, y, rows, D, D, l->post2, h, l->post_eps2, threads);
    add_into(x, l->post2 ? h : y, rows * D, bf16);
  }
  free(work);
  return result;
#undef SLOT
#undef BASE
}
