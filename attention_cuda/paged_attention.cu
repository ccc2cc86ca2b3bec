// Decode attention over the paged KV cache, and the store of new K/V into it. Pure CUDA, no torch:
// binding.cpp checks arguments and calls the launchers at the bottom (declared in paged_attention.h).
//
// Cache layout per layer: [num_blocks, block_size, num_kv_heads, head_dim], contiguous. A sequence's
// token t lives in physical block block_tables[seq][t / block_size] at offset t % block_size. The cache holds
// either the query's dtype or one-byte codes (fp8 e4m3, fp8 e5m2, int8) with one float32 scale per token and
// KV head beside it ([num_blocks, block_size, num_kv_heads]): value = float(code) * scale.
//
// Thread mapping of the attention kernel (one thread block of 4 warps per (kv-head group, sequence,
// split)):
//   blockIdx.x  one KV head and up to GMAX of the query heads that share it (GQA), so each K/V
//               byte is read from HBM once for its whole group;
//   blockIdx.y  the sequence (one query token);
//   blockIdx.z  the split: a sequence of ctx tokens is cut into n = clamp(ceil(ctx / PARTITION), 1,
//               MAX_SPLITS) contiguous ranges, each done by its own thread block. n comes from the
//               sequence's own length, never from its neighbours', so its result is bitwise the same
//               whatever batch it runs in. gridDim.z = p.num_splits is the largest n of the call
//               (from the longest context, known on the host); blocks with z >= n return at once. A
//               sequence with n == 1 writes its output directly, reduce_kernel merges the others' splits.
//   Inside a block, each token row of one KV head (head_dim cache elements C) is read by LPT lanes,
//   16 bytes each, or 8 codes of an 8-bit cache (VEC elements, with the same VEC dims of the query:
//   8 at 16 bits, 4 at fp32): a lane holds VEC floats of query and output per head, so an
//   8-bit cache takes no more registers than a 16-bit one (16 codes a lane took 240 and halved the
//   blocks an SM holds). A warp thus covers TPW = 32 / LPT tokens per step (bf16/fp16 and 8-bit
//   codes: 2 tokens at head_dim 128, 4 at 64; fp32: 1 and 2; codes are dequantized with their row's
//   scale in registers right after the load), and the 4 warps interleave over the split's tokens,
//   UNROLL steps' loads issued before any is used. Every such group of
//   LPT lanes keeps its own online-softmax state (running max m, sum l, unnormalised output acc,
//   all fp32) for each of its heads; the NPART = 4 * TPW states are merged through shared memory at
//   the end.
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "paged_attention.h"

