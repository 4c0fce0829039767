// A kernel's output tensor: the caller's `out` where it passes one, else a new tensor.
//
// A replayed decode graph (atom_core/runner/decode_graph.py) passes the buffer the kernel wrote at
// capture, so that every later kernel of the graph, which holds that buffer, reads this step's
// values. The buffer must be exactly what the kernel would allocate: a wrong one is an error, never
// a write past its end.
#pragma once

// ATen's tensor and `empty` alone: torch/extension.h (the whole C++ frontend) would triple each
// kernel's build time
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/accumulate.h>

namespace atom {

inline at::Tensor output(const c10::optional<at::Tensor>& out, at::IntArrayRef sizes, const at::TensorOptions& options,
                         const char* kernel) {
  if (!out.has_value() || !out->defined()) return at::empty(sizes, options);
  // any shape of the same values (the kernel may return a view of its output)
  TORCH_CHECK(out->numel() == c10::multiply_integers(sizes) && out->scalar_type() == c10::typeMetaToScalarType(options.dtype()) &&
                  out->device() == options.device() && out->is_contiguous(),
              kernel, ": out must be a contiguous ", c10::typeMetaToScalarType(options.dtype()), " tensor of ",
              sizes, "'s size, got ", out->scalar_type(), " ", out->sizes());
  return out->view(sizes);
}

}  // namespace atom
