// Row-wise CPU ops beside the matmuls, each computing a row from that row alone (threads split rows, never a row):
// - rms_norm (torch.ops.laneserve_cpu.rms_norm): y = T(T(x / sqrt(mean(x^2) + eps)) * w) per row of the last
//   dimension, rounded where Hugging Face's RMSNorm rounds (to the input's dtype T after the normalization, then
//   after the weight); the sum of squares runs over the row in index order in float32 (built with
//   -ffp-contract=off). One op where the torch form (cpu.FusedRMSNorm, the fallback) takes five.
// - store_kv: new tokens' K and V rows into their cache slots (slot -1 skipped), non-finite values stored as 0:
//   cpu.store_finite_kv's two nan_to_num and two index_copy_ (and the slot check) in one op, the same bytes.
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

template <typename T>
void store_rows(const at::Tensor& x, at::Tensor& cache, const int64_t* slots, int64_t row) {
  const T* src = static_cast<const T*>(x.const_data_ptr());
  T* dst = static_cast<T*>(cache.mutable_data_ptr());
  const int64_t tokens = x.size(0), stride = x.stride(0);
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[t] < 0) continue;
    for (int64_t i = 0; i < row; ++i) {
      const T v = src[t * stride + i];
      dst[slots[t] * row + i] = std::isfinite(float(v)) ? v : T(0);
    }
  }
}

// key, value [tokens, kv_heads, dim] (a token's heads contiguous); caches [blocks, block_size, kv_heads, dim] in
// their dtype; slot_mapping [tokens] int64.
void store_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping) {
  const int64_t row = k_cache.size(2) * k_cache.size(3);
  for (const at::Tensor* t : {&key, &value})
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 3 && t->size(1) * t->size(2) == row && t->stride(2) == 1 &&
                    t->stride(1) == t->size(2) && t->scalar_type() == k_cache.scalar_type() &&
                    t->size(0) == slot_mapping.numel(),
                "store_kv: key and value [tokens, kv_heads, dim] rows in the cache's dtype, one slot each");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  slot_mapping.is_contiguous() && slot_mapping.scalar_type() == at::kLong,
              "store_kv: contiguous caches of one shape, int64 slots");
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < slot_mapping.numel(); ++t)
    TORCH_CHECK(slots[t] < num_slots, "store_kv: slot ", slots[t], " past the cache's ", num_slots);
  if (k_cache.scalar_type() == at::kBFloat16) {
    store_rows<c10::BFloat16>(key, k_cache, slots, row);
    store_rows<c10::BFloat16>(value, v_cache, slots, row);
  } else {
    TORCH_CHECK(k_cache.scalar_type() == at::kFloat, "store_kv: float32 or bfloat16 caches");
    store_rows<float>(key, k_cache, slots, row);
    store_rows<float>(value, v_cache, slots, row);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(laneserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, rms_norm);
  m.def("store_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.impl("store_kv", c10::DispatchKey::CPU, store_kv);
}
