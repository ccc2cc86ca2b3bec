// Batch-invariant CPU attention token by token, registered as torch.ops.laneserve_cpu.token_attention: each token
// it is given (a decode, a recomputed output token, a draft, a short prompt's token: cpu.BucketedAttention says
// which) attends to its own sequence's cached keys 0..pos (the last `window` of them, if set), computed the same
// way whatever the batch, the task holding it and the thread count.
//
// - Tasks: one per run of a sequence's consecutive tokens (in a step of few runs, one per KV head and the query
//   heads that read it, or per query head, and a run's tokens in parts, so that one stream's tokens use every
//   thread), split over threads by at::parallel_for (never within a head), so a token's bits never depend on the
//   other tokens of the step or on the thread count. A task reads the keys and values of the KV heads it reads
//   (each slot's heads together) in place from a float32 cache, after asking for all of them at once (prefetches:
//   the reads wait on memory together, not one after another); from any other cache it copies them to float32
//   buffers, once for its tokens (a verify step's drafts read the same keys). Then it computes each token's query
//   heads.
// - Rounding where the pure-PyTorch form (cpu.py) rounds, in the query's dtype T (bfloat16 or float32):
//   q' = T(q * scale); an 8-bit cache's K/V = T(code * token scale), a bfloat16 cache's as stored (exact in
//   float32); s_j = T(q' . k_j); p = T(softmax(s)); out = T(sum_j p_j v_j). Products and sums in float32; e^x by
//   exp8, the same polynomial in every lane.
// - Order, fixed: a dot product over d accumulates 8 lanes (lane d % 8) from d = 0 up, then adds the lanes
//   pairwise ((0+1)+(2+3))+((4+5)+(6+7)); softmax sums e_j likewise, lane (j - start) % 8 from j = start up; each
//   output element accumulates over j = start, start + 1, ..., pos. Built with -ffp-contract=off: no fused
//   multiply-adds (they would change every output's bits, and so which drafts a speculating stream keeps). AVX2
//   vectors (where cpu_matmul.isa() vouches for it), elementwise, so AVX-512 machines give the same bits.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

// One call's tensors, as the tasks read them.
struct Args {
  const void *query, *k_cache, *v_cache;
  const float *k_scales, *v_scales;  // null for a cache in T
  const int64_t *tables, *rows, *seqs, *positions;
  void* out;
  int64_t n, width, heads, dim, block_size, kv_heads, window;
  float scale;
};

#pragma GCC push_options
#pragma GCC target("avx2")  // used only where cpu_matmul.isa() vouches for AVX2 at least
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));  // 8 floats anywhere in a buffer
typedef uint16_t u16x8 __attribute__((vector_size(16), aligned(2), may_alias));
typedef uint32_t v8w __attribute__((vector_size(32)));

// x rounded to T's precision (bfloat16: to nearest even, a NaN kept one, by c10's conversion).
template <typename T>
inline float round_to(float x) { return static_cast<float>(static_cast<T>(x)); }

// round_to for 8 lanes: c10's bits (bias 0x7fff plus the kept half's lowest bit, then truncate; NaN 0x7fc0).
template <typename T>
inline v8 round8(v8 x) {
  if constexpr (std::is_same_v<T, float>) return x;
  const v8w u = (v8w)x, r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  return (v8)(x != x ? (v8w)(v8{} + __builtin_nanf("")) : r);
}

// The 8 sums of a[t]'s lanes, ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)) each: horizontal adds, in that order.
inline v8 sums8(const v8 (&a)[8]) {
  const __m256 g0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 g1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20), _mm256_permute2f128_ps(g0, g1, 0x31));
}

// t's lanes added pairwise, ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)).
inline float sum8(v8 t) { return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7])); }