namespace {

constexpr int NUM_WARPS = 4;
constexpr int NUM_THREADS = NUM_WARPS * 32;
constexpr int PARTITION = 512;  // fewest tokens per split
constexpr int MAX_SPLITS = 64;  // bounds the fp32 scratch: num_seqs * num_heads * 64 * (head_dim + 2)
// Both set at build time (-D) so that .ci/gpu can time other values in the same run.
#ifndef LANESERVE_UNROLL
#define LANESERVE_UNROLL 4
#endif
#ifndef LANESERVE_CODE_LOAD
#define LANESERVE_CODE_LOAD 8
#endif
constexpr int UNROLL = LANESERVE_UNROLL;  // steps whose K/V loads are issued together, to keep loads in flight
constexpr int CODE_LOAD = LANESERVE_CODE_LOAD;  // bytes of 8-bit codes a lane loads per row (16-bit, fp32: 16)
constexpr float LOG2E = 1.4426950408889634f;

// Splits for ctx tokens: one per PARTITION tokens, at least 1, at most cap. The one rule for the host
// (laneserve_attention_splits: the grid and scratch, from the call's longest context) and the kernels
// (each sequence's own count), so a sequence never uses more splits than the scratch holds.
__host__ __device__ __forceinline__ int splits_for(int64_t ctx, int cap) {
  const int64_t n = (ctx + PARTITION - 1) / PARTITION;
  return (int)(n < 1 ? 1 : n > cap ? cap : n);
}

// Tokens per split for a sequence of ctx > 0 tokens in n splits (both kernels must agree): PARTITION
// (the last split shorter), or ceil(ctx / n) when n was capped; either way none of the n is empty.
__device__ __forceinline__ int split_len(int ctx, int n) { return max(PARTITION, (ctx + n - 1) / n); }

// Tokens the sequence really has: its context length, clamped to what its block-table row can address
// (a wrong length then gives wrong numbers rather than an illegal address).
__device__ __forceinline__ int seq_len(const PagedAttentionParams& p, int seq) {
  return min(max(p.context_lens[seq], 0), p.max_blocks * p.block_size);
}

// The first key the sequence's query reads: 0, or with a sliding window (p.window > 0) the window's first.
// Splits cut the keys from there, so they depend on the sequence alone still.
__device__ __forceinline__ int window_start(const PagedAttentionParams& p, int ctx) {
  return p.window > 0 && ctx > p.window ? ctx - p.window : 0;
}

// The sequence's own split count, within the grid. A context longer than the host declared gets the
// grid's p.num_splits, longer splits: still exact, only no longer independent of the batch.
__device__ __forceinline__ int lane_splits(const PagedAttentionParams& p, int ctx) {
  return splits_for(ctx, min(MAX_SPLITS, p.num_splits));
}

// The 8-bit cache elements (a byte each: the host's cache_dtype 1, 2, 3) and their largest code: a stored row's
// largest |value| becomes QMAX, and its scale amax / QMAX.
struct fp8_e4m3 { uint8_t bits; static constexpr float QMAX = 448.f; };
struct fp8_e5m2 { uint8_t bits; static constexpr float QMAX = 57344.f; };
struct int8_code { uint8_t bits; static constexpr float QMAX = 127.f; };

// Code -> float, exactly. fp8: the code's exponent and mantissa bits moved into float32's read as its value times
// 2^(bias - 127); subnormal codes become float32 subnormals (so no flush-to-zero: no --use_fast_math).
__device__ __forceinline__ float decode(fp8_e4m3, unsigned c) {  // bias 7, 3 mantissa bits, no inf, 0x7f NaN
  const float f = __uint_as_float((c & 0x80u) << 24 | (c & 0x7fu) << 20) * 0x1p120f;
  return (c & 0x7fu) == 0x7fu ? NAN : f;
}
__device__ __forceinline__ float decode(fp8_e5m2, unsigned c) {  // bias 15, 2 mantissa bits, top exponent inf/NaN
  const float f = __uint_as_float((c & 0x80u) << 24 | (c & 0x7fu) << 21) * 0x1p112f;
  return (c & 0x7cu) != 0x7cu ? f : (c & 3u) ? NAN : (c & 0x80u) ? -INFINITY : INFINITY;
}
__device__ __forceinline__ float decode(int8_code, unsigned c) { return (float)(int8_t)c; }

// Float -> fp8 code as torch's cast gives it (c10's conversion: round to nearest even, subnormals included, the
// same overflow codes), in integer arithmetic and one exact rintf, so that no fused multiply-add can change it.
template <int M, int BIAS, unsigned OVERFLOW, unsigned OVERFLOW_CODE>  // mantissa bits, exponent bias
__device__ __forceinline__ uint8_t float_to_fp8(float y) {
  const unsigned u = __float_as_uint(y), sign = u >> 24 & 0x80u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7fu;  // NaN
  if (a >= OVERFLOW) return sign | OVERFLOW_CODE;
  if (a < (128u - BIAS) << 23)  // below the smallest normal 2^(1 - BIAS): a count of steps of 2^(1 - BIAS - M)
    return sign | (unsigned)rintf(__uint_as_float(a) * (float)(1 << (BIAS + M - 1)));
  constexpr unsigned S = 23 - M;  // float32 mantissa bits dropped, the rest rebiased
  return sign | (a - ((127u - BIAS) << 23) + (1u << (S - 1)) - 1 + (a >> S & 1)) >> S;
}
__device__ __forceinline__ uint8_t encode(fp8_e4m3, float y) { return float_to_fp8<3, 7, 0x43f00000u, 0x7fu>(y); }
__device__ __forceinline__ uint8_t encode(fp8_e5m2, float y) { return float_to_fp8<2, 15, 0x47800000u, 0x7cu>(y); }
__device__ __forceinline__ uint8_t encode(int8_code, float y) {
  return (uint8_t)(int)fminf(fmaxf(rintf(y), -127.f), 127.f);  // rintf: half to even, as torch.round
}

// 16 bytes -> floats, by bit operations (no pointer punning, which strict aliasing forbids): 16 one-byte codes
// (values before their scale), and below 4, 8, 8 elements of float, __half, __nv_bfloat16.
template <typename C> __device__ __forceinline__ void unpack(const uint4& u, float* f) {
  static_assert(sizeof(C) == 1, "an 8-bit cache element");
  const unsigned w[4] = {u.x, u.y, u.z, u.w};  // four codes per word, the first in the low bits
#pragma unroll
  for (int i = 0; i < 16; ++i) f[i] = decode(C{}, w[i / 4] >> 8 * (i % 4) & 0xffu);
}
template <typename C> __device__ __forceinline__ void unpack(const uint2& u, float* f) {  // 8 codes
  static_assert(sizeof(C) == 1, "an 8-bit cache element");
  const unsigned w[2] = {u.x, u.y};
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] = decode(C{}, w[i / 4] >> 8 * (i % 4) & 0xffu);
}
template <int BYTES> struct LoadOf { using type = uint4; };
template <> struct LoadOf<8> { using type = uint2; };
template <> __device__ __forceinline__ void unpack<float>(const uint4& u, float* f) {
  f[0] = __uint_as_float(u.x), f[1] = __uint_as_float(u.y), f[2] = __uint_as_float(u.z), f[3] = __uint_as_float(u.w);
}
template <> __device__ __forceinline__ void unpack<__half>(const uint4& u, float* f) {
  const unsigned w[4] = {u.x, u.y, u.z, u.w};  // two halves per word, the first in the low bits
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __half2float(__ushort_as_half((unsigned short)(w[i] & 0xffffu)));
    f[2 * i + 1] = __half2float(__ushort_as_half((unsigned short)(w[i] >> 16)));
  }
}
template <> __device__ __forceinline__ void unpack<__nv_bfloat16>(const uint4& u, float* f) {
  const unsigned w[4] = {u.x, u.y, u.z, u.w};  // a bfloat16 is the high half of a float32
  for (int i = 0; i < 4; ++i) { f[2 * i] = __uint_as_float(w[i] << 16); f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u); }
}

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// max that keeps a NaN, as torch's amax does (fmaxf drops it).
__device__ __forceinline__ float nan_max(float a, float b) { return a > b || a != a ? a : b; }

