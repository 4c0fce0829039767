// Paged attention for CPU: reads each request's K/V where they lie in the block pool.
//
// The torch path gathers every request's blocks into a fresh tensor before two matrix
// products; at decode that copy costs as much as the products themselves. A request with
// a few new tokens (decode, speculative verification) is one task per KV head that walks
// the block table once per token: the scores of the query heads sharing that KV head
// against the K rows, a float32 softmax, then the weighted sum of the V rows; past
// `kPartitionKeys` keys in parts of that many, merged after, which a step with few such
// tasks runs on threads of their own (flash-decoding's split, vLLM's paged attention v2). A request
// with a long run of new tokens (a prompt chunk) is tiled: its keys are transposed once
// per KV head into float32, and each tile of tokens x the group's heads goes over them in
// chunks with a running (online) softmax, so each K/V value read serves the whole tile.
// Everything accumulates in float32 whatever the cache dtype, which may be narrower than the
// queries' (`Config.kv_cache_dtype`: float32 queries over a bfloat16 or float16 cache read its
// values widened, the same sums as over a float32 cache holding those values). One exception,
// a bfloat16 cache on a CPU with avx512_bf16 (`PairTiled`): the tiled path multiplies in
// bfloat16 pairs, float32 queries rounded to bfloat16 (as llama.cpp rounds queries to its
// float16 cache's type) and the probabilities too for the product with V, as torch's own CPU
// attention does in bfloat16.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "amx.h"  // atom_core/layers/csrc too
#include "out_tensor.h"
#include "simd.h"  // atom_core/layers/csrc, on the include path CppKernel sets

namespace {

using atom::to_float;

// a * b + c, fused where the CPU has FMA (one rounding, one instruction)
inline float madd(float a, float b, float c) {
#if defined(__FMA__)
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

// exp(x) for x <= 0 (a score minus its row's maximum), within ~2 ulp of expf and
// written so the compiler vectorises it; libm's expf is scalar.
inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;  // exp(-87) ~ 1.6e-38: smaller weights round to nothing
  const float k = __builtin_floorf(madd(x, 1.44269504088896341f, 0.5f));  // x = k ln2 + r
  const float r = madd(-k, 1.42860682030941723212e-6f, madd(-k, 0.693145751953125f, x));
  float p = 1.f / 5040.f;  // Taylor series of exp(r), |r| <= ln2 / 2: error < 1.2e-7
  p = madd(p, r, 1.f / 720.f);
  p = madd(p, r, 1.f / 120.f);
  p = madd(p, r, 1.f / 24.f);
  p = madd(p, r, 1.f / 6.f);
  p = madd(p, r, 0.5f);
  p = madd(p, r, 1.f);
  p = madd(p, r, 1.f);
  return p * __builtin_bit_cast(float, (static_cast<int32_t>(k) + 127) << 23);  // p * 2^k
}

// Blocks lie anywhere in the pool (after a while a pool hands them out in no order), and
// the hardware prefetcher stops at each block's edge: while one block is read, its rows in
// the block two ahead are fetched into L2. Scattered blocks read 1.5-2x faster with this,
// contiguous ones no slower (30 layers, 64 requests, float32 and bfloat16).
constexpr int64_t kPrefetchAhead = 2;

template <typename T>
inline void prefetch_row(const T* row, int64_t dim) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < dim * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(p + b, 0, 2);
}

// Row operations on one block, for `hb` query heads at once (the heads sharing a KV head
// read each K/V row once): scores of `n` K rows against float queries q[hb][dim] into
// out[h * out_stride + t], and acc[h][dim] += sum_t p[h * p_stride + t] * V row t; each
// prefetches the same rows of `ahead` (a block read later; null: none).
// `GenericRows` takes any head_dim; `VecRows<T, D>` (D a multiple of the vector width) keeps
// the accumulators in registers and sums four dot products with one shuffle tree (the
// compiler's own reduction spilled all 16 lanes to the stack and added them one by one).
template <typename T>
struct GenericRows {
  static constexpr int kHeads = 8;
  static void scores(const float* q, int hb, const T* rows, int64_t stride, int64_t n, int64_t dim, float* out,
                     int64_t out_stride, const T* ahead) {
    for (int64_t t = 0; t < n; ++t) {
      const T* row = rows + t * stride;
      if (ahead) prefetch_row(ahead + t * stride, dim);
      for (int h = 0; h < hb; ++h) {
        const float* qh = q + h * dim;
        float s = 0.f;
        for (int64_t d = 0; d < dim; ++d) s += qh[d] * to_float(row[d]);
        out[h * out_stride + t] = s;
      }
    }
  }
  static void accumulate(const float* p, int64_t p_stride, int hb, const T* rows, int64_t stride, int64_t n,
                         int64_t dim, float* acc, const T* ahead) {
    for (int64_t t = 0; t < n; ++t) {
      const T* row = rows + t * stride;
      if (ahead) prefetch_row(ahead + t * stride, dim);
      for (int h = 0; h < hb; ++h) {
        const float w = p[h * p_stride + t];
        float* ah = acc + h * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) ah[d] += w * to_float(row[d]);
      }
    }
  }
};

namespace simd = atom::simd;
using simd::vf;
constexpr int L = simd::kLanes;

constexpr bool kWide = simd::kRegisters == 32;  // AVX-512's 32 vector registers, else 16

