// Batch-invariant CPU matmul, y[m, n] = sum_k x[m, k] * w[n, k], registered as torch.ops.laneserve_cpu.linear.
// A row's result is the same bits whatever the number of rows, the row's place among them and the thread count,
// because the order of additions of every output element is fixed by construction:
//
// - Weights are packed once (cpu_matmul/__init__.py, pack_*) in blocks of 16 output columns, each block
//   streamed from k = 0 to K, N padded with zero columns to a multiple of 64:
//     float32   [N/16][K][16]                  a column's weights 64 bytes apart
//     bfloat16  [N/16][K/2][16][2]             a column's k pair adjacent, as vdpbf16ps reads it
//     int4      [N/16][K/32][384 bytes]        per group of 32 inputs: 16 scales, 16 zeros (float32), then
//                                              4 x [16 columns][4 bytes]: quad p's byte i holds k = 4p + i
//                                              in its low nibble, k = 16 + 4p + i in its high one
//     int8      [N/16][K/32][576 bytes]        per group of 32 inputs: 16 scales (float32), then per k quad j
//                                              [16 columns][4 bytes]: the codes of k = 4j..4j + 3, plus 128
// - Registers: a tile of R rows by C column blocks of float32 accumulators (a Vec is 16 floats: one zmm, or
//   two ymm). Per k, the C weight vectors are loaded once and each row's x[m, k] is broadcast against them;
//   rows come ROWS at a time, the last tile with fewer. R and C change which register holds an element,
//   never its arithmetic.
// - Threads (at::parallel_for) split the output columns in groups of C blocks, never K, never rows.
// - Order, for every element: float32 and bfloat16 accumulate from 0 over k = 0, 1, ..., K - 1 (bfloat16 a
//   k pair per step: vdpbf16ps where the CPU has it, else two FMAs, k even first). int4 (w = (q - 8) *
//   scale + zero, q in 0..15) by integer dot products, as llama.cpp's Q4_1 by Q8_1: each row's 32 inputs of a
//   group become int8 codes xq = round(x * 127 / amax) and a scale dx = amax / 127 (the row's own values alone;
//   they move logprobs about as bfloat16 activations do, and halve the work of 16-bit codes), the group's sum of
//   (q - 8) * xq is exact in int32 (vpdpbusd from -8 * the sum of xq, on 4 bytes of q a column; without VNNI
//   vpmaddubsw's pairs summed in int16 over the group, then vpmaddwd and the offset: widen()), then
//   acc = fma(scale * dx, sum, acc); acc = fma(zero, xsum, acc), xsum being the row's float32 sum of x over the
//   group (lane k % 8 of 8 from k = 0 up, then the lanes pairwise). int8 (w = q * scale, q in
//   -127..127, GGUF's Q8_0: the LM head beside int4 layers) likewise, with no zero. Float32, int4 and int8 give
//   the same bits on AVX2 and AVX-512, with VNNI or without.
// - Instruction sets: the section between "kernels: begin" and "kernels: end" is compiled once per ISA by
//   including this file into a namespace under #pragma GCC target (avx2, avx2vnni, avx512, avx512vnni, avx512bf16),
//   each defining Vec and its operations first; linear() calls the one Python chose (isa), which supported()
//   vouches for. Each feature counts on its own: VNNI (vpdpbusd for the codes' sums) with or without BF16.
#ifndef LANESERVE_KERNELS
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

enum Kind : int64_t { F32 = 0, BF16 = 1, INT4 = 2, INT8 = 3 };
enum Isa : int64_t { AVX2 = 1, AVX512 = 2, AVX512BF16 = 3, AVX512VNNI = 4, AVX2VNNI = 5 };
// A block's group of 32 inputs: int4 384 bytes (64 of scales, 64 of mins, 256 of codes), int8 576 (64, 512 of codes).
constexpr int64_t GROUP_BYTES = 384, INT8_GROUP_BYTES = 576;
constexpr int64_t PREFETCH = 2048;  // bytes ahead in a column block's stream (past its end: the next block's)

