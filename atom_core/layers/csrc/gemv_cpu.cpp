// Skinny GEMM for decode steps: y[M, N] = x[M, K] @ w[N, K]^T (+ bias) for M of 1 to 8 rows.
//
// At a few rows a Linear is a stream over its weight: each weight is read once and used M
// times, so the kernel's job is to keep the memory bus busy. oneDNN's packed GEMM reads
// SmolLM2's weights at 17-24 GB/s at one row on this 2-core machine. Each thread takes a
// contiguous run of output rows. Where the weight stream is the limit (bfloat16 weights
// at 1-8 rows, float32 at 1-5) the thread reads them one whole row after another, each line
// prefetched (non-temporal) PREFETCH_ROWS rows ahead: on the EPYC this was measured on,
// 11-27% faster than walking several rows side by side, which had won on the earlier
// machine (27 -> 35 GB/s float32), and at float32's 4 and 5 rows 25% faster than 3 rows side
// by side (45 against 36 GB/s, copy 43). Where the arithmetic sets the pace (float32 at 6-8
// rows) 3 rows go side by side, so that each load of x serves 3 of them. x stays in
// L1/L2; products accumulate in float32 (bfloat16 pairs through vdpbf16ps when x is
// bfloat16 too, in two chains per output, see `row_bf16`; else widened exactly, one chain
// per output in k order in both layouts), and each output rounds once to the activation
// dtype. The weights themselves sit in 2 MiB pages (`memory.weight_arena`).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "float_convert.h"

// The loops over a tile's rows (R, M, MB: compile-time constants) unroll fully, so that
// their accumulators live in registers: left to itself GCC 12 kept those of 2- and 3-row
// tiles in stack memory, one store and reload per FMA (in cache, 3 rows of float32 ran at a
// third of the speed of 4).
#define UNROLL _Pragma("GCC unroll 16")

namespace {

using atom::from_float;
using atom::to_float;

// 16 values (weights, or activations) widened to float32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// How many rows ahead a streamed weight row is prefetched.
constexpr int64_t PREFETCH_ROWS = 4;

// The cache line at `p` some rows ahead (streaming one weight row after another:
// PREFETCH_ROWS; side by side: the next tile of R), non-temporal, so that the weights, read
// once a step, do not evict from L2 and L3 what the rest of the step works on (the
// interpreter, the small tensors of norms and attention): batch-1 decode 4-8% faster in
// bfloat16 and at 4 bits, level in float32; float32 at 4-8 rows read 0-13% faster.
template <bool STREAM, int R, typename W>
inline void prefetch_line(const W* p, int64_t ldw) {
  _mm_prefetch(reinterpret_cast<const char*>(p + (STREAM ? PREFETCH_ROWS : R) * ldw), _MM_HINT_NTA);
}

// R weight rows starting at `w` against the M rows of x: out[m * R + r] = sum_k x[m][k] * w[r][k].
template <typename W, int M, int R, bool STREAM>
inline void tile(const float* x, int64_t K, const W* w, int64_t ldw, float* out) {
  __m512 acc[R][M];
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[R];
    UNROLL for (int r = 0; r < R; ++r) {
      if (sizeof(W) == 4 || (k & 31) == 0) prefetch_line<STREAM, R>(w + r * ldw + k, ldw);
      wv[r] = load16(w + r * ldw + k);
    }
    UNROLL for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * K + k);
      UNROLL for (int r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
  if (k < K) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1u);
    __m512 wv[R];
    UNROLL for (int r = 0; r < R; ++r) wv[r] = load16(w + r * ldw + k, mask);
    UNROLL for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * K + k);
      UNROLL for (int r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
  UNROLL for (int m = 0; m < M; ++m)
    UNROLL for (int r = 0; r < R; ++r) out[m * R + r] = _mm512_reduce_add_ps(acc[r][m]);
}