template <typename T, int D>
struct VecRows {
  static constexpr int N = D > 0 ? D / L : 1;  // registers per row
  // Heads per pass: accumulators stay within the registers. scores keeps kHeads x 4 sums;
  // accumulate keeps whole rows for kHeads heads up to kWhole registers a row, past that
  // (MLA's 576-value latent, where every head shares the row) slices of kSlice registers
  // for kSliceHeads heads at a time.
  static constexpr int kHeads = kWide ? (N <= 4 || N > 8 ? 4 : 2) : 2;
  static constexpr int kWhole = kWide ? 8 : 2;
  static constexpr int kSlice = 4;
  static constexpr int kSliceHeads = kWide ? 4 : 2;
  static void scores(const float* q, int hb, const T* rows, int64_t stride, int64_t n, int64_t, float* out,
                     int64_t out_stride, const T* ahead) {
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
      if (ahead)
        for (int r = 0; r < 4; ++r) prefetch_row(ahead + (t + r) * stride, D);
      vf a[kHeads][4];
      for (int h = 0; h < kHeads; ++h)
        for (int r = 0; r < 4; ++r) a[h][r] = simd::zero();
      for (int i = 0; i < N; ++i) {
        vf x[4];
        for (int r = 0; r < 4; ++r) x[r] = simd::load(rows + (t + r) * stride + L * i);
        for (int h = 0; h < kHeads; ++h) {
          if (h >= hb) break;
          const vf qv = simd::load(q + h * D + L * i);
          for (int r = 0; r < 4; ++r) a[h][r] = simd::fmadd(qv, x[r], a[h][r]);
        }
      }
      for (int h = 0; h < kHeads; ++h) {
        if (h >= hb) break;
        simd::hsum4(a[h][0], a[h][1], a[h][2], a[h][3], out + h * out_stride + t);
      }
    }
    for (; t < n; ++t) {
      const T* row = rows + t * stride;
      if (ahead) prefetch_row(ahead + t * stride, D);
      for (int h = 0; h < hb; ++h) {
        vf a = simd::zero();
        for (int i = 0; i < N; ++i) a = simd::fmadd(simd::load(q + h * D + L * i), simd::load(row + L * i), a);
        out[h * out_stride + t] = simd::reduce_add(a);
      }
    }
  }
  static void accumulate(const float* p, int64_t p_stride, int hb, const T* rows, int64_t stride, int64_t n,
                         int64_t dim, float* acc, const T* ahead) {
    if constexpr (N > kWhole) {
      accumulate_sliced(p, p_stride, hb, rows, stride, n, acc, ahead);
      return;
    }
    vf av[kHeads][N];
    for (int h = 0; h < kHeads; ++h)
      for (int i = 0; i < N; ++i) av[h][i] = h < hb ? simd::load(acc + h * D + L * i) : simd::zero();
    for (int64_t t = 0; t < n; ++t) {
      const T* row = rows + t * stride;
      if (ahead) prefetch_row(ahead + t * stride, D);
      vf x[N];
      for (int i = 0; i < N; ++i) x[i] = simd::load(row + L * i);
      for (int h = 0; h < kHeads; ++h) {
        if (h >= hb) break;
        const vf w = simd::set1(p[h * p_stride + t]);
        for (int i = 0; i < N; ++i) av[h][i] = simd::fmadd(w, x[i], av[h][i]);
      }
    }
    for (int h = 0; h < kHeads; ++h) {
      if (h >= hb) break;
      for (int i = 0; i < N; ++i) simd::store(acc + h * D + L * i, av[h][i]);
    }
  }
  static void accumulate_sliced(const float* p, int64_t p_stride, int hb, const T* rows, int64_t stride, int64_t n,
                                float* acc, const T* ahead);
};
// VecRows::accumulate for wide rows: per slice of kSlice registers, kSliceHeads heads'
// accumulators stay in registers over the block's rows and each row slice is loaded once for them.
// Not inlined: inlined into the per-token loop it compiled to a slower loop (MLA's decode,
// docs/kernels.md).
template <typename T, int D>
__attribute__((noinline)) void VecRows<T, D>::accumulate_sliced(const float* p, int64_t p_stride, int hb,
                                                                const T* rows, int64_t stride, int64_t n, float* acc,
                                                                const T* ahead) {
  constexpr int H = kSliceHeads;
  if (ahead)
    for (int64_t t = 0; t < n; ++t) prefetch_row(ahead + t * stride, D);
  for (int g = 0; g < hb; g += H) {
    const int heads = std::min(H, hb - g);
    for (int c = 0; c < N; c += kSlice) {
      const int m = std::min(kSlice, N - c);
      vf av[H][kSlice];
      for (int h = 0; h < H; ++h)
        for (int i = 0; i < kSlice; ++i)
          av[h][i] = h < heads && i < m ? simd::load(acc + (g + h) * D + L * (c + i)) : simd::zero();
      for (int64_t t = 0; t < n; ++t) {
        const T* row = rows + t * stride + L * c;
        vf x[kSlice];
        for (int i = 0; i < kSlice; ++i) x[i] = i < m ? simd::load(row + L * i) : simd::zero();
        for (int h = 0; h < H; ++h) {
          if (h >= heads) break;
          const vf w = simd::set1(p[(g + h) * p_stride + t]);
          for (int i = 0; i < kSlice; ++i) av[h][i] = simd::fmadd(w, x[i], av[h][i]);
        }
      }
      for (int h = 0; h < H; ++h) {
        if (h >= heads) break;
        for (int i = 0; i < m; ++i) simd::store(acc + (g + h) * D + L * (c + i), av[h][i]);
      }
    }
  }
}

template <typename T, int D>
constexpr bool kVectorized = D > 0 && D % L == 0 &&
                             (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>);
template <typename T, int D>
using Rows = std::conditional_t<kVectorized<T, D>, VecRows<T, D>, GenericRows<T>>;

// A request with more new tokens than this takes the tiled path.
constexpr int64_t kShortQuery = 8;
// Keys (rounded to whole blocks) of one part of a query on the per-token path. A query that
// sees keys in more than one part takes a softmax per part and merges them
// (`merge_partitions`), whether one task runs its parts in turn or, in a step with fewer
// than kSplitBelow tasks a thread (tiles of prompt chunks included), each part is a task of
// its own: then one request with MLA's single latent head, or three KV heads on two
// threads, still spreads over every thread. The parts depend on the query's keys alone,
// never on the batch or the thread count, so a row's output is the same bits alone and in
// any batch (speculative verification's rows round as decode rows do).
constexpr int64_t kPartitionKeys = 512;
constexpr int64_t kSplitBelow = 2;
// Tokens per tile: with the group's heads, the rows that share each chunk of K/V.
constexpr int64_t kTileTokens = 8;
// Chunks of keys per softmax step of the tiled path: a row's maximum, exponentials and sum
// are taken over this many keys at a time (the online softmax's rescaling once per block),
// its scores staying in L1 (tile rows x 256 keys x 4 bytes).
constexpr int64_t kSoftmaxChunks = 8;

// A layer's attention options: a sliding window (a query at position p sees keys
// p - window + 1 .. p; 0: every earlier key), soft-capped scores (cap * tanh(s / cap); 0:
// none) and sinks (a logit per query head that joins its softmax and is dropped; null: none).
struct Options {
  int64_t window = 0;
  float softcap = 0.f;
  const float* sinks = nullptr;
  // The first key a query at position p (0-based) sees.
  int64_t first_key(int64_t p) const { return window > 0 ? std::max<int64_t>(0, p - window + 1) : 0; }
  void cap(float* s, int64_t n) const {
    if (softcap > 0.f)
      for (int64_t t = 0; t < n; ++t) s[t] = softcap * std::tanh(s[t] / softcap);
  }
};

// The tiled path's inner products for head_dim D (a multiple of the vector width). Keys
// come in chunks of kChunk = 2 vectors; kt holds a request's keys for one KV head
// transposed chunk by chunk ([chunks][D][kChunk], float32: a chunk's 8 KiB are contiguous,
// where rows of all the keys put its lines a few KiB apart, on the same few L1 sets), so a
// chunk's scores for kScoreRows rows stay in registers while d runs, and V rows are read
// where they lie, once per kAccRows rows.
template <typename T, int D>
struct Tiled {
  static constexpr int N = D / L;
  static constexpr int kChunk = 2 * L;
  static constexpr int kScoreRows = kWide ? 12 : 6;
  static constexpr int kSlice = N < 1 ? 1 : N < 4 ? N : 4;
  static_assert(D == 0 || N % kSlice == 0, "the tiled path takes head dims of a multiple of kSlice vectors");
  static constexpr int kAccRows = kWide ? 6 : 2;

  // s[r * ss + 0..kChunk) = qf[r] . the chunk's keys (kt: the chunk, [D][kChunk]) for rows [0, rows).
  static void scores(const float* qf, int64_t rows, const float* kt, float* s, int64_t ss) {
    int64_t r0 = 0;
    for (; r0 + kScoreRows <= rows; r0 += kScoreRows) score_rows<kScoreRows>(qf + r0 * D, kt, s + r0 * ss, ss);
    if (r0 < rows) by_count<kScoreRows - 1>(rows - r0, [&](auto r) { score_rows<r>(qf + r0 * D, kt, s + r0 * ss, ss); });
  }
  // acc[r] += sum_t p[r * ps + t] * V row t, for t < n (vrows[t] points at each).
  static void accumulate(const float* p, int64_t ps, int64_t rows, const T* const* vrows, int64_t n, float* acc) {
    int64_t r0 = 0;
    for (; r0 + kAccRows <= rows; r0 += kAccRows) acc_rows<kAccRows>(p + r0 * ps, ps, vrows, n, acc + r0 * D);
    if (r0 < rows) by_count<kAccRows - 1>(rows - r0, [&](auto r) { acc_rows<r>(p + r0 * ps, ps, vrows, n, acc + r0 * D); });
  }