// e^x for x <= 0, 8 at a time (Cephes' expf: x = n ln 2 + r, a degree-7 polynomial in r, times 2^n); elementwise,
// so a value's result does not depend on its lane. Below -87 (e^x < 2^-125) gives e^-87.
inline v8 exp8(v8 x) {
  x = x < -87.0f ? v8{} - 87.0f : x;
  const v8 t = x * 1.44269504088896341f;
  const v8i n = __builtin_convertvector(t + (t < 0 ? v8{} - 0.5f : v8{} + 0.5f), v8i);
  const v8 nf = __builtin_convertvector(n, v8);
  const v8 r = x - nf * 0.693359375f - nf * -2.12194440e-4f;
  v8 y = r * 1.9875691500e-4f + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  return (v8)((v8i)y + (n << 23));
}

// 8 elements of a cached vector as T's values in float32 (an 8-bit code times the token's scale, in T).
template <typename T, typename C>
inline v8 load8(const C* x, float scale) {
  if constexpr (std::is_same_v<C, float>) return *(const v8u*)x;
  if constexpr (std::is_same_v<C, c10::BFloat16>)  // a bfloat16 is a float32's top half
    return (v8)(__builtin_convertvector(*(const u16x8*)x, v8i) << 16);
  v8 r;
  for (int l = 0; l < 8; ++l) r[l] = round_to<T>(static_cast<float>(x[l]) * scale);
  return r;
}

// out = sum_j p_j v_j for CH chunks of 8 dims, j in order (CH a constant: the sums stay in registers).
template <int CH, typename T>
inline void weighted(const float* p, const float* const* vp, int64_t at, int64_t len, T* o) {
  v8 acc[CH] = {};
  for (int64_t j = 0; j < len; ++j)
    for (int c = 0; c < CH; ++c) acc[c] += p[j] * *(const v8u*)&vp[j][at + 8 * c];
  for (int l = 0; l < 8 * CH; ++l) o[l] = static_cast<T>(acc[l / 8][l % 8]);
}