// Weight exp2(m - M) of a partial state with max m in a merge whose max is M; an empty state
// (m = -inf) weighs 0, also when every state is empty (M = -inf, where exp2 would give NaN).
__device__ __forceinline__ float merge_weight(float m, float M) { return m == -INFINITY ? 0.f : exp2f(m - M); }

// T: the query's and output's element; C: the cache's (T, or an 8-bit code with its scales).
template <typename T, typename C, int HEAD_DIM, int GMAX>
__global__ void __launch_bounds__(NUM_THREADS) attention_kernel(const PagedAttentionParams p) {
  constexpr bool CODES = sizeof(C) == 1;  // an 8-bit cache
  constexpr int LOAD = CODES ? CODE_LOAD : 16;  // bytes a lane loads per row
  using Load = typename LoadOf<LOAD>::type;
  constexpr int VEC = LOAD / sizeof(C);   // cache elements per load: a lane's dims
  constexpr int QVEC = 16 / sizeof(T);    // query elements per 16-byte load
  constexpr int LPT = HEAD_DIM / VEC;     // lanes per token row
  constexpr int TPW = 32 / LPT;           // tokens per warp per step
  constexpr int STEP = NUM_WARPS * TPW;   // tokens per block per step
  constexpr int NPART = STEP;             // online-softmax states per block
  static_assert(LPT <= 32 && 32 % LPT == 0, "a token row must fit one warp");

  const int group = p.num_heads / p.num_kv_heads;
  const int chunks = (group + GMAX - 1) / GMAX;  // blocks per KV head when its group exceeds GMAX
  const int kv_head = blockIdx.x / chunks;
  const int g0 = (blockIdx.x % chunks) * GMAX;
  const int head0 = kv_head * group + g0;
  const int nh = min(GMAX, group - g0);           // heads of this block, block-uniform
  const int seq = blockIdx.y, split = blockIdx.z;
  const int ctx = seq_len(p, seq), first = window_start(p, ctx), n = lane_splits(p, ctx - first);
  if (split >= n) return;  // a split this sequence does not need (a longer one in the call does)
  const int start = first + split * split_len(ctx - first, n), end = min(start + split_len(ctx - first, n), ctx);
  T* out_row = static_cast<T*>(p.out) + ((int64_t)seq * p.num_heads + head0) * HEAD_DIM;

  if (ctx == 0) {  // an empty sequence (n = 1) gets zeros
    for (int i = threadIdx.x; i < nh * HEAD_DIM; i += NUM_THREADS) out_row[i] = from_float<T>(0.f);
    return;
  }

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int sub = lane / LPT;         // which token of the warp's step
  const int d0 = (lane % LPT) * VEC;  // first of this lane's VEC dims

  // The query, pre-scaled so that scores are in log2 units and exp2f serves as exp.
  float q[GMAX][VEC], acc[GMAX][VEC], m[GMAX], l[GMAX];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int j = 0; j < VEC; ++j) q[g][j] = acc[g][j] = 0.f;
    if (g < nh) {
      const T* q_row = static_cast<const T*>(p.query) + seq * p.q_stride_seq + (head0 + g) * p.q_stride_head;
#pragma unroll
      for (int j = 0; j < VEC; j += QVEC) unpack<T>(*reinterpret_cast<const uint4*>(q_row + d0 + j), q[g] + j);
#pragma unroll
      for (int j = 0; j < VEC; ++j) q[g][j] *= p.scale * LOG2E;
    }
  }

  const int* table = p.block_tables + (int64_t)seq * p.max_blocks;
  const int64_t token_stride = (int64_t)p.num_kv_heads * HEAD_DIM;  // elements from one slot to the next
  const C* k_base = static_cast<const C*>(p.k_cache) + kv_head * HEAD_DIM + d0;
  const C* v_base = static_cast<const C*>(p.v_cache) + kv_head * HEAD_DIM + d0;
  const int block_shift = __ffs(p.block_size) - 1, offset_mask = p.block_size - 1;

  // t0 is warp-uniform, so every lane reaches the shuffles; lanes past `end` just don't update.
  for (int t0 = start + warp * TPW; t0 < end; t0 += STEP * UNROLL) {
    Load kr[UNROLL], vr[UNROLL];
    float ks[UNROLL], vs[UNROLL];  // the rows' scales (an 8-bit cache)
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int t = t0 + u * STEP + sub;
      kr[u] = vr[u] = Load{};
      ks[u] = vs[u] = 0.f;
      if (t < end) {
        const int64_t block = table[t >> block_shift];  // widened before any multiply
        const int64_t slot = (block << block_shift) + (t & offset_mask);
        kr[u] = *reinterpret_cast<const Load*>(k_base + slot * token_stride);
        vr[u] = *reinterpret_cast<const Load*>(v_base + slot * token_stride);
        if (CODES) {  // the rows' scales, loaded beside them
          ks[u] = p.k_scale[slot * p.num_kv_heads + kv_head];
          vs[u] = p.v_scale[slot * p.num_kv_heads + kv_head];
        }
      }
    }
    // Scores of the UNROLL tokens for every head, summed over the token's LPT lanes.
    float s[UNROLL][GMAX], v[UNROLL][VEC];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float k[VEC];
      unpack<C>(kr[u], k);
      unpack<C>(vr[u], v[u]);
      if (CODES) {  // dequantize: code * its row's scale
#pragma unroll
        for (int j = 0; j < VEC; ++j) k[j] *= ks[u], v[u][j] *= vs[u];
      }