 private:
  // f(std::integral_constant<int, n>) for a run-time n in [1, kMax]: the row loops below
  // unroll fully for a compile-time count (a run-time bound left a compare per row per step).
  template <int kMax, typename F>
  static void by_count(int64_t n, F&& f) {
    if constexpr (kMax > 0) {
      if (n == kMax) return f(std::integral_constant<int, kMax>{});
      by_count<kMax - 1>(n, f);
    }
  }
  template <int R>
  static void score_rows(const float* qf, const float* kt, float* s, int64_t ss) {
    vf a[R][2];
    for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = simd::zero();
    for (int d = 0; d < D; ++d) {
      const vf k0 = simd::load(kt + d * kChunk), k1 = simd::load(kt + d * kChunk + L);
      for (int r = 0; r < R; ++r) {
        const vf b = simd::set1(qf[r * D + d]);
        a[r][0] = simd::fmadd(b, k0, a[r][0]);
        a[r][1] = simd::fmadd(b, k1, a[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      simd::store(s + r * ss, a[r][0]);
      simd::store(s + r * ss + L, a[r][1]);
    }
  }
  template <int R>
  static void acc_rows(const float* p, int64_t ps, const T* const* vrows, int64_t n, float* acc) {
    for (int c = 0; c < N; c += kSlice) {
      vf av[R][kSlice];
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < kSlice; ++i) av[r][i] = simd::load(acc + r * D + L * (c + i));
      for (int64_t t = 0; t < n; ++t) {
        vf x[kSlice];
        for (int i = 0; i < kSlice; ++i) x[i] = simd::load(vrows[t] + L * (c + i));
        for (int r = 0; r < R; ++r) {
          const vf w = simd::set1(p[r * ps + t]);
          for (int i = 0; i < kSlice; ++i) av[r][i] = simd::fmadd(w, x[i], av[r][i]);
        }
      }
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < kSlice; ++i) simd::store(acc + r * D + L * (c + i), av[r][i]);
    }
  }
};

#if defined(__AVX512BF16__)
// Queries over a bfloat16 cache, on CPUs with avx512_bf16: the tiled path's two
// products take vdpbf16ps, which adds two exact bfloat16 products to each float32 lane: half
// the instructions of widening every value to float32. Keys are held in pairs of values
// ([chunks][D / 2][kChunk] 32-bit pairs: key t's values 2p, 2p + 1), V in pairs of keys
// ([chunks][kChunk / 2][D]: keys 2j, 2j + 1 at value d); the probabilities are rounded to
// bfloat16 for the second product, as torch's CPU flash attention does in bfloat16. Scores
// are q . k unscaled (exact products), then scaled.
template <int D>
struct PairTiled {
  static constexpr int P = D / 2;  // pairs per key
  static constexpr int kChunk = 2 * L;
  static constexpr int kScoreRows = 12;
  static constexpr int kSlice = 4;
  static constexpr int kAccRows = 6;
  static_assert(D % (kSlice * L) == 0, "PairTiled takes head dims of a multiple of 64");

  // s[r * ss + 0..kChunk) = scale * qb[r] . the chunk's keys (kt: [P][kChunk] pairs) for rows [0, rows).
  static void scores(const uint32_t* qb, int64_t rows, const uint32_t* kt, float scale, float* s, int64_t ss) {
    int64_t r0 = 0;
    for (; r0 + kScoreRows <= rows; r0 += kScoreRows) score_rows<kScoreRows>(qb + r0 * P, kt, scale, s + r0 * ss, ss);
    for (; r0 < rows; ++r0) score_rows<1>(qb + r0 * P, kt, scale, s + r0 * ss, ss);
  }
  // acc[r] += sum_j pb[r][j] . V pair j (vt: [kChunk / 2][D] pairs), for pairs j < n.
  static void accumulate(const uint32_t* pb, int64_t rows, const uint32_t* vt, int64_t n, float* acc) {
    int64_t r0 = 0;
    for (; r0 + kAccRows <= rows; r0 += kAccRows) acc_rows<kAccRows>(pb + r0 * L, vt, n, acc + r0 * D);
    for (; r0 < rows; ++r0) acc_rows<1>(pb + r0 * L, vt, n, acc + r0 * D);
  }
  // A row of kChunk float32 probabilities as kChunk / 2 bfloat16 pairs, in key order.
  static void round_pairs(const float* p, uint32_t* out) {
    _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + L), _mm512_loadu_ps(p)));
  }
  // A query row as D / 2 bfloat16 pairs: bfloat16 rows as they are, float32 ones rounded to
  // nearest even (what `q.to(torch.bfloat16)` gives).
  static void query_pairs(const c10::BFloat16* q, uint32_t* out) { std::memcpy(out, q, D * sizeof(c10::BFloat16)); }
  static void query_pairs(const float* q, uint32_t* out) {
    for (int d = 0; d < D; d += kChunk) round_pairs(q + d, out + d / 2);
  }

 private:
  template <int R>
  static void score_rows(const uint32_t* qb, const uint32_t* kt, float scale, float* s, int64_t ss) {
    __m512 a[R][2];
    for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
    for (int p = 0; p < P; ++p) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + p * kChunk);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + p * kChunk + L);
      for (int r = 0; r < R; ++r) {
        const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(qb[r * P + p]));
        a[r][0] = _mm512_dpbf16_ps(a[r][0], k0, b);
        a[r][1] = _mm512_dpbf16_ps(a[r][1], k1, b);
      }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(s + r * ss, _mm512_mul_ps(a[r][0], sc));
      _mm512_storeu_ps(s + r * ss + L, _mm512_mul_ps(a[r][1], sc));
    }
  }
  template <int R>
  static void acc_rows(const uint32_t* pb, const uint32_t* vt, int64_t n, float* acc) {
    for (int c = 0; c < D / L; c += kSlice) {
      __m512 av[R][kSlice];
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < kSlice; ++i) av[r][i] = _mm512_loadu_ps(acc + r * D + L * (c + i));
      for (int64_t j = 0; j < n; ++j) {
        __m512bh x[kSlice];
        for (int i = 0; i < kSlice; ++i) x[i] = (__m512bh)_mm512_loadu_si512(vt + j * D + L * (c + i));
        for (int r = 0; r < R; ++r) {
          const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pb[r * L + j]));
          for (int i = 0; i < kSlice; ++i) av[r][i] = _mm512_dpbf16_ps(av[r][i], x[i], w);
        }
      }
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < kSlice; ++i) _mm512_storeu_ps(acc + r * D + L * (c + i), av[r][i]);
    }
  }
};
template <typename Q, typename T, int D>
constexpr bool kPairs = (std::is_same_v<Q, c10::BFloat16> || std::is_same_v<Q, float>) &&
                       std::is_same_v<T, c10::BFloat16> && D > 0 && D % 64 == 0;