// Calls f(std::integral_constant<int, r>) for 1 <= r <= R: a tile's row count as a compile-time constant.
template <int R, typename F>
inline void with_rows(int r, F&& f) {
  if constexpr (R > 1)
    if (r < R) return with_rows<R - 1>(r, f);
  f(std::integral_constant<int, R>{});
}

// 8 lanes (GCC vectors: the same code for AVX2 and AVX-512), for x's activation codes in linear().
typedef float F8 __attribute__((vector_size(32)));
typedef int32_t I8 __attribute__((vector_size(32)));
typedef float F8u __attribute__((vector_size(32), aligned(4), may_alias));  // 8 floats anywhere
typedef uint16_t U16x8 __attribute__((vector_size(16), aligned(2), may_alias));
typedef int8_t C8 __attribute__((vector_size(8)));
typedef int8_t C8u __attribute__((vector_size(8), aligned(1), may_alias));
// The lanes added pairwise, ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)).
template <typename V>
inline auto sum8(V t) { return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7])); }

#pragma GCC push_options
#pragma GCC target("avx2,fma")
// The types out here (as Zmm's below), so that argument-dependent lookup finds no avx2 kernel in avx2vnni.
struct Ymm { __m256 a, b; };
struct YmmInts { __m256i a, b; };
struct YmmPair { Ymm even, odd; };
namespace avx2 {
using Vec = Ymm;
constexpr int ROWS = 3, COLS = 2, COLS_INT4 = 1;  // 16 ymm registers; 3 rows share int8's weight decoding more
inline Vec zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec bcast(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Vec load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v.a); _mm256_storeu_ps(p + 8, v.b); }
inline Vec fma(Vec x, Vec y, Vec acc) { return {_mm256_fmadd_ps(x.a, y.a, acc.a), _mm256_fmadd_ps(x.b, y.b, acc.b)}; }
// bfloat16 k pairs of 16 columns: a bfloat16 is the top half of a float32, so k even is the pair shifted left.
using Pair = YmmPair;
inline __m256 even(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline __m256 odd(__m256i v) { return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(-65536))); }
inline Pair load_pair(const uint16_t* p) {
  __m256i a = _mm256_loadu_si256((const __m256i*)p), b = _mm256_loadu_si256((const __m256i*)(p + 16));
  return {{even(a), even(b)}, {odd(a), odd(b)}};
}
inline Vec dot2(Pair w, uint32_t x, Vec acc) {  // x's k pair split likewise, k even first
  const float x0 = __builtin_bit_cast(float, x << 16), x1 = __builtin_bit_cast(float, x & 0xffff0000u);
  return fma(bcast(x1), w.odd, fma(bcast(x0), w.even, acc));
}
// Codes: 16 int32 sums (one per column) of 4 byte products each, u (a weight's 4 codes, unsigned) by x (a row's 4
// int8 codes, the same for every column), exact in int32: VNNI's vpdpbusd. Without VNNI, vpmaddubsw, whose int16
// pair sums must not saturate: int4's nibbles (<= 15) as they are (2 * 15 * 127); int8's codes (q + 128) as |q| by
// x signed as q (2 * 127 * 127), so that their sum is q's, not u's: INT8_OFFSET says which.
using Ints = YmmInts;
constexpr int32_t INT8_OFFSET = 0;
inline Ints ibcast(int32_t x) { return {_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
inline Ints codes(const uint8_t* p) {
  return {_mm256_loadu_si256((const __m256i*)p), _mm256_loadu_si256((const __m256i*)(p + 32))};
}
inline Ints low(Ints v) {
  const __m256i m = _mm256_set1_epi8(15);
  return {_mm256_and_si256(v.a, m), _mm256_and_si256(v.b, m)};
}
inline Ints high(Ints v) { return low({_mm256_srli_epi16(v.a, 4), _mm256_srli_epi16(v.b, 4)}); }
template <bool NIBBLES>
inline __m256i dot4(__m256i acc, __m256i u, __m256i x) {
  if constexpr (NIBBLES) return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, x));  // int16 lanes: see widen()
  const __m256i q = _mm256_xor_si256(u, _mm256_set1_epi8(-128));
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(x, q));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
template <bool NIBBLES>
inline Ints dot4(Ints acc, Ints u, int32_t x) {
  const __m256i xv = _mm256_set1_epi32(x);
  return {dot4<NIBBLES>(acc.a, u.a, xv), dot4<NIBBLES>(acc.b, u.b, xv)};
}
inline Vec to_float(Ints v) { return {_mm256_cvtepi32_ps(v.a), _mm256_cvtepi32_ps(v.b)}; }
// int4's sums, kept in int16 lanes for a group (8 nibble pairs' products, each <= 2 * 15 * 127: exact), to int32
// once, plus the offset: one vpmaddwd and one vpaddd a group where each quad took them.
inline Ints widen(Ints v, int32_t offset) {
  const __m256i one = _mm256_set1_epi16(1), o = _mm256_set1_epi32(offset);
  return {_mm256_add_epi32(o, _mm256_madd_epi16(v.a, one)), _mm256_add_epi32(o, _mm256_madd_epi16(v.b, one))};
}
inline Vec mul(Vec x, Vec y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
#define LANESERVE_KERNELS
#include "matmul.cpp"
#undef LANESERVE_KERNELS
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,avxvnni")
namespace avx2vnni {  // avx2's, but the codes' sums by AVX-VNNI's vpdpbusd (the same sums: exact in int32)
using avx2::Vec, avx2::zero, avx2::bcast, avx2::load, avx2::store, avx2::fma, avx2::mul, avx2::Pair, avx2::load_pair;
using avx2::Ints, avx2::widen, avx2::ibcast, avx2::codes, avx2::low, avx2::high, avx2::to_float;
using avx2::ROWS, avx2::COLS, avx2::COLS_INT4;
inline Vec dot2(Pair w, uint32_t x, Vec acc) { return avx2::dot2(w, x, acc); }  // not its whole overload set
constexpr int32_t INT8_OFFSET = 128;  // vpdpbusd sums u = q + 128
template <bool>
inline Ints dot4(Ints acc, Ints u, int32_t x) {
  const __m256i xv = _mm256_set1_epi32(x);
  return {_mm256_dpbusd_avx_epi32(acc.a, u.a, xv), _mm256_dpbusd_avx_epi32(acc.b, u.b, xv)};
}
#define LANESERVE_KERNELS
#include "matmul.cpp"
#undef LANESERVE_KERNELS
}  // namespace avx2vnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
// Out here, so that argument-dependent lookup finds no put() or dot4() of avx512's in avx512vnni or avx512bf16.
struct Zmm { __m512 a; };
struct ZmmInts { __m512i a; };
struct ZmmPair { Zmm even, odd; };
namespace avx512 {
using Vec = Zmm;
constexpr int ROWS = 4, COLS = 4, COLS_INT4 = 2;  // 32 zmm registers
inline Vec zero() { return {_mm512_setzero_ps()}; }
inline Vec bcast(float x) { return {_mm512_set1_ps(x)}; }
inline Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v.a); }
inline Vec fma(Vec x, Vec y, Vec acc) { return {_mm512_fmadd_ps(x.a, y.a, acc.a)}; }
using Pair = ZmmPair;
inline Pair load_pair(const uint16_t* p) {
  __m512i v = _mm512_loadu_si512(p);
  return {{_mm512_castsi512_ps(_mm512_slli_epi32(v, 16))},
          {_mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(-65536)))}};
}
inline Vec dot2(Pair w, uint32_t x, Vec acc) {
  const float x0 = __builtin_bit_cast(float, x << 16), x1 = __builtin_bit_cast(float, x & 0xffff0000u);
  return fma(bcast(x1), w.odd, fma(bcast(x0), w.even, acc));
}
using Ints = ZmmInts;
inline Ints ibcast(int32_t x) { return {_mm512_set1_epi32(x)}; }
inline Ints codes(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
inline Ints low(Ints v) { return {_mm512_and_si512(v.a, _mm512_set1_epi8(15))}; }
inline Ints high(Ints v) { return low({_mm512_srli_epi16(v.a, 4)}); }
constexpr int32_t INT8_OFFSET = 0;  // as avx2's, vpsignb by a masked subtraction
template <bool NIBBLES>
inline Ints dot4(Ints acc, Ints u, int32_t x) {
  const __m512i xv = _mm512_set1_epi32(x);
  if constexpr (NIBBLES) return {_mm512_add_epi16(acc.a, _mm512_maddubs_epi16(u.a, xv))};  // as avx2's
  const __m512i q = _mm512_xor_si512(u.a, _mm512_set1_epi8(-128));  // x negated where q < 0
  const __m512i signed_x = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(q), _mm512_setzero_si512(), xv);
  return {_mm512_add_epi32(acc.a, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(q), signed_x),
                                                    _mm512_set1_epi16(1)))};
}
inline Vec to_float(Ints v) { return {_mm512_cvtepi32_ps(v.a)}; }
inline Ints widen(Ints v, int32_t offset) {  // as avx2's
  return {_mm512_add_epi32(_mm512_set1_epi32(offset), _mm512_madd_epi16(v.a, _mm512_set1_epi16(1)))};
}
inline Vec mul(Vec x, Vec y) { return {_mm512_mul_ps(x.a, y.a)}; }
#define LANESERVE_KERNELS
#include "matmul.cpp"
#undef LANESERVE_KERNELS
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")
namespace avx512vnni {  // avx512's, but the codes' sums by vpdpbusd (VNNI without BF16: Ice Lake, Cascade Lake)
using avx512::Vec, avx512::zero, avx512::bcast, avx512::load, avx512::store, avx512::fma, avx512::mul;
using avx512::Ints, avx512::widen, avx512::ibcast, avx512::codes, avx512::low, avx512::high, avx512::to_float;
using avx512::ROWS, avx512::COLS, avx512::COLS_INT4, avx512::Pair, avx512::load_pair;
inline Vec dot2(Pair w, uint32_t x, Vec acc) { return avx512::dot2(w, x, acc); }  // not its whole overload set
constexpr int32_t INT8_OFFSET = 128;  // vpdpbusd sums u = q + 128
template <bool>
inline Ints dot4(Ints acc, Ints u, int32_t x) { return {_mm512_dpbusd_epi32(acc.a, u.a, _mm512_set1_epi32(x))}; }
#define LANESERVE_KERNELS
#include "matmul.cpp"
#undef LANESERVE_KERNELS
}  // namespace avx512vnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,fma")
namespace avx512bf16 {  // avx512vnni's, but bfloat16 pairs by vdpbf16ps
using avx512::Vec, avx512::zero, avx512::bcast, avx512::load, avx512::store, avx512::fma, avx512::mul;
using avx512::Ints, avx512::widen, avx512::ibcast, avx512::codes, avx512::low, avx512::high, avx512::to_float;
using avx512::ROWS, avx512::COLS, avx512::COLS_INT4, avx512vnni::dot4, avx512vnni::INT8_OFFSET;
struct Pair { __m512bh w; };
inline Pair load_pair(const uint16_t* p) { return {(__m512bh)_mm512_loadu_si512(p)}; }
inline Vec dot2(Pair w, uint32_t x, Vec acc) { return {_mm512_dpbf16_ps(acc.a, w.w, (__m512bh)_mm512_set1_epi32(x))}; }
#define LANESERVE_KERNELS
#include "matmul.cpp"
#undef LANESERVE_KERNELS
}  // namespace avx512bf16
#pragma GCC pop_options

