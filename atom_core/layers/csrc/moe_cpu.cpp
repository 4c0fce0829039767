// The experts loop of FusedMoE on CPU: one task per active expert, experts spread over the
// threads, each expert's two GEMMs (oneDNN, on its repacked weights) single-threaded.
//
// At a few rows per expert (decode and small batches) a GEMM is too small to split well:
// the Python loop, each GEMM on all threads, ran a 64-expert layer's experts 1.4-1.8x
// slower than giving each thread whole experts, and under load from other processes its
// per-GEMM thread barriers stalled it 10-50x. Largest experts first, handed out
// dynamically, keeps the threads even when the counts are skewed.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <numeric>
#include <vector>

namespace {

using LinearPointwise = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                   c10::string_view, c10::List<std::optional<at::Scalar>>,
                                   std::optional<c10::string_view>);

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<LinearPointwise>();
  return op.call(x, packed, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

template <typename T>
void scatter_rows(const T* y, const int64_t* rows, int64_t n, int64_t h, const float* weights, float* out) {
  for (int64_t r = 0; r < n; ++r) {
    const float w = weights[rows[r]];
    const T* src = y + r * h;
    float* dst = out + rows[r] * h;
    for (int64_t c = 0; c < h; ++c) dst[c] = static_cast<float>(src[c]) * w;
  }
}

// hidden: [T, H]; order: [T*k] flat (token, slot) assignments sorted by expert, counts[e] of
// them for expert e; weights: [T*k] float32 routing weights in flat order. w13[e]: packed
// [2I, H] (gate rows, then up rows); w2[e]: packed [H, I]. Float32 rows: row
// t*k + j (token t's j-th expert output times its weight) is summed over j into a [T, H] result in hidden's dtype. Each task gathers its own
// rows and writes rows no other task writes, so the sum over slots needs no atomics.
at::Tensor experts_forward(const at::Tensor& hidden, const at::Tensor& order, const std::vector<int64_t>& counts,
                           const at::Tensor& weights, int64_t top_k, const std::vector<at::Tensor>& w13,
                           const std::vector<at::Tensor>& w2) {
  TORCH_CHECK(hidden.dim() == 2, "hidden must be [tokens, hidden], got ", hidden.sizes());
  TORCH_CHECK(order.numel() == hidden.size(0) * top_k && weights.numel() == order.numel(),
              "order and weights must hold tokens * top_k = ", hidden.size(0) * top_k, " entries");
  TORCH_CHECK(order.scalar_type() == at::kLong && weights.scalar_type() == at::kFloat, "order must be int64, weights float32");
  TORCH_CHECK(counts.size() == w13.size() && counts.size() == w2.size(),
              "counts, w13 and w2 must have one entry per expert, got ", counts.size(), ", ", w13.size(), ", ", w2.size());
  TORCH_CHECK(std::accumulate(counts.begin(), counts.end(), int64_t{0}) == order.numel(), "counts must sum to ",
              order.numel(), " assignments");
  std::vector<int64_t> experts, starts;
  for (int64_t e = 0, start = 0; e < static_cast<int64_t>(counts.size()); start += counts[e], ++e) {
    if (counts[e] > 0) {
      experts.push_back(e);
      starts.push_back(start);
    }
  }
  std::vector<int64_t> by_size(experts.size());
  std::iota(by_size.begin(), by_size.end(), 0);
  std::stable_sort(by_size.begin(), by_size.end(),
                   [&](int64_t a, int64_t b) { return counts[experts[a]] > counts[experts[b]]; });

  at::Tensor out = at::empty({order.numel(), hidden.size(1)}, hidden.options().dtype(at::kFloat));
  TORCH_CHECK(hidden.is_contiguous() && order.is_contiguous() && weights.is_contiguous(),
              "hidden, order and weights must be contiguous");
  const int64_t hidden_size = hidden.size(1);
  const size_t row_bytes = static_cast<size_t>(hidden_size) * hidden.element_size();
  const char* hidden_p = static_cast<const char*>(hidden.data_ptr());
  const int64_t* order_p = order.data_ptr<int64_t>();
  const float* weights_p = weights.data_ptr<float>();
  float* out_p = out.data_ptr<float>();
  std::exception_ptr error = nullptr;
  const int64_t n = static_cast<int64_t>(by_size.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int64_t j = 0; j < n; ++j) {
    try {
      const int64_t i = by_size[j], e = experts[i], n = counts[e];
      const int64_t* rows = order_p + starts[i];
      // gather this expert's token rows (row r of the flat order belongs to token r / top_k)
      at::Tensor x = at::empty({n, hidden_size}, hidden.options());
      char* x_p = static_cast<char*>(x.data_ptr());
      for (int64_t r = 0; r < n; ++r)
        std::memcpy(x_p + r * row_bytes, hidden_p + (rows[r] / top_k) * row_bytes, row_bytes);
      at::Tensor gate_up = onednn_linear(x, w13[e]);
      const int64_t inter = gate_up.size(1) / 2;
      at::Tensor act = at::silu(gate_up.narrow(1, 0, inter)).mul_(gate_up.narrow(1, inter, inter));
      at::Tensor y = onednn_linear(act, w2[e]).contiguous();
      // weighted scatter: out[row] = y[r] * weight[row], in float32
      if (y.scalar_type() == at::kFloat) {
        scatter_rows<float>(y.data_ptr<float>(), rows, n, hidden_size, weights_p, out_p);
      } else if (y.scalar_type() == at::kBFloat16) {
        scatter_rows<at::BFloat16>(y.data_ptr<at::BFloat16>(), rows, n, hidden_size, weights_p, out_p);
      } else {
        at::Tensor idx = order.narrow(0, starts[i], n);
        out.index_copy_(0, idx, y.to(at::kFloat).mul_(weights.index_select(0, idx).unsqueeze(1)));
      }
    } catch (...) {
#pragma omp critical
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
  // each token's sum over its k slots, in float32, written once in hidden's dtype
  const int64_t tokens = hidden.size(0);
  at::Tensor result = at::empty({tokens, hidden_size}, hidden.options());
  auto reduce = [&](auto* dst_p) {
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(hidden_size);
      for (int64_t t = begin; t < end; ++t) {
        const float* src = out_p + t * top_k * hidden_size;
        std::memcpy(acc.data(), src, hidden_size * sizeof(float));
        for (int64_t j = 1; j < top_k; ++j)
          for (int64_t c = 0; c < hidden_size; ++c) acc[c] += src[j * hidden_size + c];
        auto* dst = dst_p + t * hidden_size;
        for (int64_t c = 0; c < hidden_size; ++c) dst[c] = acc[c];
      }
    });
  };
  if (result.scalar_type() == at::kBFloat16) {
    reduce(result.data_ptr<at::BFloat16>());
  } else if (result.scalar_type() == at::kFloat) {
    reduce(result.data_ptr<float>());
  } else {
    result.copy_(out.view({tokens, top_k, hidden_size}).sum(1));
  }
  return result;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("experts_forward", &experts_forward, "weighted MoE expert outputs per (token, slot), experts spread over threads (CPU, oneDNN)",
        py::call_guard<py::gil_scoped_release>());
}
