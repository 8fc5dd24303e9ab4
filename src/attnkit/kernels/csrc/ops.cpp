/* The CPU implementations of attnkit's decoding ops, registered with torch's dispatcher.
 *
 * A decoding step of a compiled graph calls these ops a hundred times or more (one per weight
 * matrix with int8 weights, one attention per layer). Registered from Python, each call goes
 * through the interpreter: checks, an output allocation and a ctypes call, a cost of the order
 * of a small product. Here the dispatcher calls C++ directly, which checks the arguments and
 * calls the C kernels of this package (built into the library this one is linked to).
 *
 * The ops are defined (their schemas) by attnkit.kernels.ops; attnkit.kernels.build loads this
 * library where it builds, and the Python implementations run otherwise.
 */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

extern "C" {
int attnkit_int8_linear(const float *x, int64_t rows, int64_t n, const int8_t *w,
                        const float *scale, int64_t out, float *y, int threads);
int attnkit_int4_linear(const float *x, int64_t rows, int64_t n, const uint8_t *w,
                        const uint16_t *sm, int64_t out, int64_t group, float *y, int threads);
int attnkit_bf16_linear(const uint16_t *x, int64_t rows, int64_t n, const uint16_t *w,
                        const uint16_t *bias, int64_t out, uint16_t *y, int threads);
int attnkit_float_linear(const float *x, int64_t rows, int64_t n, const float *w,
                         const float *bias, int64_t out, float *y, int threads);
int attnkit_one_query_attention(const void *q, int64_t B, int64_t K, int64_t G, int64_t E,
                                const void *k, int64_t kb, int64_t kh, int64_t ks, const void *v,
                                int64_t vb, int64_t vh, int64_t vs, int64_t Ev, int64_t S,
                                const uint8_t *mask, int64_t mb, int64_t msk, float scale,
                                float cap, void *out, int bf16, int threads);
}

namespace {

constexpr int64_t kInt8Block = 32; /* int8_dot.c's BLOCK */
constexpr int64_t kGroup = 4;      /* int4_dot.c's GROUP: rows side by side */
constexpr int kNoMemory = 4;       /* one_query.c's NO_MEMORY */

bool on_cpu(const at::Tensor &t) { return t.device().is_cpu(); }

/* x (rows, n) @ (codes * scale[:, None]).T, the codes in the kernel's grouped order. */
at::Tensor int8_dot_linear(const at::Tensor &x, const at::Tensor &codes, const at::Tensor &scale) {
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat && codes.scalar_type() == at::kChar &&
                       scale.scalar_type() == at::kFloat,
                   "int8_dot_linear takes float32 x, int8 codes and float32 scale, got ",
                   x.scalar_type(), ", ", codes.scalar_type(), " and ", scale.scalar_type());
  TORCH_CHECK_VALUE(x.dim() == 2 && codes.dim() == 2 && x.size(1) == codes.size(1) &&
                        scale.dim() == 1 && scale.size(0) == codes.size(0) &&
                        codes.size(1) % kInt8Block == 0,
                    "int8_dot_linear needs x (rows, n), codes (out, n) and scale (out,) with n a "
                    "multiple of ",
                    kInt8Block, ", got ", x.sizes(), ", ", codes.sizes(), " and ", scale.sizes());
  TORCH_CHECK_VALUE(on_cpu(x) && on_cpu(codes) && on_cpu(scale),
                    "int8_dot_linear runs on CPU tensors, got x on ", x.device());
  const at::Tensor xc = x.contiguous(), cc = codes.contiguous(), sc = scale.contiguous();
  at::Tensor y = at::empty({x.size(0), codes.size(0)}, x.options());
  const int failed = attnkit_int8_linear(xc.data_ptr<float>(), x.size(0), x.size(1),
                                         cc.data_ptr<int8_t>(), sc.data_ptr<float>(),
                                         codes.size(0), y.data_ptr<float>(), at::get_num_threads());
  TORCH_CHECK(!failed, "int8_dot_linear could not allocate ", x.size(0), " quantized rows");
  return y;
}

/* x (rows, n) @ W.T for the int4 weight of packed codes (out4, n / 2) and bf16 scales and
 * offsets (out4 / 4, groups * 8), out4 = out rounded up to a multiple of four. */