bool supported(int64_t isa) {
  __builtin_cpu_init();
  switch (isa) {
    case AVX2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case AVX512: return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    case AVX2VNNI: return supported(AVX2) && __builtin_cpu_supports("avxvnni");
    case AVX512VNNI: return supported(AVX512) && __builtin_cpu_supports("avx512vnni");
    case AVX512BF16: return supported(AVX512VNNI) && __builtin_cpu_supports("avx512bf16");
    default: return false;
  }
}

// x [M, K] (float32, or bfloat16 for bfloat16 weights; int4 takes either) by the packed weight: [M, n] in x's dtype,
// plus residual ([M, n] in that dtype) if given: the layer's output added to the stream it feeds, in the same op.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t kind, int64_t n, int64_t isa,
                  const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu() && packed.is_contiguous() && packed.is_cpu(),
              "linear: x must be a contiguous 2-D CPU tensor, the packed weight contiguous on the CPU");
  TORCH_CHECK(supported(isa), "linear: instruction set ", isa, " is not supported by this CPU");
  const int64_t M = x.size(0), K = x.size(1), N64 = (n + 63) / 64 * 64;
  const int64_t want = kind == F32 ? N64 * K * 4 : kind == BF16 ? N64 * K * 2
                       : N64 / 16 * (K / 32) * (kind == INT4 ? GROUP_BYTES : INT8_GROUP_BYTES);
  TORCH_CHECK(kind >= F32 && kind <= INT8, "linear: kind ", kind, " is not 0 to 3");
  TORCH_CHECK(packed.nbytes() == (size_t)want && (kind != BF16 || K % 2 == 0) && (kind < INT4 || K % 32 == 0),
              "linear: packed weight of ", packed.nbytes(), " bytes does not fit x's ", K, " inputs and ", n,
              " outputs");
  TORCH_CHECK(kind >= INT4 ? (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16)
                           : x.scalar_type() == (kind == F32 ? at::kFloat : at::kBFloat16),
              "linear: x's dtype ", x.scalar_type(), " does not fit the weight's");
  TORCH_CHECK(!residual || (residual->sizes() == at::IntArrayRef{M, n} && residual->scalar_type() == x.scalar_type()),
              "linear: the residual must be [M, n] in x's dtype");
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return y;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  auto run = [&](auto* out) {
    switch (isa) {
      case AVX2: return avx2::linear(kind, x.data_ptr(), bf16, packed.data_ptr(), out, M, K, n);
      case AVX2VNNI: return avx2vnni::linear(kind, x.data_ptr(), bf16, packed.data_ptr(), out, M, K, n);
      case AVX512: return avx512::linear(kind, x.data_ptr(), bf16, packed.data_ptr(), out, M, K, n);
      case AVX512VNNI: return avx512vnni::linear(kind, x.data_ptr(), bf16, packed.data_ptr(), out, M, K, n);
      default: return avx512bf16::linear(kind, x.data_ptr(), bf16, packed.data_ptr(), out, M, K, n);
    }
  };
  bf16 ? run(reinterpret_cast<c10::BFloat16*>(y.data_ptr())) : run(y.data_ptr<float>());
  if (residual) y.add_(*residual);  // in float32, rounded to x's dtype once: torch's add, as the Python form's
  return y;
}

}  // namespace

