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

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

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


// ---- 4- and 8-bit groups of 32 (GGUF Q4_0/Q4_1/Q8_0, Config.quantization int4/int8) ----------
//
// w = q * d + m per group of 32 along K, d and m in float16 (exact for GGUF's Q4_0/Q4_1/Q8_0).
// 4 bits: q in 0..15, m = zero - 8 * scale in quant.py's terms (the group minimum for Q4_1),
// 16 bytes a group, byte j = q_j | q_{j+16} << 4. 8 bits: q + 128 in 0..255 stored as
// unsigned bytes, m = -128 d. Each group of x is split into two int8
// vectors, x = dx (hi + lo / 254) with dx = max|x| / 127 (about 16 significant bits, where
// llama.cpp's single int8 vector keeps 8 and bfloat16 keeps 8), so a group's dot product is
// two vpdpbusd on integers: sum(w x) = d dx (sum(q hi) + sum(q lo) / 254) + m sum(x), the
// sum of x taken exactly in float32.

// x per group of 32: int8 hi and lo parts, scales and exact float sums, M rows back to back.
struct Q8Rows {
  std::vector<int8_t> hi, lo;
  std::vector<float> scale, sum;
};

inline void quantize_rows(const float* x, int64_t M, int64_t K, Q8Rows& out) {
  const int64_t groups = M * K / 32;
  out.hi.resize(M * K);
  out.lo.resize(M * K);
  out.scale.resize(groups + 2);  // read in pairs: room for a padding pair
  out.sum.resize(groups + 2);
  for (int64_t g = 0; g < groups; ++g) {
    const __m512 a = _mm512_loadu_ps(x + g * 32), b = _mm512_loadu_ps(x + g * 32 + 16);
    const float amax = std::max(_mm512_reduce_max_ps(_mm512_abs_ps(a)), _mm512_reduce_max_ps(_mm512_abs_ps(b)));
    const float d = amax / 127.f;
    const __m512 inv = _mm512_set1_ps(d > 0.f ? 127.f / amax : 0.f);
    const __m512 sa = _mm512_mul_ps(a, inv), sb = _mm512_mul_ps(b, inv);
    const __m512 ha = _mm512_roundscale_ps(sa, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 hb = _mm512_roundscale_ps(sb, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 k254 = _mm512_set1_ps(254.f);  // the remainder, in -0.5..0.5, in 254ths
    const __m512i la = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(sa, ha), k254));
    const __m512i lb = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(sb, hb), k254));
    int8_t* hi = out.hi.data() + g * 32;
    int8_t* lo = out.lo.data() + g * 32;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(ha)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + 16), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(hb)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm512_cvtsepi32_epi8(la));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + 16), _mm512_cvtsepi32_epi8(lb));
    out.scale[g] = d / 254.f;  // what 254 hi + lo is worth
    out.sum[g] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
  }
}

// 32 packed bytes (two groups) -> 64 values 0..15 in group order.
inline __m512i unpack_two_groups(const uint8_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i lo_mask = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(raw, lo_mask);                         // q_j of each group
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo_mask);   // q_{j+16}
  // per 128-bit lane: [lo | hi] of one group
  const __m256i g0 = _mm256_permute2x128_si256(lo, hi, 0x20), g1 = _mm256_permute2x128_si256(lo, hi, 0x31);
  return _mm512_inserti64x4(_mm512_castsi256_si512(g0), g1, 1);
}

inline __m128 two_halves(const c10::Half* p) {  // p[0], p[1] as floats (lanes 0, 1)
  return _mm_cvtph_ps(_mm_cvtsi32_si128(*reinterpret_cast<const int32_t*>(p)));
}
inline __m128 two_floats(const float* p) { return _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }

// Two groups of weights as 64 unsigned bytes: 4-bit values unpacked, or 8-bit ones stored as q + 128.
template <int BITS>
inline __m512i load_two_groups(const uint8_t* row, int64_t g) {
  if constexpr (BITS == 4) return unpack_two_groups(row + g * 16);
  else return _mm512_loadu_si512(row + g * 32);
}

