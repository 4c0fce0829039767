// Skinny GEMM for decode steps: y[M, N] = x[M, K] @ w[N, K]^T (+ bias) for M of 1 to 8 rows.
//
// At a few rows a Linear is a stream over its weight: each weight is read once and used M
// times, so the kernel's job is to keep the memory bus busy. oneDNN's packed GEMM reads
// SmolLM2's weights at 17-24 GB/s at one row on this 2-core machine.
//
// The weight is laid out for this kernel (linear.py's `gemv_weight`): tiles of 32 output
// rows, and within a tile, for each k (bfloat16: each pair k, k + 1), the 32 rows' values
// side by side: 128 bytes, two vectors whose lane c belongs to output row c. A tile is one
// sequential stream, which this host serves best (each variant that read two streams side
// by side lost from memory), and x is broadcast: one load of x serves 32 outputs, and no
// output needs a horizontal sum. The row-major kernel it replaced loaded x once per 16 or
// 32 weights and summed each output across lanes; at 6-8 rows that set the pace, not the
// memory (in cache, one core, 8 rows: bfloat16 37-41 -> 58-60 GB/s, float32 32-46 -> 58-59;
// from memory in fast spells, copy 76-82 GB/s: bfloat16 66-72% -> 77-83% of copy, float32
// 71-75% -> 87-92%). Each thread takes a contiguous run of tiles, each line prefetched
// (non-temporal) PREFETCH_BYTES ahead. x stays in L1/L2.
//
// Each output is one chain of float32 sums in k order: fused multiply-adds of the widened
// values, or with bfloat16 weights and activations one vdpbf16ps per pair (its two products
// added into the chain in turn, each rounded, as this host computes it). Every output sums alike whatever M and
// wherever its row sits in a tile, so a row computes alike at 1 to 8 rows and a column alike
// in any subset of the weight's rows (the LM head screen's exact recomputation relies on
// it). Each output rounds once to the activation dtype. The weights themselves sit in 2 MiB
// pages (`memory.weight_arena`).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "float_convert.h"

// The loops over a tile's rows (M, MB: compile-time constants) unroll fully, so that their
// accumulators live in registers: left to itself GCC 12 kept those of small tiles in stack
// memory, one store and reload per FMA.
#define UNROLL _Pragma("GCC unroll 16")

namespace {

using atom::from_float;
using atom::to_float;

// 16 values (activations) widened to float32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

constexpr int64_t TILE = 32;  // output rows per tile: two vectors
// How far ahead in a tile's stream each line is prefetched: 8 KiB read 2-6% faster than 4
// at 6-8 rows (in fast spells) and level at 1-2.
constexpr int64_t PREFETCH_BYTES = 8192;

inline void prefetch_step(const void* p) {
  const char* c = static_cast<const char*>(p) + PREFETCH_BYTES;
  _mm_prefetch(c, _MM_HINT_NTA);
  _mm_prefetch(c + 64, _MM_HINT_NTA);
}

// One tile against the M rows of x (row stride K, the tile's padded K): acc[h][m] holds
// outputs 16 h .. 16 h + 15 of row m.
template <int M>
inline void tile_f32(const float* x, int64_t K, const float* w, __m512 (&acc)[2][M]) {
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * TILE;
    prefetch_step(wk);
    const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16);
    UNROLL for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * K + k]);
      acc[0][m] = _mm512_fmadd_ps(w0, xv, acc[0][m]);
      acc[1][m] = _mm512_fmadd_ps(w1, xv, acc[1][m]);
    }
  }
}

// bfloat16 weights (lane c of a pair's vector: row c's values at k and k + 1, low half first)
// against float32 activations: both values widened exactly, two fused multiply-adds.
template <int M>
inline void tile_bf16_f32(const float* x, int64_t K, const c10::BFloat16* w, __m512 (&acc)[2][M]) {
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t k = 0; k < K; k += 2) {
    const c10::BFloat16* wk = w + k * TILE;
    prefetch_step(wk);
    __m512 even[2], odd[2];
    UNROLL for (int h = 0; h < 2; ++h) {
      const __m512i v = _mm512_loadu_si512(wk + 32 * h);
      even[h] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      odd[h] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
    }
    UNROLL for (int m = 0; m < M; ++m) {
      const __m512 x0 = _mm512_set1_ps(x[m * K + k]), x1 = _mm512_set1_ps(x[m * K + k + 1]);
      UNROLL for (int h = 0; h < 2; ++h) acc[h][m] = _mm512_fmadd_ps(odd[h], x1, _mm512_fmadd_ps(even[h], x0, acc[h][m]));
    }
  }
}

// bfloat16 weights and activations: one vdpbf16ps per pair (x's pair broadcast as 32 bits).
template <int M>
inline void tile_bf16(const c10::BFloat16* x, int64_t K, const c10::BFloat16* w, __m512 (&acc)[2][M]) {
  const int32_t* pairs = reinterpret_cast<const int32_t*>(x);
  const int64_t P = K / 2;
  for (int64_t p = 0; p < P; ++p) {
    const c10::BFloat16* wp = w + p * 2 * TILE;
    prefetch_step(wp);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
    UNROLL for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pairs[m * P + p]);
      acc[0][m] = _mm512_dpbf16_ps(acc[0][m], w0, xv);
      acc[1][m] = _mm512_dpbf16_ps(acc[1][m], w1, xv);
    }
  }
}