TORCH_LIBRARY(laneserve_cpu, m) {
  m.def("linear(Tensor x, Tensor packed, int kind, int n, int isa, Tensor? residual=None) -> Tensor");
  m.def("supported(int isa) -> bool");
  m.impl("linear", c10::DispatchKey::CPU, linear);
  m.impl("supported", c10::DispatchKey::CatchAll, [](int64_t isa) { return supported(isa); });
}

#else  // kernels: begin (included per ISA, after Vec, Pair, Ints and their operations, ROWS, COLS, COLS_INT4)

// A tile's accumulators into y (its first row's; columns past n dropped), rounded to Out (float32, or bfloat16 to
// nearest even).
template <int R, int C, typename Out>
inline void put(Vec (&acc)[R][C], Out* y, int64_t n, int64_t col) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const int64_t at = r * n + (col + c) * 16, cols = std::min<int64_t>(16, n - (col + c) * 16);
      float t[16];
      if constexpr (std::is_same_v<Out, float>)
        if (cols == 16) {  // the common case as one vector store: the loop below costs as much as a small tile
          store(y + at, acc[r][c]);
          continue;
        }
      store(t, acc[r][c]);
      for (int64_t j = 0; j < cols; ++j) y[at + j] = Out(t[j]);
    }
}

// A quantized group's cache lines, PREFETCH bytes on: the stream runs ahead of the loads (a prefetch never faults).
inline void prefetch(const uint8_t* group, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch((const char*)group + PREFETCH + line, _MM_HINT_T0);
}

