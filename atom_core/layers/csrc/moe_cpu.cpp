// The experts of FusedMoE on CPU: one task per active expert, experts spread over the
// threads, each expert's work single-threaded and fused: gather its tokens' rows, gate+up
// GEMM, silu(gate) * up, down GEMM, each row times its routing weight, all in one pass.
//
// The GEMMs are oneDNN's batch-reduce micro-kernel as torch exports it
// (`at::native::cpublas::brgemm`), over weights packed at load time in panels of NB output
// columns (`moe.pack_panels`): a panel is K x NB values in one contiguous run (bfloat16 as
// VNNI pairs along K), small enough to stay in L2 while every block of rows passes over
// it, and read from memory exactly once per expert. Against oneDNN's packed linear on
// the same experts, single-threaded with the weights streamed from memory, this read
// 33 against 19 GB/s at 6 rows and ran 440 against 337 GFLOP/s at 48 (bfloat16).
//
// The GEMMs accumulate in float32; their outputs, silu and the product round to the
// weights' dtype where transformers' expert MLP rounds (a bfloat16 model's routing in the
// next layer depends on it), the routing weight applies in float32, and each token's k
// expert rows are summed in float32 and rounded once.
//
// At a few rows per expert a GEMM is too small to split over threads: whole experts per
// thread, largest first, handed out dynamically, keeps the threads even when the counts
// are skewed. Rows go to the micro-kernel in blocks of at most kRowBlock, so the number of
// kernel shapes it generates and caches stays bounded whatever the counts.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <numeric>
#include <type_traits>
#include <vector>

#include "float_convert.h"
#include "out_tensor.h"

namespace {

using atom::exp_lanes;
using atom::from_float;
using atom::kLanes;
using atom::to_float;

constexpr int64_t kPanel = 64;     // NB: output columns per weight panel
constexpr int64_t kRowBlock = 32;  // rows per micro-kernel call
constexpr int64_t kChunkRows = 256;  // an expert's rows per pass over its weights (bounds the buffers)
// Up to this many bytes, the [tokens * k, hidden] float32 slot buffer is kept between calls:
// allocated fresh, its pages fault in at every call, ~20% of a 512-token layer's time.
constexpr size_t kKeptSlotBytes = size_t(256) << 20;

template <typename T>
constexpr bool kVnni = std::is_same_v<T, c10::BFloat16>;

// Padded K: bfloat16 pairs along K.
template <typename T>
int64_t padded_k(int64_t k) { return kVnni<T> ? (k + 1) / 2 * 2 : k; }

// C[rows, panels * NB] (float32, ld_c) = A[rows, K] (ld_a = K) @ the panels of one expert.
template <typename T>
void panel_gemm(const T* a, int64_t rows, int64_t k, const T* w, int64_t panels, float* c) {
  const int64_t ldc = panels * kPanel;
  for (int64_t p = 0; p < panels; ++p) {
    const T* wp = w + p * k * kPanel;
    for (int64_t m0 = 0; m0 < rows; m0 += kRowBlock)
      at::native::cpublas::brgemm(std::min(kRowBlock, rows - m0), kPanel, k, k, kPanel, ldc, false, a + m0 * k, wp,
                                  c + m0 * ldc + p * kPanel, kVnni<T>);
  }
}

// out[r, :inter] = silu(gate) * up of c's rows [gate | up], rounded as transformers rounds
// (each GEMM output to T, silu(gate) to T, the product to T: F.silu(gate) * up on T values,
// so a bfloat16 model routes its next layer as transformers' bfloat16 model does); pad columns zero.
template <typename T>
void silu_mul_rows(const float* c, int64_t rows, int64_t ldc, int64_t inter, T* out, int64_t ld_out) {
  std::vector<float> g(inter), e(inter + kLanes);
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = c + r * ldc;
    const float* up = gate + inter;
    for (int64_t i = 0; i < inter; ++i) {
      g[i] = to_float(from_float<T>(gate[i]));
      e[i] = -g[i];
    }
    int64_t i = 0;
    if constexpr (kLanes > 0)
      for (; i + kLanes <= inter; i += kLanes) exp_lanes(e.data() + i);
    for (; i < inter; ++i) e[i] = std::exp(e[i]);
    T* o = out + r * ld_out;
    for (int64_t j = 0; j < inter; ++j)
      o[j] = from_float<T>(to_float(from_float<T>(g[j] / (1.f + e[j]))) * to_float(from_float<T>(up[j])));
    for (int64_t j = inter; j < ld_out; ++j) o[j] = from_float<T>(0.f);
  }
}