template <typename T, typename C>
void run(const Args& a) {
  const int dim = a.dim, group = a.heads / a.kv_heads;
  const T* q_all = static_cast<const T*>(a.query);
  const C *k_cache = static_cast<const C*>(a.k_cache), *v_cache = static_cast<const C*>(a.v_cache);
  T* o_all = static_cast<T*>(a.out);
  // A task: tokens [first, last) of one run (a sequence's consecutive rows: one token, a verify step's drafts or
  // a prompt's tokens, which share their keys, copied once), query heads [head0, head1). In a step of too few runs
  // to keep every thread busy (one stream's), a run's KV heads (each with the query heads that read it), or its
  // query heads where there are too few of those, and its tokens in parts (at most 16 tokens each), go to tasks
  // of their own. Threads take tasks in order as they come free, a run's last (costliest) part first. A token's
  // arithmetic is the same whichever task and thread compute it.
  struct Task { int64_t first, last, head0, head1; };
  std::vector<int64_t> runs{0};  // run r: tokens runs[r] .. runs[r + 1] - 1
  for (int64_t i = 1; i <= a.n; ++i)
    if (i == a.n || a.seqs[i] != a.seqs[i - 1]) runs.push_back(i);
  const int64_t threads = at::get_num_threads(), n = runs.size() - 1;
  const int64_t split = n >= 4 * threads ? 1 : n * a.kv_heads >= threads ? a.kv_heads : a.heads;
  std::vector<Task> tasks;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t len = runs[r + 1] - runs[r];
    const int64_t parts = std::max((len + 15) / 16, std::min(len, (2 * threads - 1) / (n * split) + 1));
    for (int64_t t = parts - 1; t >= 0; --t)
      for (int64_t h = 0; h < split; ++h)
        tasks.push_back({runs[r] + t * len / parts, runs[r] + (t + 1) * len / parts, h * a.heads / split,
                         (h + 1) * a.heads / split});
  }
  auto first = [&](int64_t i) { return a.window > 0 ? std::max<int64_t>(0, a.positions[i] - a.window + 1) : 0; };
  std::atomic<size_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> q(dim), k, v, p;
    std::vector<const float*> kp, vp;  // key j's vectors (its kvs heads together): in the cache or k, v
    for (size_t task; (task = next++) < tasks.size();) {
      const auto [first_token, last_token, head0, head1] = tasks[task];
      const int64_t kv0 = head0 / group, kvs = (head1 - 1) / group + 1 - kv0;  // the KV heads it reads
      int64_t lo = first(first_token), hi = 0;  // the keys its tokens read
      for (int64_t i = first_token; i < last_token; ++i) lo = std::min(lo, first(i)), hi = std::max(hi, a.positions[i]);
      const int64_t keys = hi + 1 - lo, *table = a.tables + a.seqs[first_token] * a.width;
      constexpr bool direct = std::is_same_v<C, float>;  // a float32 cache is read in place, not copied
      k.resize(direct ? 0 : keys * kvs * dim), v.resize(k.size()), p.resize(keys + 8);  // p: 8 spare floats
      kp.assign(keys + 8, direct ? (const float*)k_cache : k.data()), vp.resize(keys);  // 8 spare keys, unused
      for (int64_t j = 0; j < keys; ++j) {  // key lo + j's slot: block table[(lo + j) / block_size], row the rest
        const int64_t slot = table[(lo + j) / a.block_size] * a.block_size + (lo + j) % a.block_size;
        kp[j] = direct ? (const float*)k_cache + (slot * a.kv_heads + kv0) * dim : &k[j * kvs * dim];
        vp[j] = direct ? (const float*)v_cache + (slot * a.kv_heads + kv0) * dim : &v[j * kvs * dim];
        for (int64_t b = 0; direct && b < kvs * dim; b += 16)
          _mm_prefetch((const char*)(kp[j] + b), _MM_HINT_T1), _mm_prefetch((const char*)(vp[j] + b), _MM_HINT_T1);
        for (int64_t h = 0; h < kvs && !direct; ++h) {
          const int64_t at = slot * a.kv_heads + kv0 + h;  // its vector's offset in the cache / dim, its scale's
          for (int d = 0; d < dim; d += 8) {
            *(v8u*)&k[(j * kvs + h) * dim + d] = load8<T>(k_cache + at * dim + d, a.k_scales ? a.k_scales[at] : 1.f);
            *(v8u*)&v[(j * kvs + h) * dim + d] = load8<T>(v_cache + at * dim + d, a.v_scales ? a.v_scales[at] : 1.f);
          }
        }
      }
      for (int64_t i = first_token; i < last_token; ++i)
        for (int64_t head = head0; head < head1; ++head) {
          const int64_t start = first(i) - lo, len = a.positions[i] + 1 - first(i);  // its keys: start.. in k, v
          const int64_t at = (a.rows[i] * a.heads + head) * dim, h = (head / group - kv0) * dim;
          const float *const *kh = &kp[start], *const *vh = &vp[start];  // h: the head's offset in them
          for (int d = 0; d < dim; ++d) q[d] = round_to<T>(static_cast<float>(q_all[at + d]) * a.scale);
          for (int64_t j = 0; j < len; j += 8) {  // s_j = q . k_j: lanes d % 8 from d = 0 up, then added pairwise
            v8 acc[8] = {};  // keys j..j + 7 at once (past len: the buffers' spare keys and floats)
            for (int d = 0; d < dim; d += 8)
              for (int t = 0; t < 8; ++t) acc[t] += *(const v8u*)&q[d] * *(const v8u*)&kh[j + t][h + d];
            *(v8u*)&p[j] = round8<T>(sums8(acc));
          }
          // Softmax, each probability rounded to T. The last chunk runs past len, into p's 8 spare floats: -inf
          // for the maximum, then 0 for the sum, which adds lanes j % 8 over the chunks, then the lanes pairwise.
          const int64_t end = (len + 7) / 8 * 8;
          std::fill(p.begin() + len, p.begin() + end, -__builtin_inff());
          v8 top = *(const v8u*)&p[0], total = {};
          for (int64_t j = 8; j < len; j += 8) top = top > *(const v8u*)&p[j] ? top : *(const v8u*)&p[j];
          const float m = std::max({top[0], top[1], top[2], top[3], top[4], top[5], top[6], top[7]});
          for (int64_t j = 0; j < len; j += 8) *(v8u*)&p[j] = exp8(*(const v8u*)&p[j] - m);
          std::fill(p.begin() + len, p.begin() + end, 0.0f);
          for (int64_t j = 0; j < len; j += 8) total += *(const v8u*)&p[j];
          const float sum = sum8(total);
          for (int64_t j = 0; j < len; j += 8) *(v8u*)&p[j] = round8<T>(*(const v8u*)&p[j] / sum);
          T* o = o_all + at;
          int d0 = 0;  // 64 dims at a time, then 8
          for (; d0 + 64 <= dim; d0 += 64) weighted<8>(p.data(), vh, h + d0, len, o + d0);
          for (; d0 < dim; d0 += 8) weighted<1>(p.data(), vh, h + d0, len, o + d0);
        }
    }
  });
}