#pragma unroll
      for (int g = 0; g < GMAX; ++g) {
        s[u][g] = 0.f;
        if (g >= nh) continue;  // block-uniform, so the shuffles stay convergent
#pragma unroll
        for (int j = 0; j < VEC; ++j) s[u][g] += q[g][j] * k[j];
#pragma unroll
        for (int o = LPT / 2; o > 0; o /= 2) s[u][g] += __shfl_xor_sync(0xffffffffu, s[u][g], o);
      }
    }
    // Online softmax; the state is rescaled only when the running max grows, which is rare.
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      if (g >= nh) continue;
      float s_max = -INFINITY;
#pragma unroll
      for (int u = 0; u < UNROLL; ++u)
        if (t0 + u * STEP + sub < end) s_max = fmaxf(s_max, s[u][g]);
      if (s_max > m[g]) {
        const float alpha = exp2f(m[g] - s_max);  // 0 for the first token (m = -inf)
        l[g] *= alpha;
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[g][j] *= alpha;
        m[g] = s_max;
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        if (t0 + u * STEP + sub >= end) continue;
        const float w = exp2f(s[u][g] - m[g]);
        l[g] += w;
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[g][j] += w * v[u][j];
      }
    }
  }

  // Merge the NPART states of the block, then write the normalised result: straight to `out` when
  // the sequence has one split, else to the scratch for reduce_kernel, with the split's max and sum.
  __shared__ float red_acc[NPART][GMAX][HEAD_DIM];
  __shared__ float red_m[NPART][GMAX], red_l[NPART][GMAX];
  const int part = warp * TPW + sub;
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    if (g >= nh) continue;
#pragma unroll
    for (int j = 0; j < VEC; ++j) red_acc[part][g][d0 + j] = acc[g][j];
    if (d0 == 0) { red_m[part][g] = m[g]; red_l[part][g] = l[g]; }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < nh * HEAD_DIM; i += NUM_THREADS) {
    const int g = i / HEAD_DIM, d = i % HEAD_DIM;
    float M = -INFINITY, L = 0.f, o = 0.f;
    for (int k = 0; k < NPART; ++k) M = fmaxf(M, red_m[k][g]);
    for (int k = 0; k < NPART; ++k) {
      const float w = merge_weight(red_m[k][g], M);
      L += red_l[k][g] * w;
      o += red_acc[k][g][d] * w;
    }
    o /= L;  // L >= 1: the state holding the max token contributes exp2(0)
    if (n == 1) {
      out_row[i] = from_float<T>(o);
    } else {
      const int64_t r = ((int64_t)seq * p.num_heads + head0 + g) * p.num_splits + split;
      p.tmp_out[r * HEAD_DIM + d] = o;
      if (d == 0) { p.tmp_ml[2 * r] = M; p.tmp_ml[2 * r + 1] = L; }
    }
  }
}

