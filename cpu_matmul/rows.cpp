// Row-wise CPU ops beside the matmuls, each computing a row from that row alone (threads split rows, never a row):
// - rms_norm (torch.ops.laneserve_cpu.rms_norm): y = T(T(x / sqrt(mean(x^2) + eps)) * w) per row of the last
//   dimension, rounded where Hugging Face's RMSNorm rounds (to the input's dtype T after the normalization, then
//   after the weight); the sum of squares runs over the row in index order in float32 (built with
//   -ffp-contract=off). One op where the torch form (cpu.FusedRMSNorm, the fallback) takes five.
// - store_kv: new tokens' K and V rows into their cache slots (slot -1 skipped), non-finite values stored as 0:
//   cpu.store_finite_kv's two nan_to_num and two index_copy_ (and the slot check) in one op, the same bytes.
// - rope_store: a step's fused QKV rows [tokens, (heads + 2 kv_heads) * dim] rotated and stored: model.apply_rope on
//   the Q and K heads, rounded where its torch ops round (q' = T(fma(roll(x), sin, T(x * cos))), sin's first half
//   negated), then store_kv's store of the K and V heads; returns the rotated Q heads [tokens, heads, dim]. One op
//   where cpu.FusedBlock's torch form takes eight.
// - attend: a Llama layer's attention half for a step of generated tokens, x + o(attention(rope_store(qkv(
//   rms_norm(x))))), attention by token_attention: the ops cpu.FusedBlock would call, called from here (one op
//   where the Python form takes six, and BucketedAttention's Python).
// - mlp: a Llama layer's MLP with its norm and residual, x + down(silu(gate) * up) of gate_up(rms_norm(x)): the ops
//   cpu.FusedBlock would call (rms_norm, the kernel's linear, ATen's silu and mul), called from here: the same bits
//   in one op where the Python form takes seven.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
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

// A K or V row (finite values, else 0) into its slot.
template <typename T>
inline void put_row(const T* src, T* dst, int64_t row) {
  for (int64_t i = 0; i < row; ++i) dst[i] = std::isfinite(float(src[i])) ? src[i] : T(0);
}

template <typename T>
void store_rows(const at::Tensor& x, at::Tensor& cache, const int64_t* slots, int64_t row) {
  const T* src = static_cast<const T*>(x.const_data_ptr());
  T* dst = static_cast<T*>(cache.mutable_data_ptr());
  const int64_t tokens = x.size(0), stride = x.stride(0);
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[t] >= 0) put_row(src + t * stride, dst + slots[t] * row, row);
  }
}

void check_slots(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  slot_mapping.is_contiguous() && slot_mapping.scalar_type() == at::kLong,
              "store_kv: contiguous caches of one shape, int64 slots");
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < slot_mapping.numel(); ++t)
    TORCH_CHECK(slots[t] < num_slots, "store_kv: slot ", slots[t], " past the cache's ", num_slots);
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
  check_slots(k_cache, v_cache, slot_mapping);
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  by_dtype(k_cache.scalar_type(), "store_kv", [&](auto type) {
    store_rows<decltype(type)>(key, k_cache, slots, row);
    store_rows<decltype(type)>(value, v_cache, slots, row);
  });
}

// Element i of a head takes x[i] * cos[i] + x[(i + dim / 2) % dim] * sin[i] (torch.roll by dim / 2), the second
// product and the sum fused as torch's addcmul fuses them in float32 (a product of two bfloat16 values is exact in
// float32: there fused or not is the same). FMA: used only where cpu_matmul.isa() vouches for AVX2 and FMA.
template <typename T>
__attribute__((target("avx2,fma"))) void rope_rows(const T* qkv, const T* cos, const T* sin, T* q, T* k_cache,
                                                   T* v_cache, const int64_t* slots, int64_t tokens, int64_t heads,
                                                   int64_t kv_heads, int64_t dim) {
  const int64_t width = (heads + 2 * kv_heads) * dim, row = kv_heads * dim;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<T> k(row);
    for (int64_t t = begin; t < end; ++t) {
      const T *x = qkv + t * width, *c = cos + t * dim, *s = sin + t * dim;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        const T* xh = x + h * dim;
        T* out = h < heads ? q + (t * heads + h) * dim : k.data() + (h - heads) * dim;
        for (int64_t i = 0; i < dim; ++i)
          out[i] = T(std::fma(float(xh[(i + dim / 2) % dim]), float(s[i]), float(T(float(xh[i]) * float(c[i])))));
      }
      if (slots[t] >= 0) {
        put_row(k.data(), k_cache + slots[t] * row, row);
        put_row(x + (heads + kv_heads) * dim, v_cache + slots[t] * row, row);
      }
    }
  });
}