template <typename T>
void experts_impl(const at::Tensor& hidden, const at::Tensor& order, const std::vector<int64_t>& counts,
                  const at::Tensor& weights, int64_t top_k, const at::Tensor& w13, const at::Tensor& w2,
                  int64_t inter, float* slots) {
  const int64_t hidden_size = hidden.size(1), k1 = padded_k<T>(hidden_size), k2 = padded_k<T>(inter);
  const int64_t panels13 = w13.size(1), panels2 = w2.size(1);
  const int64_t expert13 = panels13 * k1 * kPanel, expert2 = panels2 * k2 * kPanel;
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
  const T* hidden_p = hidden.data_ptr<T>();
  const T* w13_p = w13.data_ptr<T>();
  const T* w2_p = w2.data_ptr<T>();
  const int64_t* order_p = order.data_ptr<int64_t>();
  const float* weights_p = weights.data_ptr<float>();
  std::exception_ptr error = nullptr;
  const int64_t n_tasks = static_cast<int64_t>(by_size.size());
#pragma omp parallel num_threads(at::get_num_threads())
  {
    // this thread's buffers for one chunk of an expert's rows: reused across calls (grown
    // once, bounded by kChunkRows), so a call page-faults no fresh memory
    static thread_local std::vector<T> a1, a2;
    static thread_local std::vector<float> c1, c2;
#pragma omp for schedule(dynamic, 1)
    for (int64_t j = 0; j < n_tasks; ++j) {
      try {
        a1.resize(std::max<size_t>(a1.size(), kChunkRows * k1));
        c1.resize(std::max<size_t>(c1.size(), kChunkRows * panels13 * kPanel));
        a2.resize(std::max<size_t>(a2.size(), kChunkRows * k2));
        c2.resize(std::max<size_t>(c2.size(), kChunkRows * panels2 * kPanel));
        const int64_t i = by_size[j], e = experts[i];
        for (int64_t r0 = 0; r0 < counts[e]; r0 += kChunkRows) {
          const int64_t n = std::min(kChunkRows, counts[e] - r0);
          const int64_t* rows = order_p + starts[i] + r0;  // flat (token, slot) indices; token = row / top_k
          for (int64_t r = 0; r < n; ++r) {
            T* dst = a1.data() + r * k1;
            std::memcpy(dst, hidden_p + (rows[r] / top_k) * hidden_size, hidden_size * sizeof(T));
            if (k1 > hidden_size) dst[hidden_size] = from_float<T>(0.f);
          }
          panel_gemm<T>(a1.data(), n, k1, w13_p + e * expert13, panels13, c1.data());
          silu_mul_rows<T>(c1.data(), n, panels13 * kPanel, inter, a2.data(), k2);
          panel_gemm<T>(a2.data(), n, k2, w2_p + e * expert2, panels2, c2.data());
          const int64_t ldc2 = panels2 * kPanel;
          for (int64_t r = 0; r < n; ++r) {
            const float w = weights_p[rows[r]];
            const float* src = c2.data() + r * ldc2;
            float* dst = slots + rows[r] * hidden_size;
            for (int64_t c = 0; c < hidden_size; ++c) dst[c] = to_float(from_float<T>(src[c])) * w;  // the output in T, as transformers has it
          }
        }
      } catch (...) {
#pragma omp critical
        if (!error) error = std::current_exception();
      }
    }
    at::native::cpublas::brgemm_release(kVnni<T>);
  }
  if (error) std::rethrow_exception(error);
}

