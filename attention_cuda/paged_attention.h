// What paged_attention.cu exports to binding.cpp. Both include this file, so the two cannot disagree.
#pragma once
#include <stdint.h>

typedef struct CUstream_st* cudaStream_t;  // as cuda_runtime_api.h declares it; no CUDA headers needed

// Decode attention: query [num_seqs, num_heads, head_dim] (dim contiguous, strides in elements,
// multiples of 16 bytes) attends to the first context_lens[i] tokens of its sequence in the caches
// [num_blocks, block_size, num_kv_heads, head_dim] (contiguous, 16-byte aligned) through
// block_tables [num_seqs, max_blocks] (int32); out is contiguous like query. Each sequence uses
// laneserve_attention_splits(its own context) splits, at most num_splits, so with num_splits =
// laneserve_attention_splits(longest context of the call) its result depends on nothing else in the
// batch. With num_splits > 1, tmp_out [num_seqs, num_heads, num_splits, head_dim] and tmp_ml
// [..., num_splits, 2] are fp32 scratch. dtype: 0 float32, 1 float16, 2 bfloat16; head_dim 64 or
// 128; block_size a power of two. cache_dtype: 0 the caches hold dtype; 1 fp8 e4m3, 2 fp8 e5m2, 3 int8:
// they hold one-byte codes, and k_scale, v_scale [num_blocks, block_size, num_kv_heads] (float32,
// contiguous) one scale per token and KV head: value = float(code) * scale. head_dim 256 too with a 16- or 8-bit
// cache. window > 0: each query reads only the last `window` of its context_lens[i] tokens (a sliding window).
struct PagedAttentionParams {
  void* out;
  float *tmp_out, *tmp_ml;
  const void *query, *k_cache, *v_cache;
  const int *block_tables, *context_lens;
  int num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks, num_splits, dtype;
  int64_t q_stride_seq, q_stride_head;
  float scale;
  const float *k_scale, *v_scale;
  int cache_dtype;
  int window;
};

extern "C" {
// The splits a sequence of max_context tokens uses. With the call's longest context (known on the
// host, no read of context_lens) it gives num_splits: the grid's extent and the scratch's.
int laneserve_attention_splits(int64_t max_context);
// Launch on `stream`; NULL on success, else the error.
const char* laneserve_paged_attention(const PagedAttentionParams* p, cudaStream_t stream);
// Copy key/value rows (num_kv_heads * head_dim elements = row_bytes, 16-byte aligned, key_stride /
// value_stride bytes apart) into the caches at slot_mapping[i]; slot -1 is skipped.
const char* laneserve_store_kv(void* k_cache, void* v_cache, const void* key, const void* value,
                               const int64_t* slot_mapping, int num_tokens, int64_t key_stride,
                               int64_t value_stride, int row_bytes, cudaStream_t stream);
// Quantize key/value [num_tokens, num_kv_heads, head_dim] (dtype as above; a token's heads contiguous, tokens
// key_stride / value_stride bytes apart) into 8-bit caches (cache_dtype 1 to 3) at slot_mapping[i], -1 skipped:
// each token-head row as head_dim codes and its scale (k_scale, v_scale [num_slots, num_kv_heads]), exactly as
// attention_cuda.quantize_kv computes them.
const char* laneserve_store_kv_quantized(void* k_cache, void* v_cache, float* k_scale, float* v_scale,
                                         const void* key, const void* value, const int64_t* slot_mapping,
                                         int num_tokens, int num_kv_heads, int head_dim, int64_t key_stride,
                                         int64_t value_stride, int dtype, int cache_dtype, cudaStream_t stream);
}