// Tiles [begin, end) for all M rows of x, written to y (dtype T, N columns).
template <typename W, typename X, typename T, int M>
void run_tiles(const X* x, int64_t K, const W* w, int64_t N, const float* bias, T* y, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    __m512 acc[2][M];
    UNROLL for (int h = 0; h < 2; ++h)
      UNROLL for (int m = 0; m < M; ++m) acc[h][m] = _mm512_setzero_ps();
    const W* wt = w + t * TILE * K;
    if constexpr (std::is_same_v<W, float>) tile_f32<M>(x, K, wt, acc);
    else if constexpr (std::is_same_v<X, float>) tile_bf16_f32<M>(x, K, wt, acc);
    else tile_bf16<M>(x, K, wt, acc);
    const int64_t n0 = t * TILE, cols = std::min(TILE, N - n0);
    UNROLL for (int m = 0; m < M; ++m) {
      alignas(64) float out[TILE];
      _mm512_store_ps(out, acc[0][m]);
      _mm512_store_ps(out + 16, acc[1][m]);
      T* row = y + m * N + n0;
      for (int64_t c = 0; c < cols; ++c) row[c] = from_float<T>(out[c] + (bias ? bias[n0 + c] : 0.f));
    }
  }
}

template <typename W, typename X, typename T, int M>
void gemv_impl(const X* x, int64_t K, const W* w, int64_t N, const float* bias, T* y) {
  // Whole runs of tiles per thread (each a long sequential stream), at least two each.
  at::parallel_for(0, (N + TILE - 1) / TILE, 2, [&](int64_t begin, int64_t end) {
    run_tiles<W, X, T, M>(x, K, w, N, bias, y, begin, end);
  });
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

// w in the tiled layout: float32 [ceil(N / 32), K, 32], bfloat16 [ceil(N / 32), ceil(K / 2), 32, 2].
at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, int64_t N, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "gemv runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= MAX_ROWS, "gemv takes x [M, K] with 1 to ", MAX_ROWS,
              " rows, got ", x.sizes());
  TORCH_CHECK(w.is_contiguous(), "gemv weight must be contiguous");
  const auto wt = w.scalar_type(), xt = x.scalar_type();
  TORCH_CHECK(wt == at::kFloat || wt == at::kBFloat16, "gemv weights are float32 or bfloat16, not ", wt);
  TORCH_CHECK(xt == at::kFloat || xt == at::kBFloat16, "gemv activations are float32 or bfloat16, not ", xt);
  const int64_t M = x.size(0), K = x.size(1), tiles = (N + TILE - 1) / TILE;
  const bool pairs = wt == at::kBFloat16;
  const int64_t Kp = pairs ? K + K % 2 : K;
  TORCH_CHECK(N >= 1 && (pairs ? w.dim() == 4 && w.size(1) == Kp / 2 && w.size(2) == TILE && w.size(3) == 2
                               : w.dim() == 3 && w.size(1) == K && w.size(2) == TILE) && w.size(0) == tiles,
              "gemv weight must be in its tiled layout (linear.gemv_weight) for N = ", N, " and K = ", K, ", got ",
              w.sizes());
  at::Tensor bf;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "gemv bias must have ", N, " values");
    bf = bias->to(at::kFloat).contiguous();
  }
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  auto y = at::empty({M, N}, x.options());
  // x padded to the weight's K (a zero after an odd K: bfloat16 weights go in pairs)
  auto padded = [&](const at::Tensor& t) { return Kp == K ? t.contiguous() : at::constant_pad_nd(t, {0, Kp - K}); };
  if (wt == at::kBFloat16 && xt == at::kBFloat16) {
    const at::Tensor xc = padded(x);
    dispatch_m(M, xc.data_ptr<c10::BFloat16>(), Kp, w.data_ptr<c10::BFloat16>(), N, bp, y.data_ptr<c10::BFloat16>());
    return y;
  }
  const at::Tensor xf = padded(x.to(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  if (wt == at::kFloat) {
    const float* wp = w.data_ptr<float>();
    if (xt == at::kFloat) dispatch_m(M, xp, Kp, wp, N, bp, y.data_ptr<float>());
    else dispatch_m(M, xp, Kp, wp, N, bp, y.data_ptr<c10::BFloat16>());
  } else {
    dispatch_m(M, xp, Kp, w.data_ptr<c10::BFloat16>(), N, bp, y.data_ptr<float>());  // float32 activations
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
  m.def("gemv(Tensor x, Tensor w, int N, Tensor? bias) -> Tensor");
  m.def("qgemm(Tensor x, Tensor qw, Tensor d, Tensor mn, int N, Tensor? bias) -> Tensor");
}
TORCH_LIBRARY_IMPL(atom_gemv, CPU, m) {
  m.impl("gemv", &gemv);
  m.impl("qgemm", &qgemm);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "y = x @ w.T (+ bias) for 1 to 8 rows of x, w in tiles of 32 rows (linear.gemv_weight), weight-streaming (CPU)");
  m.def("qgemm", &qgemm, "y = x @ w.T (+ bias), w in 4- or 8-bit groups of 32 (q * d + m) packed in tiles of 16 columns, any rows of x, batch-invariant (CPU)");
  m.attr("MAX_ROWS") = MAX_ROWS;
}