// qkv [tokens, (heads + 2 kv_heads) * dim]; cos, sin [tokens, 1, dim] (or [tokens, dim]); caches [blocks,
// block_size, kv_heads, dim], all in one dtype; slot_mapping [tokens] int64.
at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                      at::Tensor v_cache, const at::Tensor& slot_mapping, int64_t heads) {
  const int64_t tokens = qkv.size(0), kv_heads = k_cache.size(2), dim = k_cache.size(3);
  const auto dtype = k_cache.scalar_type();
  for (const at::Tensor* t : {&qkv, &cos, &sin})
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->scalar_type() == dtype,
                "rope_store: contiguous CPU tensors in the cache's dtype");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (heads + 2 * kv_heads) * dim && cos.numel() == tokens * dim &&
                  sin.numel() == tokens * dim && slot_mapping.numel() == tokens && dim % 2 == 0,
              "rope_store: qkv [tokens, (heads + 2 kv_heads) * dim], cos and sin a row of dim per token");
  check_slots(k_cache, v_cache, slot_mapping);
  at::Tensor q = at::empty({tokens, heads, dim}, qkv.options());
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  by_dtype(dtype, "rope_store", [&](auto type) {
    using T = decltype(type);
    rope_rows(qkv.const_data_ptr<T>(), cos.const_data_ptr<T>(), sin.const_data_ptr<T>(), q.mutable_data_ptr<T>(),
              k_cache.mutable_data_ptr<T>(), v_cache.mutable_data_ptr<T>(), slots, tokens, heads, kv_heads, dim);
  });
  return q;
}

using LinearOp = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t,
                            const std::optional<at::Tensor>&);

// The layer's arguments first (bound once in Python, passed by position), then the step's. norm [hidden]; qkv and
// o: cpu_matmul.Linear's packed weights, kinds and widths; x [tokens, hidden]; cos to slot_mapping: rope_store's;
// heads, scale, window and block_tables to positions: token_attention's.
at::Tensor attend(const at::Tensor& norm, double eps, const at::Tensor& qkv, int64_t qkv_kind, int64_t qkv_n,
                  int64_t heads, double scale, int64_t window, const at::Tensor& o, int64_t o_kind, int64_t o_n,
                  int64_t isa, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                  at::Tensor v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                  const at::Tensor& rows, const at::Tensor& seqs, const at::Tensor& positions) {
  static auto linear = c10::Dispatcher::singleton().findSchemaOrThrow("laneserve_cpu::linear", "").typed<LinearOp>();
  static auto attention = c10::Dispatcher::singleton().findSchemaOrThrow("laneserve_cpu::token_attention", "").typed<
      void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
           const at::Tensor&, const at::Tensor&, double, int64_t, const std::optional<at::Tensor>&,
           const std::optional<at::Tensor>&, at::Tensor)>();
  const at::Tensor q = rope_store(linear.call(rms_norm(x, norm, eps), qkv, qkv_kind, qkv_n, isa, std::nullopt), cos,
                                  sin, k_cache, v_cache, slot_mapping, heads);
  at::Tensor out = at::empty_like(q);
  attention.call(q, k_cache, v_cache, block_tables, rows, seqs, positions, scale, window, std::nullopt, std::nullopt,
                 out);
  return linear.call(out.view({x.size(0), -1}), o, o_kind, o_n, isa, x);
}

// norm [hidden]; gate_up and down: cpu_matmul.Linear's packed weights, kinds and widths; x [tokens, hidden].
at::Tensor mlp(const at::Tensor& norm, double eps, const at::Tensor& gate_up, int64_t gate_up_kind, int64_t gate_up_n,
               const at::Tensor& down, int64_t down_kind, int64_t down_n, int64_t isa, const at::Tensor& x) {
  static auto linear = c10::Dispatcher::singleton().findSchemaOrThrow("laneserve_cpu::linear", "").typed<LinearOp>();
  const at::Tensor both = linear.call(rms_norm(x, norm, eps), gate_up, gate_up_kind, gate_up_n, isa, std::nullopt);
  const auto halves = both.view({x.size(0), 2, -1}).unbind(1);
  return linear.call(at::mul(at::silu(halves[0]), halves[1]), down, down_kind, down_n, isa, x);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(laneserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, rms_norm);
  m.def("store_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.impl("store_kv", c10::DispatchKey::CPU, store_kv);
  m.def("rope_store(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "int heads) -> Tensor");
  m.impl("rope_store", c10::DispatchKey::CPU, rope_store);
  m.def("attend(Tensor norm, float eps, Tensor qkv, int qkv_kind, int qkv_n, int heads, float scale, int window, "
        "Tensor o, int o_kind, int o_n, int isa, Tensor x, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slot_mapping, Tensor block_tables, Tensor rows, Tensor seqs, Tensor positions) "
        "-> Tensor");
  m.impl("attend", c10::DispatchKey::CPU, attend);
  m.def("mlp(Tensor norm, float eps, Tensor gate_up, int gate_up_kind, int gate_up_n, Tensor down, int down_kind, "
        "int down_n, int isa, Tensor x) -> Tensor");
  m.impl("mlp", c10::DispatchKey::CPU, mlp);
}
