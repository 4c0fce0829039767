// Fused CPU versions of elementwise layers every model uses (vLLM's rms_norm and
// rotary_embedding custom ops). torch runs each as three to five broadcasting ops with a
// temporary per op: 3x (RMSNorm) to 25x (rotary over a strided q/k view) slower over a
// prefill's activations. Each kernel reads its input once and rounds where transformers
// rounds (to the activation dtype after each product), so float32 results are those of
// the torch path up to summation order. (A fused SiLU-and-mul measured slower than
// torch's own vectorised silu times up, so that one stays in torch.)
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#include "float_convert.h"

namespace {

using atom::from_float;
using atom::to_float;

// Round a float through T (a no-op for float): where transformers holds a product in the
// activation dtype, so do we.
template <typename T>
inline float round_through(float f) { return to_float(from_float<T>(f)); }

// Rows per task so that a task holds ~16k elements: decode batches stay on one thread.
inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems)); }

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0), os = out.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = xp + r * xs;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < n; ++i) ss += to_float(row[i]) * to_float(row[i]);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + feps);
      T* dst = op + r * os;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) dst[i] = from_float<T>(to_float(wp[i]) * round_through<T>(to_float(row[i]) * inv));
    }
  });
}

// x: [tokens, heads, dim], rotated in place; cos, sin: [tokens, (1,) dim] (sin sign-folded:
// -sin on the first half). out = x * cos + roll(x, dim / 2) * sin, as the torch path.
template <typename T>
void rotary_impl(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), cs = cos.stride(0), ss = sin.stride(0);
  T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  at::parallel_for(0, tokens, grain(heads * dim), [&](int64_t begin, int64_t end) {
    float buf[1024];
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cp + t * cs;
      const T* s = sp + t * ss;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = xp + t * xs0 + h * xs1;
        for (int64_t d = 0; d < dim; ++d) buf[d] = to_float(v[d]);
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) {
          const float rolled = d < half ? buf[d + half] : buf[d - half];
          v[d] = from_float<T>(round_through<T>(buf[d] * to_float(c[d])) + round_through<T>(rolled * to_float(s[d])));
        }
      }
    }
  });
}

#define DISPATCH(dtype, name, ...)                                                         \
  switch (dtype) {                                                                         \
    case at::kFloat: { using scalar_t = float; __VA_ARGS__; break; }                      \
    case at::kBFloat16: { using scalar_t = c10::BFloat16; __VA_ARGS__; break; }           \
    case at::kHalf: { using scalar_t = c10::Half; __VA_ARGS__; break; }                   \
    default: TORCH_CHECK(false, name " takes float32, bfloat16 or float16, not ", dtype); \
  }

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, " runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " takes a [rows, n] tensor with contiguous rows");
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "rms_norm weight must be contiguous, of the input's width and dtype");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  DISPATCH(x.scalar_type(), "rms_norm", rms_norm_impl<scalar_t>(x, weight, eps, out));
  return out;
}

at::Tensor rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1, "rotary_ takes [tokens, heads, dim], rows contiguous");
  TORCH_CHECK(x.size(2) % 2 == 0 && x.size(2) <= 1024, "rotary_ head_dim must be even and at most 1024");
  TORCH_CHECK(cos.size(0) == x.size(0) && sin.size(0) == x.size(0) && cos.size(-1) == x.size(2) &&
                  sin.size(-1) == x.size(2) && cos.stride(-1) == 1 && sin.stride(-1) == 1,
              "rotary_ cos/sin must be [tokens, (1,) head_dim] with contiguous rows");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary_ cos/sin must have the input's dtype");
  DISPATCH(x.scalar_type(), "rotary_", rotary_impl<scalar_t>(x, cos, sin));
  return x;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim, float32 statistics (CPU)");
  m.def("rotary_", &rotary_, "rotate-half rotary embedding, in place (CPU)");
}
