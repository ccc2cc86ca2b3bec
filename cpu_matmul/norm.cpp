// RMSNorm for the CPU path, registered as torch.ops.laneserve_cpu.rms_norm: y = T(T(x / sqrt(mean(x^2) + eps)) * w)
// per row of the last dimension, rounded where Hugging Face's RMSNorm rounds (to the input's dtype T after the
// normalization, then after the weight). One row is one task's (threads split rows, never a row), and its sum of
// squares runs over the row in index order in float32 (built with -ffp-contract=off), so a row's bits depend on
// that row alone. One op where the torch form (cpu.FusedRMSNorm, the fallback) takes five.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>

namespace {

template <typename T>
void rms_rows(const T* x, const T* w, T* y, int64_t rows, int64_t d, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * d;
      float squares = 0.f;
      for (int64_t i = 0; i < d; ++i) squares += float(xr[i]) * float(xr[i]);
      const float inv = 1.f / std::sqrt(squares / float(d) + eps);
      for (int64_t i = 0; i < d; ++i) y[r * d + i] = T(float(T(float(xr[i]) * inv)) * float(w[i]));
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && weight.is_contiguous() && x.dim() >= 1 &&
                  weight.dim() == 1 && x.size(-1) == weight.size(0) && x.scalar_type() == weight.scalar_type(),
              "rms_norm: x must be a contiguous CPU tensor whose last dimension is weight's, in weight's dtype");
  at::Tensor y = at::empty_like(x);
  const int64_t d = weight.size(0), rows = d ? x.numel() / d : 0;
  if (x.scalar_type() == at::kFloat)
    rms_rows(x.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(), rows, d, (float)eps);
  else if (x.scalar_type() == at::kBFloat16)
    rms_rows(x.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), rows, d,
             (float)eps);
  else
    TORCH_CHECK(false, "rms_norm: float32 or bfloat16, got ", x.scalar_type());
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(laneserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, rms_norm);
}