// The same two products on CPUs with AMX (`set_amx`): tdpbf16ps multiplies a 16 x 32 tile
// of bfloat16 pairs by a 32 x 16 one into 16 x 16 float32 sums, where vdpbf16ps spent most
// of the tiled path's time. The pair layouts are PairTiled's: a tile of keys is 16 pair rows
// of kt (stride kChunk), a tile of values 16 pair rows of vt (stride D). The tile takes rows
// in blocks of 16 (`amx::padded_rows`): the work buffers are padded to that, the padding's rows
// computed and never read. Each output is a sum of exact products in float32, as with
// vdpbf16ps, in another order.
constexpr int64_t kAmxRows = atom::amx::kRows;

template <int D>
struct AmxPairs {
  static constexpr int P = D / 2;
  static constexpr int C = PairTiled<D>::kChunk;  // keys a chunk: two tiles' columns
  static_assert(C == 2 * kAmxRows && P % 16 == 0, "AmxPairs takes AVX-512's chunks of 32 keys");

  // s[r * ss + t] = qb[r] . key t (unscaled), rows r < prows (a multiple of 16), keys t < nk
  // (a multiple of C) of the chunks from kt on.
  __attribute__((target("amx-tile,amx-bf16"))) static void scores(const uint32_t* qb, int64_t prows,
                                                                   const uint32_t* kt, int64_t nk, float* s,
                                                                   int64_t ss) {
    for (int64_t r0 = 0; r0 < prows; r0 += kAmxRows)
      for (int64_t t0 = 0; t0 < nk; t0 += C) {
        const uint32_t* chunk = kt + t0 * P;
        _tile_zero(0);
        _tile_zero(1);
        for (int p = 0; p < P; p += 16) {
          _tile_loadd(2, qb + r0 * P + p, P * 4);
          _tile_loadd(3, chunk + p * C, C * 4);
          _tile_loadd(4, chunk + p * C + kAmxRows, C * 4);
          _tile_dpbf16ps(0, 2, 3);
          _tile_dpbf16ps(1, 2, 4);
        }
        _tile_stored(0, s + r0 * ss + t0, ss * 4);
        _tile_stored(1, s + r0 * ss + t0 + kAmxRows, ss * 4);
      }
  }
  // acc[r] += sum over key pairs j < nk / 2 of pb[r * ps + j] . V pair j (vt from the block's
  // first chunk on), rows r < prows.
  __attribute__((target("amx-tile,amx-bf16"))) static void accumulate(const uint32_t* pb, int64_t ps, int64_t prows,
                                                                       const uint32_t* vt, int64_t nk, float* acc) {
    for (int64_t r0 = 0; r0 < prows; r0 += kAmxRows)
      for (int d0 = 0; d0 < D; d0 += 2 * kAmxRows) {
        float* a = acc + r0 * D + d0;
        _tile_loadd(0, a, D * 4);
        _tile_loadd(1, a + kAmxRows, D * 4);
        for (int64_t j0 = 0; j0 < nk / 2; j0 += kAmxRows) {
          _tile_loadd(2, pb + r0 * ps + j0, ps * 4);
          _tile_loadd(3, vt + j0 * D + d0, D * 4);
          _tile_loadd(4, vt + j0 * D + d0 + kAmxRows, D * 4);
          _tile_dpbf16ps(0, 2, 3);
          _tile_dpbf16ps(1, 2, 4);
        }
        _tile_stored(0, a, D * 4);
        _tile_stored(1, a + kAmxRows, D * 4);
      }
  }
};
#else
template <int D>
struct AmxPairs {
  static void scores(const uint32_t*, int64_t, const uint32_t*, int64_t, float*, int64_t) {}
  static void accumulate(const uint32_t*, int64_t, int64_t, const uint32_t*, int64_t, float*) {}
};
template <int D>
struct PairTiled {};
template <typename Q, typename T, int D>
constexpr bool kPairs = false;
#endif

// max(x[from..to)), to > from; a vector loop (the compiler's own `omp simd` max reduction
// stayed scalar).
inline float max_of(const float* x, int64_t from, int64_t to) {
  int64_t t = from;
  float mx = x[t];
  if (to - from >= L) {
    vf v = simd::load(x + t);
    for (t += L; t + L <= to; t += L) v = simd::max(v, simd::load(x + t));
    mx = simd::reduce_max(v);
  }
  for (; t < to; ++t) mx = std::max(mx, x[t]);
  return mx;
}