// One block per (head, sequence), one thread per dim: merge the sequence's n splits. A sequence with
// n == 1 (also an empty one) has its output from attention_kernel already, and nothing in the scratch.
template <typename T>
__global__ void reduce_kernel(const PagedAttentionParams p) {
  const int head = blockIdx.x, seq = blockIdx.y, d = threadIdx.x, head_dim = blockDim.x;
  const int ctx = seq_len(p, seq), n = lane_splits(p, ctx - window_start(p, ctx));
  if (n == 1) return;
  const int64_t r0 = ((int64_t)seq * p.num_heads + head) * p.num_splits;
  const float* ml = p.tmp_ml + 2 * r0;
  float M = -INFINITY, L = 0.f, o = 0.f;
  for (int s = 0; s < n; ++s) M = fmaxf(M, ml[2 * s]);
  for (int s = 0; s < n; ++s) {
    const float w = ml[2 * s + 1] * merge_weight(ml[2 * s], M);  // the split's sum, rescaled
    L += w;
    o += p.tmp_out[(r0 + s) * head_dim + d] * w;
  }
  // L >= 1: the split holding the max contributes its own sum, itself >= 1.
  static_cast<T*>(p.out)[((int64_t)seq * p.num_heads + head) * head_dim + d] = from_float<T>(o / L);
}

