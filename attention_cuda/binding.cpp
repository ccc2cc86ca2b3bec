// Torch binding for paged_attention.cu, registered as the operators torch.ops.laneserve.*: checks
// arguments (raising Python errors), allocates the output and scratch, and calls the plain launchers
// on the CUDA stream handed over from Python. Only ATen's core headers: no pybind11, quick to compile.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "paged_attention.h"

namespace {

int dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return 0;
    case at::kHalf: return 1;
    case at::kBFloat16: return 2;
    default: TORCH_CHECK(false, "paged attention: unsupported dtype ", t.scalar_type(),
                         " (float32, float16 or bfloat16)");
  }
  return -1;
}

void check_on(const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got one on ", t.device());
  TORCH_CHECK(t.device() == like.device(), name, " is on ", t.device(), " but the others on ", like.device());
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// The caches, and their scales where they hold 8-bit codes; returns the launchers' cache_dtype (0: like's dtype).
int check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& like,
                const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  check_on(k_cache, "k_cache", like);
  check_on(v_cache, "v_cache", like);
  TORCH_CHECK(k_cache.dim() == 4, "k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got ",
              k_cache.sizes());
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "v_cache shape ", v_cache.sizes(), " != k_cache shape ",
              k_cache.sizes());
  const auto type = k_cache.scalar_type();
  const int cache_dtype = type == like.scalar_type() ? 0 : type == at::kFloat8_e4m3fn ? 1
                        : type == at::kFloat8_e5m2 ? 2 : type == at::kChar ? 3 : -1;
  TORCH_CHECK(cache_dtype >= 0 && v_cache.scalar_type() == type, "k_cache/v_cache dtype must match ",
              like.scalar_type(), " or be one 8-bit type (float8_e4m3fn, float8_e5m2, int8), got ", type, " and ",
              v_cache.scalar_type());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "k_cache and v_cache must be contiguous");
  TORCH_CHECK(aligned16(k_cache) && aligned16(v_cache), "k_cache and v_cache must be 16-byte aligned");
  TORCH_CHECK(k_scale.has_value() == (cache_dtype != 0) && v_scale.has_value() == (cache_dtype != 0),
              cache_dtype ? "an 8-bit cache needs k_scale and v_scale" : "k_scale and v_scale are for an 8-bit cache");
  if (cache_dtype)
    for (const auto& [t, name] : {std::pair(*k_scale, "k_scale"), std::pair(*v_scale, "v_scale")}) {
      check_on(t, name, like);
      TORCH_CHECK(t.scalar_type() == at::kFloat && t.sizes() == k_cache.sizes().slice(0, 3) && t.is_contiguous(),
                  name, " must be contiguous float32 [num_blocks, block_size, num_kv_heads] = ",
                  k_cache.sizes().slice(0, 3), ", got ", t.scalar_type(), " ", t.sizes());
    }
  return cache_dtype;
}

void check(const char* err) { TORCH_CHECK(err == nullptr, "CUDA kernel launch failed: ", err ? err : ""); }

at::Tensor paged_attention(at::Tensor query, at::Tensor k_cache, at::Tensor v_cache,
                              at::Tensor block_tables, at::Tensor context_lens, double scale,
                              int64_t max_context_len, std::optional<at::Tensor> k_scale,
                              std::optional<at::Tensor> v_scale, int64_t window, int64_t stream) {
  TORCH_CHECK(query.is_cuda(), "query must be a CUDA tensor, got one on ", query.device());
  const int dtype = dtype_code(query);
  const int cache_dtype = check_cache(k_cache, v_cache, query, k_scale, v_scale);
  check_on(block_tables, "block_tables", query);
  check_on(context_lens, "context_lens", query);
  TORCH_CHECK(query.dim() == 3, "query must be [num_seqs, num_heads, head_dim], got ", query.sizes());
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(head_dim == 64 || head_dim == 128 || (head_dim == 256 && (dtype || cache_dtype)),
              "paged attention kernel: head_dim must be 64 or 128 (256 with a 16- or 8-bit cache), got ", head_dim);
  TORCH_CHECK(window >= 0 && window <= INT32_MAX, "window must be >= 0, got ", window);
  TORCH_CHECK(k_cache.size(3) == head_dim, "cache head_dim ", k_cache.size(3), " != query head_dim ", head_dim);
  TORCH_CHECK(block_size == 8 || block_size == 16 || block_size == 32, "block_size must be 8, 16 or 32, got ",
              block_size);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "num_heads (", num_heads,
              ") must be a multiple of num_kv_heads (", num_kv_heads, ")");
  const int64_t vec = 16 / query.element_size();
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) % vec == 0 && query.stride(0) % vec == 0 && aligned16(query),
              "query rows must be contiguous and 16-byte aligned (use .contiguous())");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.size(0) == num_seqs && block_tables.size(1) > 0 && block_tables.is_contiguous(),
              "block_tables must be contiguous int32 [num_seqs, max_blocks], got ", block_tables.scalar_type(), " ",
              block_tables.sizes());
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.dim() == 1 &&
                  context_lens.size(0) == num_seqs && context_lens.is_contiguous(),
              "context_lens must be contiguous int32 [num_seqs], got ", context_lens.scalar_type(), " ",
              context_lens.sizes());
  TORCH_CHECK(num_seqs <= 65535, "at most 65535 sequences per call, got ", num_seqs);
  TORCH_CHECK(block_tables.size(1) * block_size <= INT32_MAX, "block_tables too wide");
  TORCH_CHECK(max_context_len >= 0 && max_context_len <= block_tables.size(1) * block_size,
              "max_context_len must be between 0 and what block_tables addresses (", block_tables.size(1),
              " blocks of ", block_size, " tokens), got ", max_context_len);

  auto out = at::empty({num_seqs, num_heads, head_dim}, query.options());
  PagedAttentionParams p{out.data_ptr(), nullptr, nullptr, query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                         block_tables.data_ptr<int>(), context_lens.data_ptr<int>(), (int)num_seqs, (int)num_heads,
                         (int)num_kv_heads, (int)head_dim, (int)block_size, (int)block_tables.size(1), 1, dtype,
                         query.stride(0), query.stride(1), (float)scale,
                         cache_dtype ? k_scale->data_ptr<float>() : nullptr,
                         cache_dtype ? v_scale->data_ptr<float>() : nullptr, cache_dtype, (int)window};
  p.num_splits = laneserve_attention_splits(max_context_len);  // and each sequence its own, at most this
  // Freed on return, which is safe: `stream` is torch's current one, on which the allocator orders reuse.
  at::Tensor tmp_out, tmp_ml;
  if (p.num_splits > 1) {
    const auto f32 = query.options().dtype(at::kFloat);
    tmp_out = at::empty({num_seqs, num_heads, p.num_splits, head_dim}, f32);
    tmp_ml = at::empty({num_seqs, num_heads, p.num_splits, 2}, f32);
    p.tmp_out = tmp_out.data_ptr<float>();
    p.tmp_ml = tmp_ml.data_ptr<float>();
  }
  check(laneserve_paged_attention(&p, reinterpret_cast<cudaStream_t>(stream)));
  return out;
}