// The tiled path for request r's tokens [j0, j1) and KV head h. kt: the request's keys for
// that head, transposed chunk by chunk (`transpose_keys`; in pairs, `pair_keys`, where vt
// holds its values in pairs, `pair_values`). Row i of the tile is token j0 + i / group, query
// head h * group + i % group.
template <typename Q, typename T, int D>
void attend_tile(const Q* qp, int64_t qs0, int64_t qs1, Q* op, int64_t os0, int64_t os1, int64_t start, int64_t n,
                 int64_t context, int64_t j0, int64_t j1, int64_t h, int64_t group, const void* kt,
                 const uint32_t* vt, const T* vbase, const int64_t* table, int64_t vb, int64_t vr,
                 int64_t block_size, float scale, const Options& opt, std::vector<float>& work,
                 std::vector<const T*>& vrows, const float* vwide) {
  constexpr bool kPair = kPairs<Q, T, D>;
  using K = Tiled<T, D>;
  constexpr int C = K::kChunk;
  constexpr int64_t B = kSoftmaxChunks * C;
  const int64_t rows = (j1 - j0) * group;
  // AMX: the tiles' rows in blocks of kAmxRows (padding rows: zero queries), a block's
  // probabilities in pairs at once
  const bool amx = kPair && atom::amx::on.load(std::memory_order_relaxed);
  const int64_t prows = amx ? atom::amx::padded_rows(rows) : rows, pairs = amx ? B / 2 : C / 2;
  work.resize(prows * (2 * D + B + 2 + pairs));
  float* qf = work.data();  // kPair: the rows' bfloat16 pairs, D / 2 a row
  float* acc = qf + prows * D;
  float* s = acc + prows * D;  // a block's scores, then probabilities: [prows][B]
  float* m = s + prows * B;
  float* l = m + prows;
  auto* pb = reinterpret_cast<uint32_t*>(l + prows);  // kPair: probabilities in bfloat16 pairs, `pairs` a row
  vrows.resize(C);
  if (amx) {
    std::fill(qf + rows * D / 2, qf + prows * D / 2, 0.f);
    atom::amx::configure();
  }
  for (int64_t i = 0; i < rows; ++i) {
    const Q* src = qp + (start + j0 + i / group) * qs0 + (h * group + i % group) * qs1;
    if constexpr (kPair) PairTiled<D>::query_pairs(src, reinterpret_cast<uint32_t*>(qf) + i * D / 2);
    else for (int64_t d = 0; d < D; ++d) qf[i * D + d] = to_float(src[d]) * scale;
    m[i] = -std::numeric_limits<float>::infinity();
    l[i] = 0.f;
  }
  std::fill(acc, acc + prows * D, 0.f);
  const int64_t first = context - n;  // position of the request's first new token
  const int64_t keys = first + j1;  // keys the tile's last token sees
  // keys before the tile's first token's window are seen by no row: start at its chunk
  for (int64_t b0 = opt.first_key(first + j0) / C * C; b0 < keys; b0 += B) {
    const int64_t bn = std::min<int64_t>(B, keys - b0);  // keys of this block
    const int64_t padded = (bn + C - 1) / C * C;
    // The scores are `raw` times `sc`: AMX's sums are unscaled, the scale taken into the
    // exponentials' argument (one FMA), except where soft-capping needs the scores themselves.
    float sc = 1.f;
    if (amx) {
      AmxPairs<D>::scores(reinterpret_cast<const uint32_t*>(qf), prows, static_cast<const uint32_t*>(kt) + b0 * D / 2,
                          padded, s, B);
      sc = scale;
      if (opt.softcap > 0.f) {
        const vf v = simd::set1(scale);
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t t = 0; t < padded; t += L) simd::store(s + i * B + t, simd::mul(v, simd::load(s + i * B + t)));
        sc = 1.f;
      }
    } else {
      for (int64_t c = 0; c < bn; c += C) {  // chunk (b0 + c) / C starts at (b0 + c) * D values
        if constexpr (kPair)
          PairTiled<D>::scores(reinterpret_cast<const uint32_t*>(qf), rows,
                               static_cast<const uint32_t*>(kt) + (b0 + c) * D / 2, scale, s + c, B);
        else
          K::scores(qf, rows, static_cast<const float*>(kt) + (b0 + c) * D, s + c, B);
      }
    }
    for (int64_t i = 0; i < rows; ++i) {
      float* si = s + i * B;
      const int64_t pos = first + j0 + i / group;
      const int64_t seen = std::min<int64_t>(bn, pos + 1 - b0);  // causal
      const int64_t from = std::max<int64_t>(0, opt.first_key(pos) - b0);  // the window's start
      if (seen <= from) {
        std::fill(si, si + padded, 0.f);
        continue;
      }
      opt.cap(si + from, seen - from);
      const float mx = std::max(m[i], sc * max_of(si, from, seen));
      // whole vectors from the one holding `from` to the one holding `seen - 1` (a scalar tail
      // for the keys past a row's causal edge took a third of the exponentials' time), then
      // the keys it should not see set to zero
      const int64_t a = from / L * L, b = (seen + L - 1) / L * L;
#pragma omp simd
      for (int64_t t = a; t < b; ++t) si[t] = exp_nonpositive(std::min(madd(si[t], sc, -mx), 0.f));
      std::fill(si, si + from, 0.f);
      std::fill(si + seen, si + padded, 0.f);
      vf vsum = simd::zero();
      for (int64_t t = a; t < b; t += L) vsum = simd::add(vsum, simd::load(si + t));
      const float sum = simd::reduce_add(vsum);
      if (mx != m[i]) {
        const float alpha = l[i] == 0.f ? 0.f : exp_nonpositive(m[i] - mx);
        float* ai = acc + i * D;
        const vf va = simd::set1(alpha);
        for (int d = 0; d < D; d += L) simd::store(ai + d, simd::mul(va, simd::load(ai + d)));
        l[i] *= alpha;
        m[i] = mx;
      }
      l[i] += sum;
    }
    if (amx) {
      if constexpr (kPair) {
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t c = 0; c < padded; c += C) PairTiled<D>::round_pairs(s + i * B + c, pb + i * pairs + c / 2);
        AmxPairs<D>::accumulate(pb, pairs, prows, vt + b0 * D / 2, padded, acc);
      }
    } else {
      for (int64_t c = 0; c < bn; c += C) {
        const int64_t cn = std::min<int64_t>(C, bn - c);
        if constexpr (kPair) {
          for (int64_t i = 0; i < rows; ++i) PairTiled<D>::round_pairs(s + i * B + c, pb + i * C / 2);
          PairTiled<D>::accumulate(pb, rows, vt + (b0 + c) * D / 2, (cn + 1) / 2, acc);
        } else if (vwide) {  // the values widened once (`widen_values`): float32's loop, the same sums
          const float* wrows[C];
          for (int64_t t = 0; t < cn; ++t) wrows[t] = vwide + (b0 + c + t) * D;
          Tiled<float, D>::accumulate(s + c, B, rows, wrows, cn, acc);
        } else {
          for (int64_t t = 0; t < cn; ++t) {
            const int64_t key = b0 + c + t;
            vrows[t] = vbase + table[key / block_size] * vb + (key % block_size) * vr;
          }
          K::accumulate(s + c, B, rows, vrows.data(), cn, acc);
        }
      }
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    Q* dst = op + (start + j0 + i / group) * os0 + (h * group + i % group) * os1;
    float denom = l[i], rescale = 1.f;
    if (opt.sinks) {  // the head's sink joins the softmax: one more term in the denominator
      const float sink = opt.sinks[h * group + i % group];
      if (sink > m[i]) {
        rescale = exp_nonpositive(m[i] - sink);
        denom = denom * rescale + 1.f;
      } else {
        denom += exp_nonpositive(sink - m[i]);
      }
    }
    const float inv = rescale / denom;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<Q>(acc[i * D + d] * inv);
  }
}

// The per-token path: request r's tokens [start, start + n) over KV head h, one token at a
// time, over the keys of blocks [from, to) of each token's own (the part of a split query a
// task takes, `kPartitionKeys`; 0 and the table's end: every key). With `partial` null each
// token's output is written; else each (token, query head) leaves its part's unnormalised
// softmax there, [m, l, acc[dim]] at partial + (j * group + g) * (dim + 2), for
// `merge_partitions` (a part that holds no key a token sees: m = -inf, l = 0, acc = 0).
template <typename Q, typename T, int D>
void attend_tokens(const Q* qp, int64_t qs0, int64_t qs1, Q* op, int64_t os0, int64_t os1, int64_t start,
                   int64_t n, int64_t context, int64_t h, int64_t group, int64_t dim, const T* kbase,
                   const T* vbase, const int64_t* table, int64_t kb, int64_t kr, int64_t vb, int64_t vr,
                   int64_t block_size, float fscale, const Options& opt, int64_t from, int64_t to, float* partial,
                   std::vector<float>& qf, std::vector<float>& acc, std::vector<float>& denom,
                   std::vector<float>& scores) {
  using R = Rows<T, D>;
  qf.resize(group * dim);
  acc.resize(group * dim);
  denom.resize(group);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t tok = start + j;
    const int64_t len = context - n + j + 1;  // keys this query sees
    const int64_t nblocks = (len + block_size - 1) / block_size;
    const int64_t lo = opt.first_key(len - 1);  // the window's first key
    const int64_t b0 = std::max(lo / block_size, from);  // blocks before it are not read
    const int64_t b1 = std::min(nblocks, to);
    float* part = partial ? partial + j * group * (dim + 2) : nullptr;
    if (b0 >= b1) {  // only for a part: a whole query always sees its own key
      for (int64_t g = 0; g < group; ++g) {
        float* e = part + g * (dim + 2);
        e[0] = -std::numeric_limits<float>::infinity();
        std::fill(e + 1, e + dim + 2, 0.f);
      }
      continue;
    }
    const int64_t first_key = b0 * block_size, end_key = std::min(len, b1 * block_size);
    const int64_t span = end_key - first_key;  // scores[g * span + t - first_key] for key t
    const int64_t klo = std::max(lo, first_key);
    scores.resize(group * span);
    for (int64_t g = 0; g < group; ++g) {
      const Q* src = qp + tok * qs0 + (h * group + g) * qs1;
      for (int64_t d = 0; d < dim; ++d) qf[g * dim + d] = to_float(src[d]) * fscale;
    }
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t first = b * block_size, rows = std::min(block_size, len - first);
      const int64_t a = b + kPrefetchAhead;  // past the last K block: the first V blocks
      const T* ahead = a < b1 ? kbase + table[a] * kb : a - b1 + b0 < b1 ? vbase + table[a - b1 + b0] * vb : nullptr;
      for (int64_t g = 0; g < group; g += R::kHeads)
        R::scores(qf.data() + g * dim, static_cast<int>(std::min<int64_t>(R::kHeads, group - g)),
                  kbase + table[b] * kb, kr, rows, dim, scores.data() + g * span + first - first_key, span,
                  g == 0 ? ahead : nullptr);
    }
    for (int64_t g = 0; g < group; ++g) {
      float* sg = scores.data() + g * span - first_key;  // indexed by key
      std::fill(sg + first_key, sg + klo, 0.f);  // the first block's keys before the window
      opt.cap(sg + klo, end_key - klo);
      float m = max_of(sg, klo, end_key);  // end_key > klo: a part holds a key the token sees
      const float sink = opt.sinks && !part ? opt.sinks[h * group + g] : 0.f;  // a split query's: at the merge
      if (opt.sinks && !part) m = std::max(m, sink);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = klo; t < end_key; ++t) {
        sg[t] = exp_nonpositive(sg[t] - m);
        sum += sg[t];
      }
      denom[g] = opt.sinks && !part ? sum + exp_nonpositive(sink - m) : sum;
      if (part) part[g * (dim + 2)] = m;
    }
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t first = b * block_size, rows = std::min(block_size, len - first);
      const int64_t a = b + kPrefetchAhead;  // past the part's last V block: the next part's first K blocks
      const T* ahead = a < b1 ? vbase + table[a] * vb : a < nblocks ? kbase + table[a] * kb : nullptr;
      for (int64_t g = 0; g < group; g += R::kHeads)
        R::accumulate(scores.data() + g * span + first - first_key, span,
                      static_cast<int>(std::min<int64_t>(R::kHeads, group - g)), vbase + table[b] * vb, vr, rows, dim,
                      acc.data() + g * dim, g == 0 ? ahead : nullptr);
    }
    for (int64_t g = 0; g < group; ++g) {
      if (part) {
        float* e = part + g * (dim + 2);
        e[1] = denom[g];
        std::copy(acc.begin() + g * dim, acc.begin() + (g + 1) * dim, e + 2);
        continue;
      }
      Q* dst = op + tok * os0 + (h * group + g) * os1;
      const float inv = 1.f / denom[g];
      for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<Q>(acc[g * dim + d] * inv);
    }
  }
}