at::Tensor int4_dot_linear(const at::Tensor &x, const at::Tensor &codes, const at::Tensor &scales,
                           int64_t out) {
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat && codes.scalar_type() == at::kByte &&
                       scales.scalar_type() == at::kBFloat16,
                   "int4_dot_linear takes float32 x, uint8 codes and bfloat16 scales, got ",
                   x.scalar_type(), ", ", codes.scalar_type(), " and ", scales.scalar_type());
  const int64_t n = codes.dim() == 2 ? 2 * codes.size(1) : -1;
  const int64_t groups = scales.dim() == 2 ? scales.size(1) / (2 * kGroup) : 0;
  const bool fits = x.dim() == 2 && x.size(1) == n && n % kInt8Block == 0 && out >= 0 &&
                    codes.size(0) == (out + kGroup - 1) / kGroup * kGroup && groups > 0 &&
                    scales.size(0) == codes.size(0) / kGroup &&
                    scales.size(1) == groups * 2 * kGroup && n % groups == 0 &&
                    (n / groups) % kInt8Block == 0;
  TORCH_CHECK_VALUE(fits,
                    "int4_dot_linear needs x (rows, n), codes (ceil(out / 4) * 4, n / 2) and "
                    "scales (ceil(out / 4), groups * 8) with n a multiple of groups * ",
                    kInt8Block, ", got ", x.sizes(), ", ", codes.sizes(), " and ", scales.sizes(),
                    " for out=", out);
  TORCH_CHECK_VALUE(on_cpu(x) && on_cpu(codes) && on_cpu(scales),
                    "int4_dot_linear runs on CPU tensors, got x on ", x.device());
  const at::Tensor xc = x.contiguous(), cc = codes.contiguous(), sc = scales.contiguous();
  at::Tensor y = at::empty({x.size(0), out}, x.options());
  const int failed = attnkit_int4_linear(
      xc.data_ptr<float>(), x.size(0), n, cc.data_ptr<uint8_t>(),
      reinterpret_cast<const uint16_t *>(sc.data_ptr<at::BFloat16>()), out, n / groups,
      y.data_ptr<float>(), at::get_num_threads());
  TORCH_CHECK(!failed, "int4_dot_linear could not allocate ", x.size(0), " quantized rows");
  return y;
}

/* F.linear(x, weight, bias) for a few rows, all bf16 or all float32. */
at::Tensor float_dot_linear(const at::Tensor &x, const at::Tensor &weight,
                            const std::optional<at::Tensor> &bias) {
  const auto dtype = weight.scalar_type();
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK_TYPE((dtype == at::kBFloat16 || dtype == at::kFloat) && x.scalar_type() == dtype &&
                       (!has_bias || bias->scalar_type() == dtype),
                   "float_dot_linear takes x, weight and bias all bfloat16 or all float32, got ",
                   x.scalar_type(), ", ", dtype,
                   has_bias ? std::string(", ") + c10::toString(bias->scalar_type()) : "");
  TORCH_CHECK_VALUE(on_cpu(x) && on_cpu(weight) && (!has_bias || on_cpu(*bias)),
                    "float_dot_linear runs on CPU tensors, got x on ", x.device(),
                    " and weight on ", weight.device());
  const int64_t out = weight.dim() == 2 ? weight.size(0) : -1;
  const int64_t n = weight.dim() == 2 ? weight.size(1) : -1;
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) == n &&
                        (!has_bias || (bias->dim() == 1 && bias->size(0) == out)),
                    "float_dot_linear needs x (..., n), weight (out, n) and bias (out,) or None, "
                    "got ",
                    x.sizes(), ", ", weight.sizes(), " and ",
                    has_bias ? c10::str(bias->sizes()) : std::string("None"));
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const at::Tensor bc = has_bias ? bias->contiguous() : at::Tensor();
  auto shape = x.sizes().vec();
  shape.back() = out;
  at::Tensor y = at::empty(shape, x.options());
  int64_t rows = 1; /* (x's leading sizes: with n == 0 the outputs are the bias) */
  for (int64_t d = 0; d + 1 < x.dim(); d++) rows *= x.size(d);
  int failed;
  if (dtype == at::kFloat) {
    failed = attnkit_float_linear(xc.data_ptr<float>(), rows, n, wc.data_ptr<float>(),
                                  has_bias ? bc.data_ptr<float>() : nullptr, out,
                                  y.data_ptr<float>(), at::get_num_threads());
  } else {
    auto raw = [](const at::Tensor &t) {
      return reinterpret_cast<const uint16_t *>(t.data_ptr<at::BFloat16>());
    };
    failed = attnkit_bf16_linear(raw(xc), rows, n, raw(wc), has_bias ? raw(bc) : nullptr, out,
                                 reinterpret_cast<uint16_t *>(y.data_ptr<at::BFloat16>()),
                                 at::get_num_threads());
  }
  TORCH_CHECK(!failed, "float_dot_linear could not allocate ", rows, " float32 rows");
  return y;
}

