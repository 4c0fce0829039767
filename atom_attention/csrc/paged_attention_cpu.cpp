// Paged attention for CPU: reads each request's K/V where they lie in the block pool.
//
// The torch path gathers every request's blocks into a fresh tensor before two matrix
// products; at decode that copy costs as much as the products themselves. Here one task
// per (request, KV head) walks the request's block table: the scores of the query heads
// sharing that KV head against the K rows, a float32 softmax, then the weighted sum of
// the V rows, accumulated in float32 whatever the cache dtype.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"  // atom_core/layers/csrc, on the include path CppKernel sets

namespace {

using atom::to_float;

// exp(x) for x <= 0 (a score minus its row's maximum), within ~2 ulp of expf and
// written so the compiler vectorises it; libm's expf is scalar.
inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;  // exp(-87) ~ 1.6e-38: smaller weights round to nothing
  const float k = __builtin_floorf(x * 1.44269504088896341f + 0.5f);  // x = k ln2 + r
  const float r = (x - k * 0.693145751953125f) - k * 1.42860682030941723212e-6f;
  float p = 1.f / 5040.f;  // Taylor series of exp(r), |r| <= ln2 / 2: error < 1.2e-7
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
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

template <typename T, int D>
struct VecRows {
  static constexpr bool kWide = simd::kRegisters == 32;  // AVX-512's 32 registers, else 16
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
template <typename T, int D>
void VecRows<T, D>::accumulate_sliced(const float* p, int64_t p_stride, int hb, const T* rows, int64_t stride,
                                      int64_t n, float* acc, const T* ahead) {
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
constexpr bool kVectorized = D > 0 && D % L == 0 && (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>);
template <typename T, int D>
using Rows = std::conditional_t<kVectorized<T, D>, VecRows<T, D>, GenericRows<T>>;

// q, out: [tokens, heads, dim]; k_cache, v_cache: [kv_heads, blocks, block_size, dim]
// (rows contiguous); block_tables: [reqs, max_blocks]. Request i owns tokens
// [query_start_loc[i], query_start_loc[i + 1]), the last n of its context_lens[i]
// positions; its token j sees keys up to position ctx - n + j (causal).
template <typename T, int D>
void attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_tables, const at::Tensor& context_lens,
                    const at::Tensor& query_start_loc, double scale, at::Tensor& out) {
  using R = Rows<T, D>;
  const int64_t num_reqs = context_lens.size(0);
  const int64_t heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(0), block_size = k_cache.size(2);
  const int64_t group = heads / kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  const int64_t kh = k_cache.stride(0), kb = k_cache.stride(1), kr = k_cache.stride(2);
  const int64_t vh = v_cache.stride(0), vb = v_cache.stride(1), vr = v_cache.stride(2);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  const int64_t* starts = query_start_loc.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_reqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), denom(group), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / kv_heads, h = task % kv_heads;
      const int64_t n = starts[r + 1] - starts[r];
      const int64_t* table = tables + r * max_blocks;
      const T* kbase = kp + h * kh;
      const T* vbase = vp + h * vh;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t tok = starts[r] + j;
        const int64_t len = ctx[r] - n + j + 1;  // keys this query sees
        scores.resize(group * len);
        for (int64_t g = 0; g < group; ++g) {
          const T* src = qp + tok * qs0 + (h * group + g) * qs1;
          for (int64_t d = 0; d < dim; ++d) qf[g * dim + d] = to_float(src[d]) * fscale;
        }
        const int64_t nblocks = (len + block_size - 1) / block_size;
        for (int64_t b = 0; b < nblocks; ++b) {
          const int64_t start = b * block_size, rows = std::min(block_size, len - start);
          const int64_t a = b + kPrefetchAhead;  // past the last K block: the first V blocks
          const T* ahead = a < nblocks ? kbase + table[a] * kb : a < 2 * nblocks ? vbase + table[a - nblocks] * vb : nullptr;
          for (int64_t g = 0; g < group; g += R::kHeads)
            R::scores(qf.data() + g * dim, static_cast<int>(std::min<int64_t>(R::kHeads, group - g)),
                      kbase + table[b] * kb, kr, rows, dim, scores.data() + g * len + start, len,
                      g == 0 ? ahead : nullptr);
        }
        for (int64_t g = 0; g < group; ++g) {
          float* sg = scores.data() + g * len;
          float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
          for (int64_t t = 0; t < len; ++t) m = std::max(m, sg[t]);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < len; ++t) {
            sg[t] = exp_nonpositive(sg[t] - m);
            sum += sg[t];
          }
          denom[g] = sum;
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t b = 0; b < nblocks; ++b) {
          const int64_t start = b * block_size, rows = std::min(block_size, len - start);
          const T* ahead = b + kPrefetchAhead < nblocks ? vbase + table[b + kPrefetchAhead] * vb : nullptr;
          for (int64_t g = 0; g < group; g += R::kHeads)
            R::accumulate(scores.data() + g * len + start, len, static_cast<int>(std::min<int64_t>(R::kHeads, group - g)),
                          vbase + table[b] * vb, vr, rows, dim, acc.data() + g * dim, g == 0 ? ahead : nullptr);
        }
        for (int64_t g = 0; g < group; ++g) {
          T* dst = op + tok * os0 + (h * group + g) * os1;
          const float inv = 1.f / denom[g];
          for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(acc[g * dim + d] * inv);
        }
      }
    }
  });
}