// A split query's output from its parts' softmaxes (`attend_tokens` with `partial`): parts
// [m, l, acc] for each (token, query head), `stride` floats from one part to the next; the
// sum over the parts in order, rescaled to their largest m (and the head's sink, which
// joins here).
template <typename Q>
void merge_partitions(const float* partial, int64_t parts, int64_t stride, Q* op, int64_t os0, int64_t os1,
                      int64_t start, int64_t n, int64_t h, int64_t group, int64_t dim, const Options& opt,
                      std::vector<float>& acc) {
  acc.resize(dim);
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t g = 0; g < group; ++g) {
      const float* e0 = partial + (j * group + g) * (dim + 2);
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < parts; ++p) m = std::max(m, e0[p * stride]);  // finite: a token sees its own key
      const float sink = opt.sinks ? opt.sinks[h * group + g] : 0.f;
      if (opt.sinks) m = std::max(m, sink);
      float denom = opt.sinks ? exp_nonpositive(sink - m) : 0.f;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = 0; p < parts; ++p) {
        const float* e = e0 + p * stride;
        if (e[1] == 0.f) continue;  // a part without a key this token sees
        const float w = exp_nonpositive(e[0] - m);
        denom += w * e[1];
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) acc[d] += w * e[2 + d];
      }
      Q* dst = op + (start + j) * os0 + (h * group + g) * os1;
      const float inv = 1.f / denom;
      for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<Q>(acc[d] * inv);
    }
  }
}

// Request r's keys for KV head h, float32, transposed chunk by chunk of C keys:
// key t's value d at kt[(t / C) * dim * C + d * C + t % C]; the padding past its last key
// stays zero.
template <int C, typename T>
void transpose_keys(const T* kbase, const int64_t* table, int64_t kb, int64_t kr, int64_t block_size,
                    int64_t keys, int64_t dim, float* kt) {
  for (int64_t t = 0; t < keys; ++t) {
    const T* row = kbase + table[t / block_size] * kb + (t % block_size) * kr;
    float* chunk = kt + (t / C) * dim * C + t % C;
    for (int64_t d = 0; d < dim; ++d) chunk[d * C] = to_float(row[d]);
  }
}

// The pair layouts of `PairTiled` (C keys a chunk): key t's values 2p, 2p + 1 as one 32-bit
// word at kt[(t / C) * (dim / 2) * C + p * C + t % C]; keys 2j, 2j + 1 at value d as one at
// vt[(t / C) * (C / 2) * dim + (t % C / 2) * dim + d], t = 2j. Padding stays zero.
template <int C, typename T>
void pair_keys(const T* kbase, const int64_t* table, int64_t kb, int64_t kr, int64_t block_size, int64_t keys,
               int64_t dim, uint32_t* kt) {
  for (int64_t t = 0; t < keys; ++t) {
    const T* row = kbase + table[t / block_size] * kb + (t % block_size) * kr;
    uint32_t* chunk = kt + (t / C) * (dim / 2) * C + t % C;
    for (int64_t p = 0; p < dim / 2; ++p) std::memcpy(chunk + p * C, row + 2 * p, 4);
  }
}
template <int C, typename T>
void pair_values(const T* vbase, const int64_t* table, int64_t vb, int64_t vr, int64_t block_size, int64_t keys,
                 int64_t dim, uint32_t* vt) {
  static_assert(sizeof(T) == 2);
  for (int64_t t = 0; t < keys; t += 2) {
    const auto* a = reinterpret_cast<const uint16_t*>(vbase + table[t / block_size] * vb + (t % block_size) * vr);
    const int64_t u = t + 1;  // keys is even or u is padding: zero
    const auto* b = u < keys ? reinterpret_cast<const uint16_t*>(vbase + table[u / block_size] * vb + (u % block_size) * vr)
                             : nullptr;
    uint32_t* dst = vt + (t / C) * (C / 2) * dim + (t % C / 2) * dim;
    for (int64_t d = 0; d < dim; ++d) dst[d] = a[d] | (b ? static_cast<uint32_t>(b[d]) << 16 : 0u);
  }
}

// Request r's values for KV head h widened to float32, key t's row at vt[t * dim]: a 16-bit
// cache's V rows on the tiled path with 16 registers, where `Tiled::accumulate` would widen
// each row again for every kAccRows (two) rows of a tile, one widening a vector per two FMAs.
// Widening is exact, so the sums are the same bits as over the cache itself.
template <typename T>
void widen_values(const T* vbase, const int64_t* table, int64_t vb, int64_t vr, int64_t block_size, int64_t keys,
                  int64_t dim, float* vt) {
  for (int64_t t = 0; t < keys; ++t) {
    const T* row = vbase + table[t / block_size] * vb + (t % block_size) * vr;
    float* dst = vt + t * dim;
    for (int64_t d = 0; d < dim; ++d) dst[d] = to_float(row[d]);
  }
}