template <int M, int BITS>
void qgemv_rows(const Q8Rows& xs, int64_t K, const uint8_t* qw, const c10::Half* d, const c10::Half* mn,
                const float* bias, float* y, int64_t N, int64_t begin, int64_t end) {
  const int64_t groups = K / 32, row_bytes = K * BITS / 8;
  const __m512i spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const int8_t* xhi = xs.hi.data();
  const int8_t* xlo = xs.lo.data();
  const __m512 k254 = _mm512_set1_ps(254.f);
  const float* xscale = xs.scale.data();
  const float* xsum = xs.sum.data();
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* wq = qw + n * row_bytes;
    const c10::Half* dn = d + n * groups;
    const c10::Half* mnn = mn + n * groups;
    for (int64_t off = 0; off < row_bytes; off += 64)  // a few rows ahead: rows are short streams
      _mm_prefetch(reinterpret_cast<const char*>(wq + 4 * row_bytes + off), _MM_HINT_T1);
    __m512 acc[M];
    __m128 zacc[M];  // sum over groups of m_g * sum(x_g), two groups a lane pair
    for (int m = 0; m < M; ++m) {
      acc[m] = _mm512_setzero_ps();
      zacc[m] = _mm_setzero_ps();
    }
    int64_t g = 0;
    for (; g + 2 <= groups; g += 2) {
      const __m512i q = load_two_groups<BITS>(wq, g);
      const __m128 dw = two_halves(dn + g), mw = two_halves(mnn + g);
      for (int m = 0; m < M; ++m) {
        const int64_t xg = m * groups + g;
        const __m512i dhi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, _mm512_loadu_si512(xhi + xg * 32));
        const __m512i dlo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, _mm512_loadu_si512(xlo + xg * 32));
        const __m512 dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dhi), k254, _mm512_cvtepi32_ps(dlo));  // 254 x
        const __m128 sc = _mm_mul_ps(dw, two_floats(xscale + xg));
        acc[m] = _mm512_fmadd_ps(dot, _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(sc)), acc[m]);
        zacc[m] = _mm_fmadd_ps(mw, two_floats(xsum + xg), zacc[m]);
      }
    }
    float tail[M] = {};
    if (g < groups) {  // an odd group count: the last group alone
      alignas(64) uint8_t bytes[64] = {};
      std::memcpy(bytes, wq + g * BITS * 4, BITS * 4);
      const __m256i q = _mm512_castsi512_si256(load_two_groups<BITS>(bytes, 0));
      const float dg = static_cast<float>(dn[g]), mg = static_cast<float>(mnn[g]);
      for (int m = 0; m < M; ++m) {
        const int64_t xg = m * groups + g;
        const __m256i h8 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xhi + xg * 32));
        const __m256i l8 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xlo + xg * 32));
        alignas(32) int32_t lanes[2][8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[0]), _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, h8));
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[1]), _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, l8));
        int32_t th = 0, tl = 0;
        for (int i = 0; i < 8; ++i) th += lanes[0][i], tl += lanes[1][i];
        tail[m] = dg * xscale[xg] * (254.f * static_cast<float>(th) + static_cast<float>(tl)) + mg * xsum[xg];
      }
    }
    for (int m = 0; m < M; ++m) {
      const __m128 z = _mm_add_ps(zacc[m], _mm_movehdup_ps(zacc[m]));  // lane 0: both groups' terms
      y[m * N + n] = _mm512_reduce_add_ps(acc[m]) + _mm_cvtss_f32(z) + tail[m] + (bias ? bias[n] : 0.f);
    }
  }
}

at::Tensor qgemv(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& d, const at::Tensor& mn,
                 const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "qgemv takes x [M, K] on CPU");
  const int64_t M = x.size(0), K = x.size(1), N = qw.size(0);
  TORCH_CHECK(M >= 1 && M <= MAX_ROWS, "qgemv takes 1 to ", MAX_ROWS, " rows, got ", M);
  TORCH_CHECK(K % 32 == 0 && (qw.size(1) * 2 == K || qw.size(1) == K) && qw.scalar_type() == at::kByte && qw.is_contiguous(),
              "qgemv weight must be uint8 [N, K / 2] (4 bits, two a byte) or [N, K] (8 bits + 128), K a multiple of 32");
  TORCH_CHECK(d.scalar_type() == at::kHalf && mn.scalar_type() == at::kHalf && d.is_contiguous() && mn.is_contiguous() &&
                  d.numel() == N * (K / 32) && mn.numel() == N * (K / 32),
              "qgemv scales and mins must be float16 [N, K / 32]");
  const int bits = qw.size(1) == K ? 8 : 4;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  Q8Rows xs;
  quantize_rows(xf.data_ptr<float>(), M, K, xs);
  at::Tensor bf;
  if (bias.has_value() && bias->defined()) bf = bias->to(at::kFloat).contiguous();
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const uint8_t* qp = qw.data_ptr<uint8_t>();
  const c10::Half* dp = d.data_ptr<c10::Half>();
  const c10::Half* mp = mn.data_ptr<c10::Half>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    auto run = [&](auto bits_tag) {
      constexpr int B = decltype(bits_tag)::value;
      switch (M) {
        case 1: return qgemv_rows<1, B>(xs, K, qp, dp, mp, bp, yp, N, begin, end);
        case 2: return qgemv_rows<2, B>(xs, K, qp, dp, mp, bp, yp, N, begin, end);
        case 3: return qgemv_rows<3, B>(xs, K, qp, dp, mp, bp, yp, N, begin, end);
        case 4: return qgemv_rows<4, B>(xs, K, qp, dp, mp, bp, yp, N, begin, end);
        case 5: return qgemv_rows<5, B>(xs, K, qp, dp, mp, bp, yp, N, begin, end);
        case 6: return qgemv_rows<6, B>(xs, K, qp, dp, mp, bp, yp, N, begin, end);
        case 7: return qgemv_rows<7, B>(xs, K, qp, dp, mp, bp, yp, N, begin, end);
        case 8: return qgemv_rows<8, B>(xs, K, qp, dp, mp, bp, yp, N, begin, end);
      }
    };
    if (bits == 4) run(std::integral_constant<int, 4>{});
    else run(std::integral_constant<int, 8>{});
  });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// Also a torch op, `atom_gemv::gemv`, so a traced graph (`atom_core.compile`) can call it.
TORCH_LIBRARY(atom_gemv, m) { m.def("gemv(Tensor x, Tensor w, Tensor? bias) -> Tensor"); }
TORCH_LIBRARY_IMPL(atom_gemv, CPU, m) { m.impl("gemv", &gemv); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "y = x @ w.T (+ bias) for 1 to 8 rows of x, weight-streaming (CPU)");
  m.def("qgemv", &qgemv, "y = x @ w.T (+ bias), w in 4- or 8-bit groups of 32 (q * d + m), 1 to 8 rows of x (CPU)");
  m.attr("MAX_ROWS") = MAX_ROWS;
}
