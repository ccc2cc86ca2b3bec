// Row-wise CPU ops beside the matmuls, each computing a row from that row alone (threads split rows, never a row):
// - rms_norm (torch.ops.laneserve_cpu.rms_norm): y = T(T(x / sqrt(mean(x^2) + eps)) * w) per row of the last
//   dimension, rounded where Hugging Face's RMSNorm rounds (to the input's dtype T after the normalization, then
//   after the weight); the sum of squares runs over the row in index order in float32 (built with
//   -ffp-contract=off). One op where the torch form (cpu.FusedRMSNorm, the fallback) takes five.
// - rope_store: a step's fused QKV rows [tokens, (heads + 2 kv_heads) * dim] rotated and stored: model.apply_rope on
//   the Q and K heads, rounded where its torch ops round (q' = T(fma(roll(x), sin, T(x * cos))), sin's first half
//   negated), then cpu.store_finite_kv's store of the K and V heads (slot -1 skipped, non-finite values stored
//   as 0); returns the rotated Q heads [tokens, heads, dim]. One op where cpu.FusedBlock's torch form takes eight.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

namespace {

// Calls f(T{}) with T the C++ type of dtype: float32 or bfloat16.
template <typename F>
void by_dtype(at::ScalarType dtype, const char* op, F&& f) {
  if (dtype == at::kBFloat16) return f(c10::BFloat16{});
  TORCH_CHECK(dtype == at::kFloat, op, ": float32 or bfloat16, got ", dtype);
  f(float{});
}

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
  by_dtype(x.scalar_type(), "rms_norm", [&](auto type) {
    using T = decltype(type);
    rms_rows(x.data_ptr<T>(), weight.data_ptr<T>(), y.data_ptr<T>(), rows, d, (float)eps);
  });
  return y;
}

// Element i of a head takes x[i] * cos[i] + x[(i + dim / 2) % dim] * sin[i] (torch.roll by dim / 2), the second
// product and the sum fused as torch's addcmul fuses them in float32 (a product of two bfloat16 values is exact in
// float32: there fused or not is the same). FMA: used only where cpu_matmul.isa() vouches for AVX2 and FMA.
template <typename T, typename C>
void rope_rows(const T* qkv, const T* cos, const T* sin, T* q, C* k_cache, C* v_cache, const int64_t* slots,
               int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim) {
  const int64_t width = (heads + 2 * kv_heads) * dim, row = kv_heads * dim;
  auto put_row = [row](const T* src, C* dst) {  // a K or V row (finite values, else 0) into its slot, in C
    for (int64_t i = 0; i < row; ++i) dst[i] = std::isfinite(float(src[i])) ? C(float(src[i])) : C(0);
  };
  // The target on the task itself: OpenMP's outlined region around it would not inherit one of rope_rows'.
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) __attribute__((target("avx2,fma"))) {
    std::vector<T> k(row);
    for (int64_t t = begin; t < end; ++t) {
      const T *x = qkv + t * width, *c = cos + t * dim, *s = sin + t * dim;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        const T* xh = x + h * dim;
        T* out = h < heads ? q + (t * heads + h) * dim : k.data() + (h - heads) * dim;
        for (int64_t half = 0; half < dim; half += dim / 2)  // in halves: roll's source index without a modulo
          for (int64_t i = half, from = dim / 2 - 2 * half; i < half + dim / 2; ++i)
            out[i] = T(std::fma(float(xh[i + from]), float(s[i]), float(T(float(xh[i]) * float(c[i])))));
      }
      if (slots[t] >= 0) {
        put_row(k.data(), k_cache + slots[t] * row);
        put_row(x + (heads + kv_heads) * dim, v_cache + slots[t] * row);
      }
    }
  });
}

// qkv [tokens, (heads + 2 kv_heads) * dim]; cos, sin [tokens, 1, dim] (or [tokens, dim]); caches [blocks,
// block_size, kv_heads, dim] in qkv's dtype or bfloat16 (rounded to nearest even as stored); slot_mapping [tokens]
// int64.
at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                      at::Tensor v_cache, const at::Tensor& slot_mapping, int64_t heads) {
  const int64_t tokens = qkv.size(0), kv_heads = k_cache.size(2), dim = k_cache.size(3);
  const auto dtype = qkv.scalar_type(), cache = k_cache.scalar_type();
  for (const at::Tensor* t : {&qkv, &cos, &sin})
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->scalar_type() == dtype,
                "rope_store: contiguous CPU tensors in qkv's dtype");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (heads + 2 * kv_heads) * dim && cos.numel() == tokens * dim &&
                  sin.numel() == tokens * dim && slot_mapping.numel() == tokens && dim % 2 == 0,
              "rope_store: qkv [tokens, (heads + 2 kv_heads) * dim], cos and sin a row of dim per token");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == cache && (cache == dtype || cache == at::kBFloat16) &&
                  slot_mapping.is_contiguous() && slot_mapping.scalar_type() == at::kLong,
              "rope_store: contiguous caches of one shape in qkv's dtype or bfloat16, int64 slots");
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] < k_cache.size(0) * k_cache.size(1), "rope_store: slot ", slots[t], " past the cache");
  at::Tensor q = at::empty({tokens, heads, dim}, qkv.options());
  by_dtype(dtype, "rope_store", [&](auto type) {
    using T = decltype(type);
    auto store = [&](auto* k, auto* v) {
      rope_rows(qkv.const_data_ptr<T>(), cos.const_data_ptr<T>(), sin.const_data_ptr<T>(), q.mutable_data_ptr<T>(),
                k, v, slots, tokens, heads, kv_heads, dim);
    };
    using C = c10::BFloat16;  // a bfloat16 cache beside float32
    if (cache != dtype) return store(k_cache.mutable_data_ptr<C>(), v_cache.mutable_data_ptr<C>());
    store(k_cache.mutable_data_ptr<T>(), v_cache.mutable_data_ptr<T>());
  });
  return q;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(laneserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, rms_norm);
  m.def("rope_store(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "int heads) -> Tensor");
  m.impl("rope_store", c10::DispatchKey::CPU, rope_store);
}