template <typename T>
void dispatch_dim(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bt,
                  const at::Tensor& cl, const at::Tensor& qsl, double scale, at::Tensor& out) {
  switch (q.size(2)) {
    case 64: return attention_impl<T, 64>(q, k, v, bt, cl, qsl, scale, out);
    case 128: return attention_impl<T, 128>(q, k, v, bt, cl, qsl, scale, out);
    case 576: return attention_impl<T, 576>(q, k, v, bt, cl, qsl, scale, out);  // MLA's latent row (DeepSeek)
    default: return attention_impl<T, 0>(q, k, v, bt, cl, qsl, scale, out);
  }
}

void check_cache(const at::Tensor& c, const char* name) {
  TORCH_CHECK(c.dim() == 4, name, " must be [kv_heads, blocks, block_size, head_dim]");
  TORCH_CHECK(c.stride(3) == 1, name, " rows must be contiguous");
}

}  // namespace

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& context_lens,
                           const at::Tensor& query_start_loc, double scale) {
  TORCH_CHECK(q.device().is_cpu(), "paged_attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [tokens, heads, head_dim] with contiguous rows");
  check_cache(k_cache, "k_cache");
  check_cache(v_cache, "v_cache");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "q and cache head_dim differ");
  auto tables = block_tables.to(at::kLong).contiguous();
  auto lens = context_lens.to(at::kLong).contiguous();
  auto starts = query_start_loc.to(at::kLong).contiguous();
  TORCH_CHECK(starts.size(0) == lens.size(0) + 1, "query_start_loc needs one entry more than context_lens");
  auto out = at::empty_like(q, at::MemoryFormat::Contiguous);
  switch (q.scalar_type()) {
    case at::kFloat: dispatch_dim<float>(q, k_cache, v_cache, tables, lens, starts, scale, out); break;
    case at::kBFloat16: dispatch_dim<c10::BFloat16>(q, k_cache, v_cache, tables, lens, starts, scale, out); break;
    case at::kHalf: attention_impl<c10::Half, 0>(q, k_cache, v_cache, tables, lens, starts, scale, out); break;
    default: TORCH_CHECK(false, "paged_attention takes float32, bfloat16 or float16, not ", q.scalar_type());
  }
  return out;
}

// k, v: [tokens, kv_heads, dim] -> the pool slots `slot_mapping` names.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  check_cache(k_cache, "k_cache");
  check_cache(v_cache, "v_cache");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(),
              "new K/V and the caches must share a dtype");
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
  m.def("paged_attention", &paged_attention, "attention of new tokens over their paged KV (CPU)");
  m.def("write_kv", &write_kv, "scatter new K/V rows into their pool slots (CPU)");
}