#pragma GCC pop_options

template <typename T>
void with_cache(at::ScalarType cache, const Args& a) {
  switch (cache) {
    case at::kChar: return run<T, int8_t>(a);
    case at::kFloat8_e4m3fn: return run<T, c10::Float8_e4m3fn>(a);
    case at::kFloat8_e5m2: return run<T, c10::Float8_e5m2>(a);
    case at::kBFloat16: return run<T, c10::BFloat16>(a);
    default: return run<T, T>(a);
  }
}

// query [tokens, heads, dim]; caches [blocks, block_size, kv_heads, dim] (scales [blocks, block_size, kv_heads]
// float32 for an 8-bit one); block_tables [seqs, width] int64; rows, seqs, positions [n] int64: each generated
// token's row of query and out, its sequence's row of block_tables and its position. Writes those rows of out.
void token_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& rows, const at::Tensor& seqs,
                     const at::Tensor& positions, double scale, int64_t window,
                     const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                     at::Tensor out) {
  for (const at::Tensor* t : {&query, &k_cache, &v_cache, &block_tables, &rows, &seqs, &positions})
    TORCH_CHECK(t->is_contiguous() && t->device().is_cpu(), "token_attention: contiguous CPU tensors");
  for (const at::Tensor* t : {&block_tables, &rows, &seqs, &positions})
    TORCH_CHECK(t->scalar_type() == at::kLong, "token_attention: int64 indices");
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type() && out.is_contiguous() &&
                  out.is_cpu(), "token_attention: out like query");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0 && query.size(2) == k_cache.size(3) && query.size(2) % 8 == 0,
              "token_attention: shapes (heads a multiple of KV heads, dim a multiple of 8)");
  const bool codes = k_cache.element_size() == 1;
  const auto cache = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == cache &&
                  (codes ? k_scale && v_scale : cache == query.scalar_type() || cache == at::kBFloat16),
              "token_attention: caches in the query's dtype or bfloat16, or 8-bit codes with their scales");
  const Args a{query.const_data_ptr(), k_cache.const_data_ptr(), v_cache.const_data_ptr(),
               codes ? k_scale->const_data_ptr<float>() : nullptr, codes ? v_scale->const_data_ptr<float>() : nullptr,
               block_tables.const_data_ptr<int64_t>(), rows.const_data_ptr<int64_t>(), seqs.const_data_ptr<int64_t>(),
               positions.const_data_ptr<int64_t>(), out.mutable_data_ptr(), rows.numel(), block_tables.size(1),
               query.size(1), query.size(2), k_cache.size(1), k_cache.size(2), window, static_cast<float>(scale)};
  if (query.scalar_type() == at::kBFloat16) return with_cache<c10::BFloat16>(cache, a);
  TORCH_CHECK(query.scalar_type() == at::kFloat, "token_attention: float32 or bfloat16 queries");
  with_cache<float>(cache, a);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(laneserve_cpu, m) {
  m.def("token_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor rows, Tensor seqs, "
        "Tensor positions, float scale, int window, Tensor? k_scale, Tensor? v_scale, Tensor(a!) out) -> ()");
  m.impl("token_attention", c10::DispatchKey::CPU, token_attention);
}
