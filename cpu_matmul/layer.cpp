// A Llama layer's decode step as two ops, composed in C++ from the kernels' ops so that a step of one token pays
// no Python between them: glue, no arithmetic of its own (cpu.FusedBlock calls them; their Python form is its
// other path, and test_cpu_matmul.py checks both give Block.forward's logits bit for bit).
// - attend: the attention half for a step whose tokens all take token_attention, x + o(token_attention(rope_store(qkv(
//   rms_norm(x))))): one op where the Python form takes six, and BucketedAttention's Python.
// - mlp: the MLP with its norm and residual, x + down(silu(gate) * up) of gate_up(rms_norm(x)), silu and mul by
//   ATen: one op where the Python form takes seven.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <torch/library.h>

#include <optional>

namespace {

// The ops called, from the dispatcher: they live in the other files' anonymous namespaces.
template <typename Signature>
auto op(const char* name) { return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>(); }

using T = const at::Tensor&;
using Opt = const std::optional<at::Tensor>&;

at::Tensor rms_norm(T x, T weight, double eps) {
  static auto f = op<at::Tensor(T, T, double)>("laneserve_cpu::rms_norm");
  return f.call(x, weight, eps);
}

at::Tensor linear(T x, T packed, int64_t kind, int64_t n, int64_t isa, Opt residual) {
  static auto f = op<at::Tensor(T, T, int64_t, int64_t, int64_t, Opt)>("laneserve_cpu::linear");
  return f.call(x, packed, kind, n, isa, residual);
}

// The layer's arguments first (bound once in Python, passed by position), then the step's. norm [hidden]; qkv and
// o: cpu_matmul.Linear's packed weights, kinds and widths; x [tokens, hidden]; cos to slot_mapping: rope_store's;
// heads, scale, window and block_tables to positions: token_attention's.
at::Tensor attend(T norm, double eps, T qkv, int64_t qkv_kind, int64_t qkv_n, int64_t heads, double scale,
                  int64_t window, T o, int64_t o_kind, int64_t o_n, int64_t isa, T x, T cos, T sin, at::Tensor k_cache,
                  at::Tensor v_cache, T slot_mapping, T block_tables, T rows, T seqs, T positions) {
  static auto rope_store = op<at::Tensor(T, T, T, at::Tensor, at::Tensor, T, int64_t)>("laneserve_cpu::rope_store");
  static auto attention = op<void(T, T, T, T, T, T, T, double, int64_t, Opt, Opt, at::Tensor)>(
      "laneserve_cpu::token_attention");
  const at::Tensor q = rope_store.call(linear(rms_norm(x, norm, eps), qkv, qkv_kind, qkv_n, isa, std::nullopt), cos,
                                       sin, k_cache, v_cache, slot_mapping, heads);
  at::Tensor out = at::empty_like(q);
  attention.call(q, k_cache, v_cache, block_tables, rows, seqs, positions, scale, window, std::nullopt, std::nullopt,
                 out);
  return linear(out.view({x.size(0), -1}), o, o_kind, o_n, isa, x);
}

// norm [hidden]; gate_up and down: cpu_matmul.Linear's packed weights, kinds and widths; x [tokens, hidden].
at::Tensor mlp(T norm, double eps, T gate_up, int64_t gate_up_kind, int64_t gate_up_n, T down, int64_t down_kind,
               int64_t down_n, int64_t isa, T x) {
  const auto halves = linear(rms_norm(x, norm, eps), gate_up, gate_up_kind, gate_up_n, isa, std::nullopt)
                          .view({x.size(0), 2, -1}).unbind(1);
  return linear(at::mul(at::silu(halves[0]), halves[1]), down, down_kind, down_n, isa, x);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(laneserve_cpu, m) {
  m.def("attend(Tensor norm, float eps, Tensor qkv, int qkv_kind, int qkv_n, int heads, float scale, int window, "
        "Tensor o, int o_kind, int o_n, int isa, Tensor x, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slot_mapping, Tensor block_tables, Tensor rows, Tensor seqs, Tensor positions) "
        "-> Tensor");
  m.impl("attend", c10::DispatchKey::CPU, attend);
  m.def("mlp(Tensor norm, float eps, Tensor gate_up, int gate_up_kind, int gate_up_n, Tensor down, int down_kind, "
        "int down_n, int isa, Tensor x) -> Tensor");
  m.impl("mlp", c10::DispatchKey::CPU, mlp);
}