// q, out: [tokens, heads, dim]; k_cache, v_cache: [kv_heads, blocks, block_size, dim]
// (rows contiguous); block_tables: [reqs, max_blocks]. Request i owns tokens
// [query_start_loc[i], query_start_loc[i + 1]), the last n of its context_lens[i]
// positions; its token j sees keys up to position ctx - n + j (causal).
template <typename Q, typename T, int D>
void attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_tables, const at::Tensor& context_lens,
                    const at::Tensor& query_start_loc, double scale, const Options& opt, at::Tensor& out) {
  constexpr bool kTiled = kVectorized<T, D>;
  const int64_t num_reqs = context_lens.size(0);
  const int64_t heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(0), block_size = k_cache.size(2);
  const int64_t group = heads / kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  const int64_t kh = k_cache.stride(0), kb = k_cache.stride(1), kr = k_cache.stride(2);
  const int64_t vh = v_cache.stride(0), vb = v_cache.stride(1), vr = v_cache.stride(2);
  const Q* qp = q.data_ptr<Q>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  Q* op = out.data_ptr<Q>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  const int64_t* starts = query_start_loc.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);

  // Tasks: (request, KV head, first token of a tile, or -1 for the per-token path, whose
  // query may be split in parts: the part), with the work each does; the longest go first
  // and threads take the next one as they finish.
  struct Task {
    int64_t r, h, j0, part, cost;
  };
  std::vector<Task> tasks;
  std::vector<int64_t> kt_offset(num_reqs, -1);  // into kt, for requests on the tiled path
  int64_t kt_size = 0;
  constexpr int64_t kChunk = kTiled ? Tiled<T, D>::kChunk : 1;
  auto padded = [&](int64_t r) { return (ctx[r] + kChunk - 1) / kChunk * kChunk; };
  // Split queries: a request's parts [part_lo[r], part_lo[r] + parts[r]) of part_blocks
  // blocks each (the first that any of its tokens' windows reaches, up to its last key),
  // their softmaxes at part_offset[r] in `partial` ([kv_heads][parts][n][group][dim + 2]),
  // merged by whichever of a (request, KV head)'s tasks ends last (`remaining`).
  const int64_t part_blocks = std::max<int64_t>(1, kPartitionKeys / block_size);
  std::vector<int64_t> part_lo(num_reqs, 0), parts(num_reqs, 1), part_offset(num_reqs, -1);
  int64_t partial_size = 0;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t n = starts[r + 1] - starts[r];
    if (!kTiled || n <= kShortQuery) {
      const int64_t blocks = (ctx[r] + block_size - 1) / block_size;
      part_lo[r] = opt.first_key(ctx[r] - n) / block_size / part_blocks;
      parts[r] = std::max<int64_t>(1, (blocks + part_blocks - 1) / part_blocks - part_lo[r]);
      if (parts[r] > 1) {
        part_offset[r] = partial_size;
        partial_size += kv_heads * parts[r] * n * group * (dim + 2);
      }
      for (int64_t h = 0; h < kv_heads; ++h) tasks.push_back({r, h, -1, -1, n * ctx[r]});
      continue;
    }
    kt_offset[r] = kt_size;
    kt_size += kv_heads * dim * padded(r);
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t j0 = 0; j0 < n; j0 += kTileTokens)
        tasks.push_back({r, h, j0, 0, std::min(kTileTokens, n - j0) * (ctx[r] - n + std::min(n, j0 + kTileTokens))});
  }
  if (static_cast<int64_t>(tasks.size()) < kSplitBelow * at::get_num_threads()) {  // threads would idle
    std::vector<Task> split;
    for (const Task& t : tasks) {
      if (parts[t.r] == 1) {
        split.push_back(t);
        continue;
      }
      const int64_t n = starts[t.r + 1] - starts[t.r], keys = part_blocks * block_size;
      for (int64_t p = 0; p < parts[t.r]; ++p)
        split.push_back({t.r, t.h, -1, p, n * std::min(keys, ctx[t.r] - (part_lo[t.r] + p) * keys)});
    }
    tasks.swap(split);
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });

  // kPairs: keys and values in bfloat16 pairs (kt_size / 2 words each), else float32 keys
  constexpr bool kPair = kPairs<Q, T, D>;
  std::vector<float> kt(kPair ? 0 : kt_size);
  std::vector<uint32_t> kt2(kPair ? kt_size / 2 : 0), vt2(kPair ? kt_size / 2 : 0);
  // a 16-bit cache's values, widened once (`widen_values`), at kt's offsets; with 16 registers
  // only (AVX-512's passes take six rows, and widening as they load was not measured against it)
  constexpr bool kWidenValues = kTiled && !kPair && !kWide && !std::is_same_v<T, float>;
  std::vector<float> vt32(kWidenValues ? kt_size : 0);
  if (kt_size > 0) {
    at::parallel_for(0, num_reqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r = i / kv_heads, h = i % kv_heads;
        if (kt_offset[r] < 0) continue;
        const int64_t stride = padded(r), at = kt_offset[r] + h * dim * stride;
        const int64_t* table = tables + r * max_blocks;
        if constexpr (kPair) {
          pair_keys<kChunk>(kp + h * kh, table, kb, kr, block_size, ctx[r], dim, kt2.data() + at / 2);
          pair_values<kChunk>(vp + h * vh, table, vb, vr, block_size, ctx[r], dim, vt2.data() + at / 2);
        } else {
          transpose_keys<kChunk>(kp + h * kh, table, kb, kr, block_size, ctx[r], dim, kt.data() + at);
          if constexpr (kWidenValues) widen_values(vp + h * vh, table, vb, vr, block_size, ctx[r], dim, vt32.data() + at);
        }
      }
    });
  }

  std::vector<float> partial(partial_size);
  std::vector<std::atomic<int64_t>> remaining(partial_size ? num_reqs * kv_heads : 0);
  for (int64_t i = 0; i < static_cast<int64_t>(remaining.size()); ++i) remaining[i].store(parts[i / kv_heads]);

  std::atomic<int64_t> next{0};
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  at::parallel_for(0, std::min<int64_t>(num_tasks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    std::vector<float> qf, acc, denom, scores;
    std::vector<const T*> vrows;
    for (int64_t i = next++; i < num_tasks; i = next++) {
      const Task& task = tasks[i];
      const int64_t r = task.r, h = task.h, n = starts[r + 1] - starts[r];
      const int64_t* table = tables + r * max_blocks;
      if (task.j0 < 0 && parts[r] == 1) {
        attend_tokens<Q, T, D>(qp, qs0, qs1, op, os0, os1, starts[r], n, ctx[r], h, group, dim, kp + h * kh,
                               vp + h * vh, table, kb, kr, vb, vr, block_size, fscale, opt, 0,
                               std::numeric_limits<int64_t>::max(), nullptr, qf, acc, denom, scores);
      } else if (task.j0 < 0) {  // a split query: one part (task.part), or all in turn (-1)
        const int64_t stride = n * group * (dim + 2);  // from one part's softmaxes to the next's
        float* head = partial.data() + part_offset[r] + h * parts[r] * stride;
        const int64_t p0 = std::max<int64_t>(task.part, 0), p1 = task.part < 0 ? parts[r] : task.part + 1;
        for (int64_t p = p0; p < p1; ++p) {
          const int64_t from = (part_lo[r] + p) * part_blocks;
          attend_tokens<Q, T, D>(qp, qs0, qs1, op, os0, os1, starts[r], n, ctx[r], h, group, dim, kp + h * kh,
                                 vp + h * vh, table, kb, kr, vb, vr, block_size, fscale, opt, from,
                                 from + part_blocks, head + p * stride, qf, acc, denom, scores);
        }
        if (remaining[r * kv_heads + h].fetch_sub(p1 - p0, std::memory_order_acq_rel) == p1 - p0)  // all done
          merge_partitions<Q>(head, parts[r], stride, op, os0, os1, starts[r], n, h, group, dim, opt, acc);
      } else if constexpr (kTiled) {
        const int64_t at = kt_offset[r] + h * dim * padded(r);
        const void* keys = kPair ? static_cast<const void*>(kt2.data() + at / 2) : kt.data() + at;
        attend_tile<Q, T, D>(qp, qs0, qs1, op, os0, os1, starts[r], n, ctx[r], task.j0,
                             std::min(n, task.j0 + kTileTokens), h, group, keys, kPair ? vt2.data() + at / 2 : nullptr,
                             vp + h * vh, table, vb, vr, block_size, fscale, opt, qf, vrows,
                             kWidenValues ? vt32.data() + at : nullptr);
      }
    }
    atom::amx::release();  // where this thread configured the tiles
  });
}