// hidden: [T, H]; order: [T*k] flat (token, slot) assignments sorted by expert, counts[e] of
// them for expert e; weights: [T*k] float32 routing weights in flat order; w13: packed
// [E, panels, K, NB] (bfloat16: [E, panels, K/2, NB, 2]) of the [2I, H] gate-then-up rows,
// w2 the same of [H, I]. Returns each token's weighted sum over its k experts, [T, H] in
// hidden's dtype. Each task gathers its own rows and writes rows no other task writes, so
// the sum over slots needs no atomics.
at::Tensor experts_forward(const at::Tensor& hidden, const at::Tensor& order, const at::Tensor& expert_counts,
                           const at::Tensor& weights, int64_t top_k, const at::Tensor& w13, const at::Tensor& w2,
                           int64_t inter, const c10::optional<at::Tensor>& out) {
  // a tensor (not a list): a recorded decode graph replays the call with this step's counts
  TORCH_CHECK(expert_counts.scalar_type() == at::kLong && expert_counts.dim() == 1 && expert_counts.is_contiguous() &&
                  expert_counts.device().is_cpu(),
              "counts must be a contiguous 1-D int64 CPU tensor");
  const std::vector<int64_t> counts(expert_counts.data_ptr<int64_t>(),
                                    expert_counts.data_ptr<int64_t>() + expert_counts.numel());
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "hidden must be contiguous [tokens, hidden], got ",
              hidden.sizes());
  TORCH_CHECK(order.numel() == hidden.size(0) * top_k && weights.numel() == order.numel(),
              "order and weights must hold tokens * top_k = ", hidden.size(0) * top_k, " entries");
  TORCH_CHECK(order.scalar_type() == at::kLong && weights.scalar_type() == at::kFloat && order.is_contiguous() &&
                  weights.is_contiguous(),
              "order must be contiguous int64, weights contiguous float32");
  TORCH_CHECK(w13.scalar_type() == hidden.scalar_type() && w2.scalar_type() == hidden.scalar_type(),
              "hidden and the packed experts must share a dtype, got ", hidden.scalar_type(), " and ",
              w13.scalar_type());
  TORCH_CHECK(static_cast<int64_t>(counts.size()) == w13.size(0) && w13.size(0) == w2.size(0),
              "counts, w13 and w2 must have one entry per expert, got ", counts.size(), ", ", w13.size(0), ", ",
              w2.size(0));
  TORCH_CHECK(std::accumulate(counts.begin(), counts.end(), int64_t{0}) == order.numel(), "counts must sum to ",
              order.numel(), " assignments");
  TORCH_CHECK(w13.size(1) * kPanel >= 2 * inter && w2.size(1) * kPanel >= hidden.size(1),
              "packed experts too narrow for intermediate ", inter, " and hidden ", hidden.size(1));
  const int64_t tokens = hidden.size(0), hidden_size = hidden.size(1);
  const size_t slot_count = static_cast<size_t>(order.numel() * hidden_size);
  static thread_local std::vector<float> kept;
  std::vector<float> fresh;
  std::vector<float>& slot_buffer = slot_count * sizeof(float) <= kKeptSlotBytes ? kept : fresh;
  if (slot_buffer.size() < slot_count) slot_buffer.resize(slot_count);
  float* slots = slot_buffer.data();
  if (hidden.scalar_type() == at::kBFloat16) {
    experts_impl<c10::BFloat16>(hidden, order, counts, weights, top_k, w13, w2, inter, slots);
  } else {
    TORCH_CHECK(hidden.scalar_type() == at::kFloat, "experts run in float32 or bfloat16, not ", hidden.scalar_type());
    experts_impl<float>(hidden, order, counts, weights, top_k, w13, w2, inter, slots);
  }
  // each token's sum over its k slots, in float32, written once in hidden's dtype
  at::Tensor result = atom::output(out, {tokens, hidden_size}, hidden.options(), "experts_forward");
  auto reduce = [&](auto* dst_p) {
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(hidden_size);
      for (int64_t t = begin; t < end; ++t) {
        const float* src = slots + t * top_k * hidden_size;
        std::memcpy(acc.data(), src, hidden_size * sizeof(float));
        for (int64_t j = 1; j < top_k; ++j)
          for (int64_t c = 0; c < hidden_size; ++c) acc[c] += src[j * hidden_size + c];
        auto* dst = dst_p + t * hidden_size;
        for (int64_t c = 0; c < hidden_size; ++c) dst[c] = from_float<std::remove_pointer_t<decltype(dst)>>(acc[c]);
      }
    });
  };
  if (result.scalar_type() == at::kBFloat16) reduce(result.data_ptr<c10::BFloat16>());
  else reduce(result.data_ptr<float>());
  return result;
}

// Whether the micro-kernel runs here for this dtype (torch builds without oneDNN's
// micro-kernels, or a CPU it does not support, raise): one small product, checked.
bool usable(at::ScalarType dtype) {
  try {
    const int64_t m = 3, k = 4, n = kPanel;
    at::Tensor a = at::ones({m, k}, at::TensorOptions().dtype(dtype));
    at::Tensor w = at::ones({k * n}, at::TensorOptions().dtype(dtype));
    std::vector<float> c(m * n, 0.f);
    if (dtype == at::kBFloat16)
      at::native::cpublas::brgemm(m, n, k, k, n, n, false, a.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(),
                                  c.data(), true);
    else
      at::native::cpublas::brgemm(m, n, k, k, n, n, false, a.data_ptr<float>(), w.data_ptr<float>(), c.data(), false);
    at::native::cpublas::brgemm_release(dtype == at::kBFloat16);
    return std::all_of(c.begin(), c.end(), [](float v) { return v == 4.f; });
  } catch (...) {
    return false;
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("experts_forward", &experts_forward,
        "weighted MoE expert outputs summed per token; experts spread over threads (CPU, oneDNN micro-kernel)",
        py::arg("hidden"), py::arg("order"), py::arg("counts"), py::arg("weights"), py::arg("top_k"), py::arg("w13"),
        py::arg("w2"), py::arg("inter"), py::arg("out") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("usable", [](const at::Tensor& like) { return usable(like.scalar_type()); },
        "whether the experts' micro-kernel runs here for this tensor's dtype");
  m.attr("PANEL") = kPanel;
}