// One bfloat16 weight row against M rows of bfloat16 activations: pairs of exact products
// summed in float32 (`vdpbf16ps`), 32 weights per instruction. Each output keeps two chains,
// the blocks of 32 at even and at odd positions along k, added before the lane sum: with
// one chain, vdpbf16ps's 6-cycle latency set the pace at 6-8 rows (in cache, 8 rows: 58-66
// -> 66-75 GB/s; from memory in fast spells, 6 rows: 78-80% -> 86-87% of copy bandwidth,
// 8 rows: 70-72% -> 75-77%). Every M sums alike, so a row computes alike at 1 to 8 rows.
template <int M, bool STREAM>
inline void row_bf16(const c10::BFloat16* xb, int64_t K, const c10::BFloat16* w, int64_t ldw, float* out) {
  __m512 even[M], odd[M];
  UNROLL for (int m = 0; m < M; ++m) even[m] = odd[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    prefetch_line<STREAM, 1>(w + k, ldw);
    prefetch_line<STREAM, 1>(w + k + 32, ldw);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k), w1 = (__m512bh)_mm512_loadu_si512(w + k + 32);
    UNROLL for (int m = 0; m < M; ++m) {
      even[m] = _mm512_dpbf16_ps(even[m], w0, (__m512bh)_mm512_loadu_si512(xb + m * K + k));
      odd[m] = _mm512_dpbf16_ps(odd[m], w1, (__m512bh)_mm512_loadu_si512(xb + m * K + k + 32));
    }
  }
  // Up to two blocks remain, the first at an even position (whole or not), the second odd.
  auto block = [&](__m512(&acc)[M], int64_t k0) {
    const int64_t n = K - k0 < 32 ? K - k0 : 32;
    const __mmask32 mask = n == 32 ? ~__mmask32(0) : static_cast<__mmask32>((1u << n) - 1u);
    if (n == 32) prefetch_line<STREAM, 1>(w + k0, ldw);
    const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + k0);
    UNROLL for (int m = 0; m < M; ++m)
      acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_maskz_loadu_epi16(mask, xb + m * K + k0));
  };
  if (k < K) block(even, k);
  if (k + 32 < K) block(odd, k + 32);
  UNROLL for (int m = 0; m < M; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(even[m], odd[m]));
}