// A weight's step: float32, one k (x[m, k] broadcast); bfloat16, one k pair (x's pair as 32 bits). Either reads
// 64 bytes of a column block's stream.
inline Vec load_w(const float* w) { return load(w); }
inline Pair load_w(const uint16_t* w) { return load_pair(w); }
inline Vec dot2(Vec w, float x, Vec acc) { return fma(bcast(x), w, acc); }

// R rows by C column blocks from column block `col` (w: its packed data); x and y: the first row's.
template <int R, int C, typename X, typename W, typename Out>
void tile(const X* x, const W* w, Out* y, int64_t steps, int64_t n, int64_t col) {
  Vec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = zero();
  for (int64_t p = 0; p < steps; ++p) {
    decltype(load_w(w)) wv[C];
    for (int c = 0; c < C; ++c) wv[c] = load_w(w + (c * steps + p) * (64 / sizeof(W)));
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = dot2(wv[c], x[r * steps + p], acc[r][c]);
  }
  put(acc, y, n, col);
}

// The quantized kinds (EIGHT: int8, else int4). xp: the rows' int8 codes [M, K], 4 to an int32 (k order); dx,
// xsum, xqsum: per group [M, K / 32], their scales, x's sums (int4's zero term alone) and the codes' sums' offset,
// already negated so that a tile starts from a plain broadcast (int4: -8 * the sum of xq, for q - 8; int8: -128 *
// it, for weights stored as q + 128).
template <int R, int C, bool EIGHT, typename Out>
void quant_tile(const int32_t* xp, const float* dx, const float* xsum, const int32_t* xqsum, const uint8_t* w, Out* y,
                int64_t K, int64_t n, int64_t col) {
  constexpr int64_t BYTES = EIGHT ? INT8_GROUP_BYTES : GROUP_BYTES;
  constexpr bool WIDEN = !EIGHT && INT8_OFFSET == 0;  // without VNNI, int4's sums in int16 lanes (avx2's widen)
  const int64_t G = K / 32;
  Vec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = zero();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* blk[C];
    Ints s[R][C];
    for (int c = 0; c < C; ++c) {
      blk[c] = w + (c * G + g) * BYTES;
      prefetch(blk[c], BYTES);
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) s[r][c] = ibcast(WIDEN ? 0 : xqsum[r * G + g]);  // the offset first, or at widen()
    for (int j = 0; j < (EIGHT ? 8 : 4); ++j) {  // int8: k quad j; int4: quads j (low nibbles) and 4 + j (high)
      Ints u[C][2];
      for (int c = 0; c < C; ++c) {
        const Ints v = codes(blk[c] + (EIGHT ? 64 : 128) + 64 * j);
        u[c][0] = EIGHT ? v : low(v);
        if constexpr (!EIGHT) u[c][1] = high(v);
      }
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) {
          const int32_t* x = xp + (r * G + g) * 8;
          s[r][c] = dot4<!EIGHT>(s[r][c], u[c][0], x[j]);
          if constexpr (!EIGHT) s[r][c] = dot4<true>(s[r][c], u[c][1], x[4 + j]);
        }
    }
    for (int c = 0; c < C; ++c) {
      Vec scale = load(reinterpret_cast<const float*>(blk[c]));
      for (int r = 0; r < R; ++r) {
        const Vec sum = to_float(WIDEN ? widen(s[r][c], xqsum[r * G + g]) : s[r][c]);
        if constexpr (EIGHT) {
          acc[r][c] = fma(mul(scale, bcast(dx[r * G + g])), sum, acc[r][c]);
        } else {
          Vec zr = load(reinterpret_cast<const float*>(blk[c] + 64));
          acc[r][c] = fma(zr, bcast(xsum[r * G + g]), fma(mul(scale, bcast(dx[r * G + g])), sum, acc[r][c]));
        }
      }
    }
  }
  put(acc, y, n, col);
}

