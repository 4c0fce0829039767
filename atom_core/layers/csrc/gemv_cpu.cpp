// Skinny GEMM for decode steps: y[M, N] = x[M, K] @ w[N, K]^T (+ bias) for M of 1 to 8 rows.
//
// At a few rows a Linear is a stream over its weight: each weight is read once and used M
// times, so the kernel's job is to keep the memory bus busy. oneDNN's packed GEMM reads
// SmolLM2's weights at 17-24 GB/s at one row on this 2-core machine, against ~30 GB/s
// copy bandwidth. Here each thread takes a contiguous run of output rows and walks R of
// them side by side while prefetching the next R rows into L2: a tile of rows is only a
// few KiB, too short for the hardware prefetcher to ramp up on (this took float32 from 27
// to 35 GB/s at one row). x stays in L1/L2; products accumulate in float32 (bfloat16
// pairs through vdpbf16ps when x is bfloat16 too, else widened exactly), and each output
// rounds once to the activation dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "float_convert.h"

namespace {

using atom::from_float;
using atom::to_float;

// 16 weights widened to float32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// R weight rows starting at `w` against the M rows of x: out[m * R + r] = sum_k x[m][k] * w[r][k].
template <typename W, int M, int R>
inline void tile(const float* x, int64_t K, const W* w, int64_t ldw, float* out) {
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[R];
    for (int r = 0; r < R; ++r) {
      if (sizeof(W) == 4 || (k & 31) == 0)  // a cache line of the next tile's rows
        _mm_prefetch(reinterpret_cast<const char*>(w + (r + R) * ldw + k), _MM_HINT_T1);
      wv[r] = load16(w + r * ldw + k);
    }
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
  if (k < K) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1u);
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load16(w + r * ldw + k, mask);
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * K + k);
      for (int r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) out[m * R + r] = _mm512_reduce_add_ps(acc[r][m]);
}

// bfloat16 weights against bfloat16 activations: pairs of exact products summed in float32
// (`vdpbf16ps`), 32 weights per instruction; xb is x as bfloat16, K padded to even.
template <int M, int R>
inline void tile_bf16(const c10::BFloat16* xb, int64_t K, const c10::BFloat16* w, int64_t ldw, float* out) {
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (r + R) * ldw + k), _MM_HINT_T1);  // the next tile
      wv[r] = (__m512bh)_mm512_loadu_si512(w + r * ldw + k);
    }
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + m * K + k);
      for (int r = 0; r < R; ++r) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv[r], xv);
    }
  }
  if (k < K) {
    const __mmask32 mask = static_cast<__mmask32>((1ull << (K - k)) - 1ull);
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * ldw + k);
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, xb + m * K + k);
      for (int r = 0; r < R; ++r) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv[r], xv);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) out[m * R + r] = _mm512_reduce_add_ps(acc[r][m]);
}

// Rows [begin, end) of w for all M rows of x, written to y (dtype T, row stride ldy). X is
// float (x widened once) or, with bfloat16 weights and activations, bfloat16 itself.
template <typename W, typename X, typename T, int M>
void run_rows(const X* x, int64_t K, const W* w, const float* bias, T* y, int64_t ldy, int64_t begin, int64_t end) {
  // R * M accumulators stay within 32 registers; one row of x streams 8 weight rows at once.
  constexpr int R = M == 1 ? 8 : (M <= 2 ? 4 : (M <= 4 ? 3 : 2));
  float part[M * R];
  int64_t n = begin;
  auto store = [&](int rows) {
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < rows; ++r) y[m * ldy + n + r] = from_float<T>(part[m * R + r] + (bias ? bias[n + r] : 0.f));
  };
  auto run = [&](auto rows_tag, const W* wr, float* out) {
    constexpr int RT = decltype(rows_tag)::value;
    if constexpr (std::is_same_v<X, c10::BFloat16>) tile_bf16<M, RT>(x, K, wr, K, out);
    else tile<W, M, RT>(x, K, wr, K, out);
  };
  for (; n + R <= end; n += R) {
    run(std::integral_constant<int, R>{}, w + n * K, part);
    store(R);
  }
  for (; n < end; ++n) {
    float one[M];
    run(std::integral_constant<int, 1>{}, w + n * K, one);
    for (int m = 0; m < M; ++m) part[m * R] = one[m];
    store(1);
  }
}

template <typename W, typename X, typename T, int M>
void gemv_impl(const X* x, int64_t K, const W* w, int64_t N, const float* bias, T* y) {
  // Whole runs of rows per thread (each a long sequential stream), at least 64 rows each.
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) { run_rows<W, X, T, M>(x, K, w, bias, y, N, begin, end); });
}

template <typename W, typename X, typename T>
void dispatch_m(int64_t M, const X* x, int64_t K, const W* w, int64_t N, const float* bias, T* y) {
  switch (M) {
    case 1: return gemv_impl<W, X, T, 1>(x, K, w, N, bias, y);
    case 2: return gemv_impl<W, X, T, 2>(x, K, w, N, bias, y);
    case 3: return gemv_impl<W, X, T, 3>(x, K, w, N, bias, y);
    case 4: return gemv_impl<W, X, T, 4>(x, K, w, N, bias, y);
    case 5: return gemv_impl<W, X, T, 5>(x, K, w, N, bias, y);
    case 6: return gemv_impl<W, X, T, 6>(x, K, w, N, bias, y);
    case 7: return gemv_impl<W, X, T, 7>(x, K, w, N, bias, y);
    case 8: return gemv_impl<W, X, T, 8>(x, K, w, N, bias, y);
  }
}

}  // namespace

constexpr int64_t MAX_ROWS = 8;

at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "gemv runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv takes x [M, K] and w [N, K]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= MAX_ROWS, "gemv takes 1 to ", MAX_ROWS, " rows, got ", x.size(0));
  TORCH_CHECK(w.is_contiguous(), "gemv weight must be contiguous");
  const auto wt = w.scalar_type(), xt = x.scalar_type();
  TORCH_CHECK(wt == at::kFloat || wt == at::kBFloat16, "gemv weights are float32 or bfloat16, not ", wt);
  TORCH_CHECK(xt == at::kFloat || xt == at::kBFloat16, "gemv activations are float32 or bfloat16, not ", xt);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor bf;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "gemv bias must have ", N, " values");
    bf = bias->to(at::kFloat).contiguous();
  }
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  auto y = at::empty({M, N}, x.options());
  if (wt == at::kBFloat16 && xt == at::kBFloat16) {
    const at::Tensor xc = x.contiguous();
    dispatch_m(M, xc.data_ptr<c10::BFloat16>(), K, w.data_ptr<c10::BFloat16>(), N, bp, y.data_ptr<c10::BFloat16>());
    return y;
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  if (wt == at::kFloat) {
    const float* wp = w.data_ptr<float>();
    if (xt == at::kFloat) dispatch_m(M, xp, K, wp, N, bp, y.data_ptr<float>());
    else dispatch_m(M, xp, K, wp, N, bp, y.data_ptr<c10::BFloat16>());
  } else {
    const c10::BFloat16* wp = w.data_ptr<c10::BFloat16>();
    dispatch_m(M, xp, K, wp, N, bp, y.data_ptr<float>());  // float32 activations
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "y = x @ w.T (+ bias) for 1 to 8 rows of x, weight-streaming (CPU)");
  m.attr("MAX_ROWS") = MAX_ROWS;
}