// Rows [begin, end) of w for all M rows of x, written to y (dtype T, row stride ldy). X is
// float (x widened once) or, with bfloat16 weights and activations, bfloat16 itself.
template <typename W, typename X, typename T, int M>
void run_rows(const X* x, int64_t K, const W* w, const float* bias, T* y, int64_t ldy, int64_t begin, int64_t end) {
  // Where the stream is the limit (STREAM: bfloat16 weights, or float32 at up to 5 rows of
  // x): one weight row at a time, each line prefetched PREFETCH_ROWS rows ahead. Otherwise R
  // weight rows side by side, so that each load of x serves R rows, the next R rows
  // prefetched line by line. Every output sums its products in one order whatever M and
  // R: a row of x computes alike at 1 to 8 rows.
  constexpr bool STREAM = sizeof(W) == 2 ? M <= 8 : M <= 5;
  constexpr int R = STREAM ? 1 : 3;
  float part[M * R];
  int64_t n = begin;
  auto store = [&](int rows) {
    UNROLL for (int m = 0; m < M; ++m)
      for (int r = 0; r < rows; ++r) y[m * ldy + n + r] = from_float<T>(part[m * R + r] + (bias ? bias[n + r] : 0.f));
  };
  auto run = [&](auto rows_tag, const W* wr, float* out) {
    constexpr int RT = decltype(rows_tag)::value;
    if constexpr (std::is_same_v<X, c10::BFloat16>) {
      static_assert(RT == 1, "bfloat16 weights stream one row at a time");
      row_bf16<M, STREAM>(x, K, wr, K, out);
    } else {
      tile<W, M, RT, STREAM>(x, K, wr, K, out);
    }
  };
  for (; n + R <= end; n += R) {
    run(std::integral_constant<int, R>{}, w + n * K, part);
    store(R);
  }
  for (; n < end; ++n) {
    float one[M];
    run(std::integral_constant<int, 1>{}, w + n * K, one);
    UNROLL for (int m = 0; m < M; ++m) part[m * R] = one[m];
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


// ---- 4- and 8-bit groups of 32 (GGUF Q4_0/Q4_1/Q8_0, Config.quantization int4/int8) ----------
//
// w = q * d + m per group of 32 along K, d and m in float16 (exact for GGUF's Q4_0/Q4_1/Q8_0).
// 4 bits: q in 0..15, m = zero - 8 * scale in quant.py's terms (the group minimum for Q4_1).
// 8 bits: q + 128 in 0..255, m = -128 d.
//
// Each row of x becomes int16 values per group of 32, x = dx q16 with dx = max|x| / 32767
// (about 16 significant bits, where llama.cpp's int8 vector keeps 8 and bfloat16 keeps 8).
// The weight is packed in tiles of 16 output columns (quant.py's `StreamingGroupGemm`): for
// each tile and group, 16 vectors W_p (p = 0..15), lane c of W_p holding column c's two
// values at k = 2p, 2p + 1 as int16 pairs. One vpdpwssd of W_p against the broadcast pair
// (x_2p, x_2p+1) adds 32 products into the 16 columns' int32 sums, so a group takes 16 of
// them per row (exact integers), then one conversion and two fused multiply-adds add
// d dx sum(q q16) + m sum(x) to the 16 columns' float sums. No horizontal reductions, and
// each unpacked W_p serves up to 8 rows of x. 4 bits: a tile-group is 256 bytes, 64 for
// each W_4j .. W_4j+3, whose values at lane i sit in the four nibbles of int16 i (one and
// or shift a vector to unpack). 8 bits: 512 bytes, W_p's 32 bytes in order.
//
// Every output is computed by the same instructions in the same order whatever the number
// of rows M and wherever the row sits in the batch (integer sums are exact, the float ones
// go group by group): the kernel is batch-invariant, which is what speculative decoding's
// verify step needs.

constexpr int64_t QROWS = 8;  // rows of x each unpacked weight vector serves
constexpr int64_t PREFETCH_GROUPS = 32;  // how far ahead in a tile's stream (8 KiB at 4 bits)

// x as int16 per group of 32, with dx and the float32 sum of each group.
struct Q16Rows {
  std::vector<int16_t> q;  // [M][K]
  std::vector<float> scale, sum;  // [M][K / 32]
};

template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, Q16Rows& out) {
  const int64_t groups = M * K / 32;
  out.q.resize(M * K);
  out.scale.resize(groups);
  out.sum.resize(groups);
  // Groups are independent: a prefill's worth (512 x 1536 values) is split over the threads.
  at::parallel_for(0, groups, 256, [&](int64_t begin, int64_t end) {
  for (int64_t g = begin; g < end; ++g) {
    const __m512 a = load16(x + g * 32), b = load16(x + g * 32 + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
    int16_t* q = out.q.data() + g * 32;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(a, inv))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(b, inv))));
    out.scale[g] = amax / 32767.f;
    out.sum[g] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
  }
  });
}

// W_4j .. W_4j+3 of a tile-group.
template <int BITS>
inline void load_w(const uint8_t* tg, int j, __m512i (&w)[4]) {
  if constexpr (BITS == 4) {  // int16 lane i: the four vectors' values in its four nibbles
    const __m512i v = _mm512_loadu_si512(tg + j * 64), mask = _mm512_set1_epi16(0x0F);
    w[0] = _mm512_and_si512(v, mask);
    w[1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
    w[2] = _mm512_and_si512(_mm512_srli_epi16(v, 8), mask);
    w[3] = _mm512_srli_epi16(v, 12);
  } else {
    UNROLL for (int h = 0; h < 4; ++h)
      w[h] = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tg + (4 * j + h) * 32)));
  }
}

