// Gated DeltaNet's decode step on CPU: one token for each of B requests, each request's
// recurrent state S [H, Dk, Dv] updated in place in the pool.
//
// A decode step is bound by the states' bytes (H * Dk * Dv values a request and layer), so
// the kernel reads each state row twice while it is in cache and memory once: the torch path
// (a bmm, then mul_ and baddbmm_ on the pool row) streams the state from memory three times
// and writes it twice. For each (request, head) task:
//   read_q = q^T S, read_k = k^T S            (one pass over S's rows, in order of Dk)
//   delta  = (v - exp(g) read_k) * beta
//   out    = exp(g) read_q + (q . k) delta    (q^T S_new, without reading S_new)
//   S      = exp(g) S + k delta^T             (the second pass, rows still in L1/L2)
// in float32 whatever the state's dtype (a narrower state rounds once, when it is stored).
// The slots come from a tensor and each task's sums do not depend on B: a replayed decode
// graph (atom_core/runner/decode_graph.py) and a batch of any size compute a row alike.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "out_tensor.h"  // atom_core/layers/csrc, on the include path CppKernel sets
#include "simd.h"

namespace {

using atom::from_float;
using atom::to_float;

template <typename S>
void step_task(const float* q, const float* k, const float* v, float g, float beta, S* state, int64_t dk,
               int64_t dv, float* out, std::vector<float>& scratch) {
  scratch.assign(2 * dv, 0.f);
  float* rq = scratch.data();
  float* rk = rq + dv;
  for (int64_t d = 0; d < dk; ++d) {
    const S* row = state + d * dv;
    const float a = q[d], c = k[d];
#pragma omp simd
    for (int64_t e = 0; e < dv; ++e) {
      const float s = to_float(row[e]);
      rq[e] += a * s;
      rk[e] += c * s;
    }
  }
  float qk = 0.f;
  for (int64_t d = 0; d < dk; ++d) qk += q[d] * k[d];
  const float decay = std::exp(g);
  float* delta = rk;  // read_k is not needed past delta
#pragma omp simd
  for (int64_t e = 0; e < dv; ++e) {
    delta[e] = (v[e] - decay * rk[e]) * beta;
    out[e] = decay * rq[e] + qk * delta[e];
  }
  for (int64_t d = 0; d < dk; ++d) {
    S* row = state + d * dv;
    const float c = k[d];
#pragma omp simd
    for (int64_t e = 0; e < dv; ++e) row[e] = from_float<S>(decay * to_float(row[e]) + c * delta[e]);
  }
}

}  // namespace

// q, k: [B, H, Dk] float32 (head-expanded, l2-normalised, q scaled); v: [B, H, Dv] float32;
// g, beta: [B, H] float32; states: [slots, H, Dk, Dv] float32, bfloat16 or float16, rows
// `slots` ([B] int64, distinct) updated in place. Returns out [B, H, Dv] float32.
at::Tensor gdn_decode_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                           const at::Tensor& beta, at::Tensor& states, const at::Tensor& slots,
                           const c10::optional<at::Tensor>& out_) {
  TORCH_CHECK(states.device().is_cpu() && states.dim() == 4 && states.is_contiguous(),
              "gdn_decode_step: states must be a contiguous CPU tensor [slots, H, Dk, Dv]");
  const int64_t n = states.size(0), H = states.size(1), dk = states.size(2), dv = states.size(3);
  const int64_t B = q.size(0);
  auto check = [&](const at::Tensor& t, std::initializer_list<int64_t> shape, const char* name) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.sizes() == at::IntArrayRef(shape),
                "gdn_decode_step: ", name, " must be contiguous float32 ", at::IntArrayRef(shape), ", got ",
                t.scalar_type(), " ", t.sizes());
  };
  check(q, {B, H, dk}, "q");
  check(k, {B, H, dk}, "k");
  check(v, {B, H, dv}, "v");
  check(g, {B, H}, "g");
  check(beta, {B, H}, "beta");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == B,
              "gdn_decode_step: slots must be int64 [", B, "]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(0 <= sp[b] && sp[b] < n, "gdn_decode_step: slot ", sp[b], " is outside the pool's ", n, " slots");
  auto out = atom::output(out_, {B, H, dv}, q.options(), "gdn_decode_step");
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float* op = out.data_ptr<float>();
  auto run = [&](auto* st) {
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch;
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / H, h = i % H;
        step_task(qp + i * dk, kp + i * dk, vp + i * dv, gp[i], bp[i], st + (sp[b] * H + h) * dk * dv, dk, dv,
                  op + i * dv, scratch);
      }
    });
  };
  switch (states.scalar_type()) {
    case at::kFloat: run(states.data_ptr<float>()); break;
    case at::kBFloat16: run(states.data_ptr<c10::BFloat16>()); break;
    case at::kHalf: run(states.data_ptr<c10::Half>()); break;
    default: TORCH_CHECK(false, "gdn_decode_step: states must be float32, bfloat16 or float16, not ", states.scalar_type());
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gdn_decode_step", &gdn_decode_step,
        "Gated DeltaNet decode step: out = q^T S_new per (request, head), states' rows `slots` updated in place (CPU)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"), py::arg("states"), py::arg("slots"),
        py::arg("out") = py::none());
  m.attr("VARIANT") = ATOM_STR(ATOM_VARIANT);
}