// One block per new token, a warp per row of one KV head (its K rows, then its V rows): quantize the row's head_dim
// values to codes of C and one scale, as attention_cuda.quantize_kv does, in float32 and bit for bit.
template <typename T, typename C>
__global__ void store_kv_quantized_kernel(uint8_t* __restrict__ k_cache, uint8_t* __restrict__ v_cache,
                                          float* __restrict__ k_scale, float* __restrict__ v_scale,
                                          const char* __restrict__ key, const char* __restrict__ value,
                                          const int64_t* __restrict__ slot_mapping, int64_t key_stride,
                                          int64_t value_stride, int num_kv_heads, int head_dim) {
  const int64_t token = blockIdx.x, slot = slot_mapping[token];
  if (slot < 0) return;  // padding
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int r = warp; r < 2 * num_kv_heads; r += blockDim.x / 32) {  // warp-uniform: the shuffles converge
    const bool is_v = r >= num_kv_heads;
    const int64_t h = r % num_kv_heads, row = slot * num_kv_heads + h;
    const char* row_start = is_v ? value + token * value_stride : key + token * key_stride;
    const T* x = reinterpret_cast<const T*>(row_start) + h * head_dim;
    float amax = 0.f;
    for (int d = lane; d < head_dim; d += 32) amax = nan_max(amax, fabsf(to_float(x[d])));
    for (int o = 16; o > 0; o /= 2) amax = nan_max(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    // IEEE divisions, as torch's; q is inf or NaN when amax is 0, NaN or below ~1e-36: codes 0 then
    const float q = C::QMAX / amax, inv = q <= 3.4028235e38f ? q : 0.f;
    uint8_t* codes = (is_v ? v_cache : k_cache) + row * head_dim;
    for (int d = lane; d < head_dim; d += 32) codes[d] = encode(C{}, to_float(x[d]) * inv);  // |x * inv| <~ QMAX
    if (lane == 0) (is_v ? v_scale : k_scale)[row] = amax / C::QMAX;
  }
}

// One block per new token: copy its K and V rows (num_kv_heads * head_dim elements) into its slot.
__global__ void store_kv_kernel(char* __restrict__ k_cache, char* __restrict__ v_cache,
                                const char* __restrict__ key, const char* __restrict__ value,
                                const int64_t* __restrict__ slot_mapping, int64_t key_stride,
                                int64_t value_stride, int row_bytes) {
  const int64_t token = blockIdx.x, slot = slot_mapping[token];
  if (slot < 0) return;  // padding
  const uint4* k = reinterpret_cast<const uint4*>(key + token * key_stride);
  const uint4* v = reinterpret_cast<const uint4*>(value + token * value_stride);
  uint4* kc = reinterpret_cast<uint4*>(k_cache + slot * row_bytes);
  uint4* vc = reinterpret_cast<uint4*>(v_cache + slot * row_bytes);
  for (int i = threadIdx.x; i < row_bytes / 16; i += blockDim.x) { kc[i] = k[i]; vc[i] = v[i]; }
}

template <typename T, typename C, int HEAD_DIM>
void launch_attention(const PagedAttentionParams& p, cudaStream_t stream) {
  // Register arrays are sized by GMAX: 1 for plain multi-head, 2, else 4 (larger groups take
  // several blocks per KV head, whose repeated K/V reads mostly hit L2).
  const int group = p.num_heads / p.num_kv_heads, gmax = group == 1 ? 1 : group == 2 ? 2 : 4;
  const dim3 grid(p.num_kv_heads * ((group + gmax - 1) / gmax), p.num_seqs, p.num_splits);
  auto kernel = gmax == 1 ? attention_kernel<T, C, HEAD_DIM, 1>
              : gmax == 2 ? attention_kernel<T, C, HEAD_DIM, 2> : attention_kernel<T, C, HEAD_DIM, 4>;
  kernel<<<grid, NUM_THREADS, 0, stream>>>(p);
  if (p.num_splits > 1) reduce_kernel<T><<<dim3(p.num_heads, p.num_seqs), HEAD_DIM, 0, stream>>>(p);
}

