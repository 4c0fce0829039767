// Fused CPU versions of elementwise layers every model uses (vLLM's rms_norm and
// rotary_embedding custom ops). torch runs each as three to five broadcasting ops with a
// temporary per op: 3x (RMSNorm) to 25x (rotary over a strided q/k view) slower over a
// prefill's activations. Each kernel reads its input once and rounds where transformers
// rounds (to the activation dtype after each product), so float32 results are those of
// the torch path up to summation order. add_rms_norm also does the residual add before
// the norm (vLLM's fused_add_rms_norm). silu_and_mul serves decode-sized row counts, where
// torch's three ops cost more in dispatch than in arithmetic; it calls the exp torch's silu
// calls for each element, so it equals F.silu(gate) * up bit for bit.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <vector>

#include "out_tensor.h"
#include "simd.h"

namespace {

using atom::from_float;
using atom::to_float;
using atom::exp_lanes;
using atom::kLanes;

// Round a float through T (a no-op for float): where transformers holds a product in the
// activation dtype, so do we.
template <typename T>
inline float round_through(float f) { return to_float(from_float<T>(f)); }

// Rows per task so that a task holds ~16k elements: decode batches stay on one thread.
inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems)); }

// dst = weight * round(row / rms(row)): one row of RMSNorm, the one loop both norms run.
template <typename T>
inline void rms_norm_row(const T* row, const T* wp, int64_t n, float eps, T* dst) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += to_float(row[i]) * to_float(row[i]);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = from_float<T>(to_float(wp[i]) * round_through<T>(to_float(row[i]) * inv));
}

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0), os = out.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * xs, wp, n, static_cast<float>(eps), op + r * os);
  });
}

// residual += x (rounded to T, as torch's add), then out = rms_norm(residual).
template <typename T>
void add_rms_norm_impl(const at::Tensor& x, at::Tensor& res, const at::Tensor& w, double eps, at::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0), rs = res.stride(0), os = out.stride(0);
  const T* xp = x.data_ptr<T>();
  T* rp = res.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* a = xp + r * xs;
      T* sum = rp + r * rs;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) sum[i] = from_float<T>(to_float(a[i]) + to_float(sum[i]));
      rms_norm_row(static_cast<const T*>(sum), wp, n, static_cast<float>(eps), op + r * os);
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

