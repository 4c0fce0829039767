// Paged decode attention for CPU: one query per request, K/V read in place from the pool.
//
// The torch path gathers each request's blocks into a contiguous copy before its matrix
// products; on a CPU whose memory bandwidth is the limit, reading the cache once here
// instead is what makes large decode batches fast. Layout: k_cache, v_cache
// [kv_heads, num_blocks, block_size, head_dim]; q, out [num_reqs, heads, head_dim].
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

template <typename scalar_t>
static void decode_kernel(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                          const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                          const torch::Tensor& context_lens, double scale) {
  const int64_t num_reqs = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), bs = k_cache.size(2);
  const int64_t group = heads / kv_heads, max_blocks = block_tables.size(1);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_reqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), scores(group * bs), m(group), l(group);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t r = idx / kv_heads, h = idx % kv_heads;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < dim; ++d)
          qf[g * dim + d] = static_cast<float>(qp[(r * heads + h * group + g) * dim + d]);
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t len = lens[r];
      for (int64_t j = 0; j * bs < len; ++j) {
        const int64_t block = tables[r * max_blocks + j];
        const int64_t n = std::min(bs, len - j * bs);
        const scalar_t* kb = kp + (h * num_blocks + block) * bs * dim;
        const scalar_t* vb = vp + (h * num_blocks + block) * bs * dim;
        for (int64_t g = 0; g < group; ++g) {
          float block_max = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t < n; ++t) {
            float s = 0.f;
            for (int64_t d = 0; d < dim; ++d) s += qf[g * dim + d] * static_cast<float>(kb[t * dim + d]);
            s *= fscale;
            scores[g * bs + t] = s;
            block_max = std::max(block_max, s);
          }
          const float new_m = std::max(m[g], block_max);
          const float correction = std::exp(m[g] - new_m);  // 0 on the first block
          l[g] *= correction;
          float* a = &acc[g * dim];
          for (int64_t d = 0; d < dim; ++d) a[d] *= correction;
          for (int64_t t = 0; t < n; ++t) {
            const float p = std::exp(scores[g * bs + t] - new_m);
            l[g] += p;
            for (int64_t d = 0; d < dim; ++d) a[d] += p * static_cast<float>(vb[t * dim + d]);
          }
          m[g] = new_m;
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < dim; ++d)
          op[(r * heads + h * group + g) * dim + d] = static_cast<scalar_t>(acc[g * dim + d] / l[g]);
    }
  });
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs expected");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and the cache must share a dtype");
  auto out = torch::empty_like(q);
  auto tables = block_tables.to(torch::kInt64).contiguous();
  auto lens = context_lens.to(torch::kInt64).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(out, q, k_cache, v_cache, tables, lens, scale);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode, "paged decode attention (CPU)"); }