/* One query per sequence and head over keys/values (a decoding step): q (B, H, 1, E), k (B, K,
 * S, E), v (B, K, S, Ev), a bool mask (B or 1, 1, 1, S) or none. */
at::Tensor one_query_attention(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                               const std::optional<at::Tensor> &mask, double scale) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK_TYPE((dtype == at::kBFloat16 || dtype == at::kFloat) && k.scalar_type() == dtype &&
                       v.scalar_type() == dtype,
                   "one_query_attention takes q, k and v all bfloat16 or all float32, got ", dtype,
                   ", ", k.scalar_type(), " and ", v.scalar_type());
  const bool has_mask = mask.has_value() && mask->defined();
  TORCH_CHECK_TYPE(!has_mask || mask->scalar_type() == at::kBool,
                   "one_query_attention takes a bool mask, got ", mask->scalar_type());
  bool fits = q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && on_cpu(q) && on_cpu(k) && on_cpu(v);
  int64_t B = 0, H = 0, E = 0, K = 0, S = 0, Ev = 0;
  if (fits) {
    B = q.size(0), H = q.size(1), E = q.size(3), K = k.size(1), S = k.size(2), Ev = v.size(3);
    fits = q.size(2) == 1 && K > 0 && H % K == 0 && k.size(0) == B && v.size(0) == B &&
           k.size(3) == E && v.size(1) == K && v.size(2) == S &&
           (!has_mask || (mask->dim() == 4 && on_cpu(*mask) && mask->size(1) == 1 &&
                          mask->size(2) == 1 && mask->size(3) == S &&
                          (mask->size(0) == 1 || mask->size(0) == B)));
  }
  TORCH_CHECK_VALUE(fits,
                    "one_query_attention needs CPU q (B, H, 1, E), k (B, K, S, E), v (B, K, S, "
                    "Ev) with H % K == 0 and a mask (B or 1, 1, 1, S) or None, got ",
                    q.sizes(), ", ", k.sizes(), ", ", v.sizes(), " and ",
                    has_mask ? c10::str(mask->sizes()) : std::string("None"), " on ", q.device(),
                    ", ", k.device(), ", ", v.device());
  const at::Tensor qc = q.contiguous();
  const at::Tensor kc = k.stride(-1) == 1 ? k : k.contiguous();
  const at::Tensor vc = v.stride(-1) == 1 ? v : v.contiguous();
  at::Tensor out = at::empty({B, H, 1, Ev}, q.options());
  if (out.numel() == 0) return out;
  const uint8_t *m = has_mask ? reinterpret_cast<const uint8_t *>(mask->data_ptr<bool>()) : nullptr;
  const int64_t mb = has_mask && mask->size(0) > 1 ? mask->stride(0) : 0;
  const int64_t msk = has_mask ? mask->stride(3) : 0;
  const int flags = attnkit_one_query_attention(
      qc.data_ptr(), B, K, H / K, E, kc.data_ptr(), kc.stride(0), kc.stride(1), kc.stride(2),
      vc.data_ptr(), vc.stride(0), vc.stride(1), vc.stride(2), Ev, S, m, mb, msk,
      static_cast<float>(scale), 0.f, out.data_ptr(), dtype == at::kBFloat16,
      at::get_num_threads());
  TORCH_CHECK(!(flags & kNoMemory), "one_query_attention could not allocate its buffers (", S,
              " keys)");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(attnkit, CPU, m) {
  m.impl("int8_dot_linear", &int8_dot_linear);
  m.impl("int4_dot_linear", &int4_dot_linear);
  m.impl("float_dot_linear", &float_dot_linear);
  m.impl("one_query_attention", &one_query_attention);
}