// x: [rows, 2 * d] = [gate | up] -> out [rows, d] = silu(gate) * up, rounded as
// F.silu(gate) * up: silu(g) = g / (1 + exp(-g)) in float32, rounded to T, then the product
// of the two T values in float32, rounded to T. torch's silu (one thread) takes each row's
// leading whole pairs of `vector_bytes` vectors through Sleef's exp and the rest through
// std::exp, which differ in the last bit of a float now and then: so do we.
template <typename T>
void silu_and_mul_impl(const at::Tensor& x, int64_t vector_bytes, at::Tensor& out) {
  constexpr int64_t kBlock = 256;  // floats of exp(-gate) at a time, a multiple of kLanes
  const int64_t rows = x.size(0), d = x.size(1) / 2, xs = x.stride(0), os = out.stride(0);
  const int64_t pair = 2 * vector_bytes / static_cast<int64_t>(sizeof(T));
  const int64_t vec_end = pair ? d / pair * pair : 0;
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain(2 * d), [&](int64_t begin, int64_t end) {
    alignas(64) float e[kBlock];
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = xp + r * xs;
      const T* up = gate + d;
      T* dst = op + r * os;
      for (int64_t i = 0; i < d; i += kBlock) {
        const int64_t m = std::min(kBlock, d - i), vec = std::clamp<int64_t>(vec_end - i, 0, m);
#pragma omp simd
        for (int64_t k = 0; k < m; ++k) e[k] = -to_float(gate[i + k]);
        for (int64_t k = 0; k < vec; k += kLanes) exp_lanes(e + k);
        for (int64_t k = vec; k < m; ++k) e[k] = std::exp(e[k]);
#pragma omp simd
        for (int64_t k = 0; k < m; ++k)
          dst[i + k] = from_float<T>(round_through<T>(to_float(gate[i + k]) / (1.f + e[k])) * to_float(up[i + k]));
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

// x as [rows, n], n its last dim: a view where one exists, else a copy (torch's reshape).
// Done here rather than in Python, where a reshape and a view back cost more than the norm.
at::Tensor as_rows(const at::Tensor& x) { return x.dim() == 2 ? x : x.reshape({-1, x.size(-1)}); }

void check_weight(const at::Tensor& w, const at::Tensor& x, const char* name) {
  TORCH_CHECK(w.is_contiguous() && w.numel() == x.size(1) && w.scalar_type() == x.scalar_type(),
              name, " weight must be contiguous, of the input's width and dtype");
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps, const c10::optional<at::Tensor>& out_) {
  const auto x = as_rows(input);
  check_rows(x, "rms_norm");
  check_weight(weight, x, "rms_norm");
  auto out = atom::output(out_, {x.size(0), x.size(1)}, x.options(), "rms_norm");
  DISPATCH(x.scalar_type(), "rms_norm", rms_norm_impl<scalar_t>(x, weight, eps, out));
  return input.dim() == 2 ? out : out.view(input.sizes());
}

// residual (contiguous, x's shape) += x; returns rms_norm(residual).
at::Tensor add_rms_norm(const at::Tensor& input, const at::Tensor& residual, const at::Tensor& weight, double eps,
                        const c10::optional<at::Tensor>& out_) {
  const auto x = as_rows(input);
  check_rows(x, "add_rms_norm");
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == input.sizes() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm residual must be contiguous, of the input's shape and dtype");
  check_weight(weight, x, "add_rms_norm");
  auto res = residual.view({x.size(0), x.size(1)});
  auto out = atom::output(out_, {x.size(0), x.size(1)}, x.options(), "add_rms_norm");
  DISPATCH(x.scalar_type(), "add_rms_norm", add_rms_norm_impl<scalar_t>(x, res, weight, eps, out));
  return input.dim() == 2 ? out : out.view(input.sizes());
}

at::Tensor silu_and_mul(const at::Tensor& x, int64_t vector_bytes, const c10::optional<at::Tensor>& out_) {
  check_rows(x, "silu_and_mul");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul takes [rows, 2 * d]");
  TORCH_CHECK(vector_bytes == 0 || (vector_bytes >= 32 && vector_bytes % 32 == 0 && kLanes > 0),
              "silu_and_mul: vector_bytes must be 0, or 32 or 64 in a build with AVX2");
  auto out = atom::output(out_, {x.size(0), x.size(1) / 2}, x.options(), "silu_and_mul");
  DISPATCH(x.scalar_type(), "silu_and_mul", silu_and_mul_impl<scalar_t>(x, vector_bytes, out));
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

// torch.argmax over each row: the first index of the row's maximum, or of its first NaN
// (torch counts NaN as the largest). torch's CPU argmax reads ~1 G values/s; a greedy step
// takes one over a [requests, vocab] logits block. Two passes over a row in cache: its
// maximum (and whether it holds a NaN), then where that value first appears.
namespace {

namespace simd = atom::simd;
constexpr int64_t L = simd::kLanes;

// A row's maximum (-inf for an empty row) and whether it holds a NaN.
template <typename T>
float row_max(const T* x, int64_t n, bool& nan) {
  int64_t i = 0;
  float best = -INFINITY;
  nan = false;
  if constexpr (std::is_same_v<T, float>) {
    simd::vf m = simd::set1(-INFINITY);
    uint32_t unordered = 0;
    for (; i + L <= n; i += L) {
      const simd::vf v = simd::load(x + i);
      unordered |= simd::mask_nan(v);
      m = simd::max(m, v);
    }
    best = simd::reduce_max(m);
    nan = unordered != 0;
  }
  for (; i < n; ++i) {
    const float v = atom::to_float(x[i]);
    nan |= v != v;
    best = std::max(best, v);
  }
  return best;
}

template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  bool nan;
  const float best = row_max(x, n, nan);
  int64_t i = 0;
  if (nan) {
    while (atom::to_float(x[i]) == atom::to_float(x[i])) ++i;
    return i;
  }
  if constexpr (std::is_same_v<T, float>) {
    const simd::vf target = simd::set1(best);
    for (; i + L <= n; i += L) {
      const uint32_t hit = simd::mask_eq(simd::load(x + i), target);
      if (hit) return i + __builtin_ctz(hit);
    }
  }
  for (; i < n; ++i)
    if (atom::to_float(x[i]) == best) return i;
  return 0;  // an empty row (n == 0) is refused before this
}

}  // namespace

at::Tensor argmax_rows(const at::Tensor& x) {
  check_rows(x, "argmax_rows");
  TORCH_CHECK(x.size(1) > 0, "argmax_rows takes rows of at least one value");
  auto out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t n = x.size(1), stride = x.stride(0);
  DISPATCH(x.scalar_type(), "argmax_rows", {
    const scalar_t* p = x.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(p + r * stride, n);
    });
  });
  return out;
}

// The entries of each float32 row within a margin of the row's maximum m: x >= m - 2 e, with
// e = eps * ((base_r + |m|) + 1) (quant.ExactTopLogits' error bound of an LM head's logits).
// torch's max, compare and nonzero over a [rows, vocab] block took ~95 us a decode step,
// this ~10; a row holding a NaN has a NaN maximum, and so no entries (as in torch).
std::tuple<at::Tensor, at::Tensor> near_max_rows(const at::Tensor& x, const at::Tensor& base, double eps) {
  check_rows(x, "near_max_rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "near_max_rows takes float32 rows, not ", x.scalar_type());
  TORCH_CHECK(base.scalar_type() == at::kFloat && base.is_contiguous() && base.numel() == x.size(0),
              "near_max_rows takes a float32 base per row (", x.size(0), "), got ", base.numel());
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  const float* b = base.data_ptr<float>();
  const float e = static_cast<float>(eps);
  std::vector<int64_t> hit_rows, hit_cols;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x.data_ptr<float>() + r * stride;
    bool nan;
    const float top = row_max(row, n, nan);
    if (nan || n == 0) continue;
    const float err = e * ((b[r] + std::fabs(top)) + 1.0f);
    const float threshold = top - 2.0f * err;
    int64_t i = 0;
    const simd::vf t = simd::set1(threshold);
    for (; i + L <= n; i += L) {
      for (uint32_t hit = simd::mask_ge(simd::load(row + i), t); hit; hit &= hit - 1) {
        hit_rows.push_back(r);
        hit_cols.push_back(i + __builtin_ctz(hit));
      }
    }
    for (; i < n; ++i)
      if (row[i] >= threshold) {
        hit_rows.push_back(r);
        hit_cols.push_back(i);
      }
  }
  auto as_tensor = [&](const std::vector<int64_t>& v) {
    auto t = at::empty({static_cast<int64_t>(v.size())}, x.options().dtype(at::kLong));
    std::copy(v.begin(), v.end(), t.data_ptr<int64_t>());
    return t;
  };
  return {as_tensor(hit_rows), as_tensor(hit_cols)};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("near_max_rows", &near_max_rows, "(rows, cols) of the float32 entries within eps-scaled margins of their row's maximum (CPU)");
  m.def("argmax_rows", &argmax_rows, "argmax over each row, torch's semantics (first maximum, NaN largest; CPU)");
  // `out`: the buffer to write (a replayed graph's, atom::output); a new tensor without it
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim, float32 statistics (CPU)", py::arg("x"), py::arg("weight"),
        py::arg("eps"), py::arg("out") = py::none());
  m.def("add_rms_norm", &add_rms_norm, "residual += x, then RMSNorm of residual (residual updated in place; CPU)",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"), py::arg("out") = py::none());
  m.def("silu_and_mul", &silu_and_mul, "[gate | up] -> silu(gate) * up, as torch's one-thread silu rounds (CPU)",
        py::arg("x"), py::arg("vector_bytes"), py::arg("out") = py::none());
  m.def("rotary_", &rotary_, "rotate-half rotary embedding, in place (CPU)");
  m.attr("EXP_LANES") = kLanes;  // 0: no vector exp to mirror torch's silu with (portable builds)
  m.attr("VARIANT") = ATOM_STR(ATOM_VARIANT);
}