template <typename Q, typename T>
void dispatch_dim(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bt,
                  const at::Tensor& cl, const at::Tensor& qsl, double scale, const Options& opt, at::Tensor& out) {
  switch (q.size(2)) {
    case 64: return attention_impl<Q, T, 64>(q, k, v, bt, cl, qsl, scale, opt, out);
    case 128: return attention_impl<Q, T, 128>(q, k, v, bt, cl, qsl, scale, opt, out);
    case 576: return attention_impl<Q, T, 576>(q, k, v, bt, cl, qsl, scale, opt, out);  // MLA's latent row (DeepSeek)
    default: return attention_impl<Q, T, 0>(q, k, v, bt, cl, qsl, scale, opt, out);
  }
}

void check_cache(const at::Tensor& c, const char* name) {
  TORCH_CHECK(c.dim() == 4, name, " must be [kv_heads, blocks, block_size, head_dim]");
  TORCH_CHECK(c.stride(3) == 1, name, " rows must be contiguous");
}

}  // namespace

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& context_lens,
                           const at::Tensor& query_start_loc, double scale, int64_t window, double softcap,
                           const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& out_) {
  TORCH_CHECK(q.device().is_cpu(), "paged_attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [tokens, heads, head_dim] with contiguous rows");
  check_cache(k_cache, "k_cache");
  check_cache(v_cache, "v_cache");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache must share a dtype");
  const auto qt = q.scalar_type(), ct = k_cache.scalar_type();
  // A cache in another dtype than q (Config.kv_cache_dtype): float32 queries read bfloat16 and
  // float16 caches as they are, widening each value as it is read; other pairs run with float32 queries.
  if (qt != ct && qt != at::kFloat) {
    const auto wide = paged_attention(q.to(at::kFloat), k_cache, v_cache, block_tables, context_lens, query_start_loc,
                                      scale, window, softcap, sinks, std::nullopt);
    return atom::output(out_, q.sizes(), q.options(), "paged_attention").copy_(wide);
  }
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "q and cache head_dim differ");
  auto tables = block_tables.to(at::kLong).contiguous();
  auto lens = context_lens.to(at::kLong).contiguous();
  auto starts = query_start_loc.to(at::kLong).contiguous();
  TORCH_CHECK(starts.size(0) == lens.size(0) + 1, "query_start_loc needs one entry more than context_lens");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
  Options opt;
  opt.window = window;
  opt.softcap = static_cast<float>(softcap);
  at::Tensor sink_logits;
  if (sinks.has_value()) {
    sink_logits = sinks->to(at::kFloat).contiguous();
    TORCH_CHECK(sink_logits.dim() == 1 && sink_logits.size(0) == q.size(1), "sinks must hold one logit per query head");
    opt.sinks = sink_logits.data_ptr<float>();
  }
  auto out = atom::output(out_, q.sizes(), q.options(), "paged_attention");
  TORCH_CHECK(ct == at::kFloat || ct == at::kBFloat16 || ct == at::kHalf,
              "paged_attention takes caches in float32, bfloat16 or float16, not ", ct);
  if (qt == ct) {
    switch (qt) {
      case at::kFloat: dispatch_dim<float, float>(q, k_cache, v_cache, tables, lens, starts, scale, opt, out); break;
      case at::kBFloat16:
        dispatch_dim<c10::BFloat16, c10::BFloat16>(q, k_cache, v_cache, tables, lens, starts, scale, opt, out);
        break;
      default: dispatch_dim<c10::Half, c10::Half>(q, k_cache, v_cache, tables, lens, starts, scale, opt, out);
    }
  } else if (ct == at::kBFloat16) {  // float32 queries
    dispatch_dim<float, c10::BFloat16>(q, k_cache, v_cache, tables, lens, starts, scale, opt, out);
  } else {
    dispatch_dim<float, c10::Half>(q, k_cache, v_cache, tables, lens, starts, scale, opt, out);
  }
  return out;
}

// k, v: [tokens, kv_heads, dim] -> the pool slots `slot_mapping` names.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  check_cache(k_cache, "k_cache");
  check_cache(v_cache, "v_cache");
  if (k.scalar_type() != k_cache.scalar_type() || v.scalar_type() != v_cache.scalar_type())  // rounded once, here
    return write_kv(k.to(k_cache.scalar_type()), v.to(v_cache.scalar_type()), k_cache, v_cache, slot_mapping);
  TORCH_CHECK(k.dim() == 3 && k.stride(2) == 1 && v.stride(2) == 1, "new K/V must be [tokens, kv_heads, dim], rows contiguous");
  auto slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t tokens = k.size(0), kv_heads = k.size(1), dim = k.size(2);
  const int64_t block_size = k_cache.size(2);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t elem = k.element_size();
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* ks = static_cast<const char*>(k.data_ptr());
  const auto* vs = static_cast<const char*>(v.data_ptr());
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t block = sp[i] / block_size, off = sp[i] % block_size;
      for (int64_t h = 0; h < kv_heads; ++h) {
        std::memcpy(kc + (h * k_cache.stride(0) + block * k_cache.stride(1) + off * k_cache.stride(2)) * elem,
                    ks + (i * k.stride(0) + h * k.stride(1)) * elem, dim * elem);
        std::memcpy(vc + (h * v_cache.stride(0) + block * v_cache.stride(1) + off * v_cache.stride(2)) * elem,
                    vs + (i * v.stride(0) + h * v.stride(1)) * elem, dim * elem);
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "attention of new tokens over their paged KV (CPU)", pybind11::arg("q"),
        pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("block_tables"),
        pybind11::arg("context_lens"), pybind11::arg("query_start_loc"), pybind11::arg("scale"),
        pybind11::arg("window") = 0, pybind11::arg("softcap") = 0.0, pybind11::arg("sinks") = pybind11::none(),
        pybind11::arg("out") = pybind11::none());  // the buffer to write (atom::output)
  m.def("write_kv", &write_kv, "scatter new K/V rows into their pool slots (CPU)");
  m.def("set_amx", &atom::amx::set, "multiply the tiled path's bfloat16 pairs in AMX tiles (on) or with vdpbf16ps; returns whether the tiles are on (only where this build, the CPU and Linux allow them)");
  // Head dims whose long query runs (prompt chunks) are tiled, in float32 and bfloat16;
  // others walk the keys once per token. dispatch_dim instantiates these.
  static_assert(kVectorized<float, 64> && kVectorized<float, 128> && kVectorized<float, 576>);
  m.attr("TILED_HEAD_DIMS") = pybind11::make_tuple(64, 128, 576);
}