// Columns [16 t, 16 t + cols) for rows m0 .. m0 + MB of x.
template <int MB, int BITS, typename T>
void qgemm_tile(const Q16Rows& xs, int64_t m0, int64_t K, const uint8_t* wt, const c10::Half* dt,
                const c10::Half* mt, const float* bias, T* y, int64_t N, int64_t n0, int cols) {
  constexpr int64_t GROUP_BYTES = BITS * 64;  // 16 columns x 32 values
  const int64_t groups = K / 32;
  __m512 acc[MB];
  UNROLL for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* tg = wt + g * GROUP_BYTES;
    for (int64_t off = 0; off < GROUP_BYTES; off += 64)  // a few groups ahead: the tile is one stream
      _mm_prefetch(reinterpret_cast<const char*>(tg + PREFETCH_GROUPS * GROUP_BYTES + off), _MM_HINT_NTA);
    _mm_prefetch(reinterpret_cast<const char*>(dt + (g + PREFETCH_GROUPS) * 16), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(mt + (g + PREFETCH_GROUPS) * 16), _MM_HINT_T1);
    // Chains of integer sums a row: exact, so how they are split is free. A single row gets
    // four, or the dpwssd latency (not the weight stream) would set the pace: a 1-row LM
    // head ran slower than a 2-row one.
    constexpr int CH = MB == 1 ? 4 : 2;
    __m512i sums[MB][CH];
    UNROLL for (int m = 0; m < MB; ++m)
      UNROLL for (int c = 0; c < CH; ++c) sums[m][c] = _mm512_setzero_si512();
    UNROLL for (int j = 0; j < 4; ++j) {
      __m512i w[4];
      load_w<BITS>(tg, j, w);
      UNROLL for (int m = 0; m < MB; ++m) {
        const int32_t* xp = reinterpret_cast<const int32_t*>(xs.q.data() + (m0 + m) * K + g * 32) + 4 * j;
        UNROLL for (int h = 0; h < 4; ++h)
          sums[m][h % CH] = _mm512_dpwssd_epi32(sums[m][h % CH], w[h], _mm512_set1_epi32(xp[h]));
      }
    }
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dt + g * 16)));
    const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mt + g * 16)));
    UNROLL for (int m = 0; m < MB; ++m) {
      const int64_t xg = (m0 + m) * groups + g;
      __m512i total = sums[m][0];
      UNROLL for (int c = 1; c < CH; ++c) total = _mm512_add_epi32(total, sums[m][c]);
      const __m512 dot = _mm512_cvtepi32_ps(total);
      acc[m] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dv, _mm512_set1_ps(xs.scale[xg])), acc[m]);
      acc[m] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs.sum[xg]), acc[m]);
    }
  }
  UNROLL for (int m = 0; m < MB; ++m) {
    alignas(64) float out[16];
    _mm512_store_ps(out, acc[m]);
    T* row = y + (m0 + m) * N + n0;
    for (int c = 0; c < cols; ++c) row[c] = from_float<T>(out[c] + (bias ? bias[n0 + c] : 0.f));
  }
}

template <int BITS, typename T>
void qgemm_block(int MB, const Q16Rows& xs, int64_t m0, int64_t K, const uint8_t* wt, const c10::Half* dt,
                 const c10::Half* mt, const float* bias, T* y, int64_t N, int64_t n0, int cols) {
  switch (MB) {
    case 1: return qgemm_tile<1, BITS>(xs, m0, K, wt, dt, mt, bias, y, N, n0, cols);
    case 2: return qgemm_tile<2, BITS>(xs, m0, K, wt, dt, mt, bias, y, N, n0, cols);
    case 3: return qgemm_tile<3, BITS>(xs, m0, K, wt, dt, mt, bias, y, N, n0, cols);
    case 4: return qgemm_tile<4, BITS>(xs, m0, K, wt, dt, mt, bias, y, N, n0, cols);
    case 5: return qgemm_tile<5, BITS>(xs, m0, K, wt, dt, mt, bias, y, N, n0, cols);
    case 6: return qgemm_tile<6, BITS>(xs, m0, K, wt, dt, mt, bias, y, N, n0, cols);
    case 7: return qgemm_tile<7, BITS>(xs, m0, K, wt, dt, mt, bias, y, N, n0, cols);
    default: return qgemm_tile<8, BITS>(xs, m0, K, wt, dt, mt, bias, y, N, n0, cols);
  }
}