void store_kv(at::Tensor key, at::Tensor value, at::Tensor k_cache, at::Tensor v_cache,
              at::Tensor slot_mapping, std::optional<at::Tensor> k_scale, std::optional<at::Tensor> v_scale,
              int64_t stream) {
  TORCH_CHECK(key.is_cuda(), "key must be a CUDA tensor, got one on ", key.device());
  const int dtype = dtype_code(key);
  check_on(value, "value", key);
  check_on(slot_mapping, "slot_mapping", key);
  const int cache_dtype = check_cache(k_cache, v_cache, key, k_scale, v_scale);
  TORCH_CHECK(value.scalar_type() == key.scalar_type(), "value dtype must match key's");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key.size(1) == k_cache.size(2) &&
                  key.size(2) == k_cache.size(3),
              "key/value must be [num_tokens, num_kv_heads, head_dim] matching the cache, got ", key.sizes(),
              " and ", value.sizes(), " for cache ", k_cache.sizes());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == key.size(0) && slot_mapping.is_contiguous(),
              "slot_mapping must be contiguous int64 [num_tokens]");
  const int64_t elt = key.element_size(), row_bytes = key.size(1) * key.size(2) * elt;
  for (const auto& t : {key, value})
    TORCH_CHECK(t.stride(2) == 1 && (t.size(1) == 1 || t.stride(1) == t.size(2)) && (t.stride(0) * elt) % 16 == 0 && aligned16(t),
                "key/value rows must be contiguous and 16-byte aligned (use .contiguous())");
  if (cache_dtype) {
    check(laneserve_store_kv_quantized(k_cache.data_ptr(), v_cache.data_ptr(), k_scale->data_ptr<float>(),
                                       v_scale->data_ptr<float>(), key.data_ptr(), value.data_ptr(),
                                       slot_mapping.data_ptr<int64_t>(), (int)key.size(0), (int)key.size(1),
                                       (int)key.size(2), key.stride(0) * elt, value.stride(0) * elt, dtype,
                                       cache_dtype, reinterpret_cast<cudaStream_t>(stream)));
    return;
  }
  TORCH_CHECK(row_bytes % 16 == 0, "num_kv_heads * head_dim * element size must be a multiple of 16 bytes");
  check(laneserve_store_kv(k_cache.data_ptr(), v_cache.data_ptr(), key.data_ptr(), value.data_ptr(),
                           slot_mapping.data_ptr<int64_t>(), (int)key.size(0), key.stride(0) * elt,
                           value.stride(0) * elt, (int)row_bytes, reinterpret_cast<cudaStream_t>(stream)));
}

}  // namespace

TORCH_LIBRARY(laneserve, m) {
  m.def("paged_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "float scale, int max_context_len, Tensor? k_scale, Tensor? v_scale, int window, int stream) -> Tensor",
        &paged_attention);  // decode attention over the paged KV cache (k_scale, v_scale: an 8-bit one's)
  m.def("store_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor(c!)? k_scale, Tensor(d!)? v_scale, int stream) -> ()",
        &store_kv);  // new K/V into the cache at slot_mapping (-1 skips); an 8-bit cache quantized
}