// The whole product: threads over groups of C column blocks; in each, all rows, ROWS at a time.
template <typename Out>
void linear(int64_t kind, const void* x, bool x_bf16, const void* w, Out* y, int64_t M, int64_t K, int64_t n) {
  const int64_t blocks = (n + 63) / 64 * 4, G = K / 32;
  const bool codes = kind == INT4 || kind == INT8;
  std::vector<float> dx(codes ? M * G : 0), xsum(dx.size());
  std::vector<int32_t> xqsum(dx.size());
  std::vector<int32_t> xp(codes ? M * K / 4 : 0);
  if (codes) {  // each row's groups quantized to int8, from their own values alone, 8 k's a vector
    at::parallel_for(0, M * G, 512, [&](int64_t b, int64_t e) {  // a few rows' groups: no threads to wake
      const F8 lo = F8{} - 127.0f, hi = F8{} + 127.0f, even = F8{} + 12582912.0f;  // 1.5 * 2^23
      for (int64_t i = b; i < e; ++i) {
        F8 v[4], top{}, total{};  // x's group in float32 (from bfloat16: exact)
        for (int c = 0; c < 4; ++c) {
          const int64_t at = i * 32 + 8 * c;
          v[c] = x_bf16 ? (F8)(__builtin_convertvector(*(const U16x8*)(static_cast<const uint16_t*>(x) + at), I8) << 16)
                        : *(const F8u*)(static_cast<const float*>(x) + at);
          const F8 a = (F8)((I8)v[c] & 0x7fffffff);  // |v|
          top = top < a ? a : top, total += v[c];
        }
        float amax = 0;
        for (int l = 0; l < 8; ++l) amax = std::max(amax, top[l]);
        const float inv = amax > 0 ? 127.0f / amax : 0.0f;
        I8 qsum{};
        int8_t* q = reinterpret_cast<int8_t*>(xp.data() + i * 8);
        for (int c = 0; c < 4; ++c) {
          F8 y = v[c] * inv;
          y = lo < y ? y : lo, y = y < hi ? y : hi;  // a NaN to -127
          const I8 n = __builtin_convertvector((y + even) - even, I8);  // to nearest even, as nearbyint: |y| < 2^22
          qsum += n;
          *(C8u*)(q + 8 * c) = __builtin_convertvector(n, C8);
        }
        dx[i] = amax / 127.0f, xsum[i] = sum8(total), xqsum[i] = -(kind == INT8 ? INT8_OFFSET : 8) * sum8(qsum);
      }
    });
  }
  const int64_t C = codes ? COLS_INT4 : COLS;
  at::parallel_for(0, blocks / C, 1, [&](int64_t b, int64_t e) {
    for (int64_t cg = b; cg < e; ++cg)
      for (int64_t m = 0; m < M; m += ROWS)
        with_rows<ROWS>(std::min<int64_t>(ROWS, M - m), [&](auto R) {
          const int64_t col = cg * C;
          if (kind == F32)
            tile<R.value, COLS>(static_cast<const float*>(x) + m * K, static_cast<const float*>(w) + col * K * 16,
                                y + m * n, K, n, col);
          else if (kind == BF16)  // x's k pairs as 32 bits
            tile<R.value, COLS>(static_cast<const uint32_t*>(x) + m * K / 2,
                                static_cast<const uint16_t*>(w) + col * K * 16, y + m * n, K / 2, n, col);
          else
            (kind == INT4 ? quant_tile<R.value, COLS_INT4, false, Out> : quant_tile<R.value, COLS_INT4, true, Out>)(
                xp.data() + m * K / 4, dx.data() + m * G, xsum.data() + m * G, xqsum.data() + m * G,
                static_cast<const uint8_t*>(w) + col * G * (kind == INT4 ? GROUP_BYTES : INT8_GROUP_BYTES), y + m * n,
                K, n, col);
        });
  });
}

#endif  // kernels: end