at::Tensor qgemm(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& d, const at::Tensor& mn, int64_t N,
                 const c10::optional<at::Tensor>& bias) {
  const auto xt = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && (xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf),
              "qgemm takes x [M, K], float32, bfloat16 or float16, on CPU");
  const int64_t M = x.size(0), K = x.size(1), groups = K / 32, tiles = (N + 15) / 16;
  TORCH_CHECK(K % 32 == 0 && K > 0, "qgemm takes K a multiple of 32, got ", K);
  TORCH_CHECK(qw.scalar_type() == at::kByte && qw.is_contiguous() && qw.dim() == 3 && qw.size(0) == tiles &&
                  qw.size(1) == groups && (qw.size(2) == 256 || qw.size(2) == 512),
              "qgemm weight must be uint8 [ceil(N / 16), K / 32, 256 (4 bits) or 512 (8 bits)]");
  TORCH_CHECK(d.scalar_type() == at::kHalf && mn.scalar_type() == at::kHalf && d.is_contiguous() && mn.is_contiguous() &&
                  d.numel() == tiles * groups * 16 && mn.numel() == tiles * groups * 16,
              "qgemm scales and mins must be float16 [ceil(N / 16), K / 32, 16]");
  const int bits = qw.size(2) == 256 ? 4 : 8;
  const at::Tensor xc = x.contiguous();
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  at::Tensor bf;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "qgemm bias must have N = ", N, " values, got ", bias->numel());
    bf = bias->to(at::kFloat).contiguous();
  }
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  const uint8_t* qp = qw.data_ptr<uint8_t>();
  const c10::Half* dp = d.data_ptr<c10::Half>();
  const c10::Half* mp = mn.data_ptr<c10::Half>();
  Q16Rows xs;
  auto run = [&](auto bits_tag, auto* yp) {
    constexpr int B = decltype(bits_tag)::value;
    const int64_t tile_bytes = groups * B * 64;
    at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t m0 = 0; m0 < M; m0 += QROWS)  // past 8 rows the tile comes from cache
          qgemm_block<B>(static_cast<int>(std::min(QROWS, M - m0)), xs, m0, K, qp + t * tile_bytes,
                         dp + t * groups * 16, mp + t * groups * 16, bp, yp, N, t * 16,
                         static_cast<int>(std::min<int64_t>(16, N - t * 16)));
    });
  };
  auto with_bits = [&](auto* yp) {
    if (bits == 4) run(std::integral_constant<int, 4>{}, yp);
    else run(std::integral_constant<int, 8>{}, yp);
  };
  if (xt == at::kFloat) {
    quantize_rows(xc.data_ptr<float>(), M, K, xs);
    with_bits(y.data_ptr<float>());
  } else if (xt == at::kBFloat16) {
    quantize_rows(xc.data_ptr<c10::BFloat16>(), M, K, xs);
    with_bits(y.data_ptr<c10::BFloat16>());
  } else {
    quantize_rows(xc.data_ptr<c10::Half>(), M, K, xs);
    with_bits(y.data_ptr<c10::Half>());
  }
  return y;
}

// Also torch ops, `atom_gemv::gemv` and `atom_gemv::qgemm`, so a traced graph (`atom_core.compile`) can call them.
TORCH_LIBRARY(atom_gemv, m) {
  m.def("gemv(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("qgemm(Tensor x, Tensor qw, Tensor d, Tensor mn, int N, Tensor? bias) -> Tensor");
}
TORCH_LIBRARY_IMPL(atom_gemv, CPU, m) {
  m.impl("gemv", &gemv);
  m.impl("qgemm", &qgemm);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "y = x @ w.T (+ bias) for 1 to 8 rows of x, weight-streaming (CPU)");
  m.def("qgemm", &qgemm, "y = x @ w.T (+ bias), w in 4- or 8-bit groups of 32 (q * d + m) packed in tiles of 16 columns, any rows of x, batch-invariant (CPU)");
  m.attr("MAX_ROWS") = MAX_ROWS;
}