// Calls f(T{}, C{}) with the elements of dtype (0 float32, 1 float16, 2 bfloat16) and cache_dtype (0 T itself,
// 1 fp8 e4m3, 2 fp8 e5m2, 3 int8); false for codes outside those.
template <typename F> bool with_types(int dtype, int cache_dtype, F f) {
  auto with_cache = [&](auto t) {
    if (cache_dtype == 0) f(t, t);
    else if (cache_dtype == 1) f(t, fp8_e4m3{});
    else if (cache_dtype == 2) f(t, fp8_e5m2{});
    else if (cache_dtype == 3) f(t, int8_code{});
    return cache_dtype >= 0 && cache_dtype <= 3;
  };
  return dtype == 0 ? with_cache(0.f) : dtype == 1 ? with_cache(__half()) : dtype == 2 && with_cache(__nv_bfloat16());
}

const char* last_error() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace

extern "C" {

int laneserve_attention_splits(int64_t max_context) { return splits_for(max_context, MAX_SPLITS); }

const char* laneserve_paged_attention(const PagedAttentionParams* p, cudaStream_t stream) {
  if (p->head_dim != 64 && p->head_dim != 128 && p->head_dim != 256) return "head_dim must be 64, 128 or 256";
  if (p->head_dim == 256 && p->dtype == 0 && p->cache_dtype == 0) return "head_dim 256 needs a 16- or 8-bit cache";
  if (p->block_size <= 0 || (p->block_size & (p->block_size - 1))) return "block_size must be a power of two";
  if (p->cache_dtype != 0 && (!p->k_scale || !p->v_scale)) return "an 8-bit cache needs k_scale and v_scale";
  if (p->num_seqs == 0) return nullptr;
  const bool known = with_types(p->dtype, p->cache_dtype, [&](auto t, auto c) {
    if (p->head_dim == 64) launch_attention<decltype(t), decltype(c), 64>(*p, stream);
    else if (p->head_dim == 128) launch_attention<decltype(t), decltype(c), 128>(*p, stream);
    else if constexpr (sizeof(c) <= 2) launch_attention<decltype(t), decltype(c), 256>(*p, stream);  // a row in a warp
  });
  return known ? last_error() : "dtype must be float32, float16 or bfloat16, cache_dtype 0 to 3";
}

const char* laneserve_store_kv(void* k_cache, void* v_cache, const void* key, const void* value,
                               const int64_t* slot_mapping, int num_tokens, int64_t key_stride,
                               int64_t value_stride, int row_bytes, cudaStream_t stream) {
  if (num_tokens == 0) return nullptr;
  const int threads = row_bytes / 16 < 256 ? (row_bytes / 16 + 31) / 32 * 32 : 256;
  store_kv_kernel<<<num_tokens, threads, 0, stream>>>(static_cast<char*>(k_cache), static_cast<char*>(v_cache),
                                                      static_cast<const char*>(key), static_cast<const char*>(value),
                                                      slot_mapping, key_stride, value_stride, row_bytes);
  return last_error();
}

const char* laneserve_store_kv_quantized(void* k_cache, void* v_cache, float* k_scale, float* v_scale,
                                         const void* key, const void* value, const int64_t* slot_mapping,
                                         int num_tokens, int num_kv_heads, int head_dim, int64_t key_stride,
                                         int64_t value_stride, int dtype, int cache_dtype, cudaStream_t stream) {
  if (cache_dtype == 0) return "cache_dtype must be 1 to 3 (an 8-bit cache): laneserve_store_kv copies";
  if (num_tokens == 0) return nullptr;
  const int threads = 32 * (2 * num_kv_heads < 8 ? 2 * num_kv_heads : 8);  // a warp per row, up to 8 rows at once
  const bool known = with_types(dtype, cache_dtype, [&](auto t, auto c) {
    if constexpr (sizeof(c) == 1)
      store_kv_quantized_kernel<decltype(t), decltype(c)><<<num_tokens, threads, 0, stream>>>(
          static_cast<uint8_t*>(k_cache), static_cast<uint8_t*>(v_cache), k_scale, v_scale,
          static_cast<const char*>(key), static_cast<const char*>(value), slot_mapping, key_stride, value_stride,
          num_kv_heads, head_dim);
  });
  return known ? last_error() : "dtype must be float32, float16 or bfloat16, cache_dtype 1 to 3";
}

}  // extern "C"
