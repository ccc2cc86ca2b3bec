// Driver: runs the real launchers of attention_cuda/paged_attention.cu (compiled as host C++ under
// cuda_emu.h) on random paged caches and compares with an independent float64 reference.
//   emu_driver [quick|full|sched]     (default full)
// laneserve's copy of ../shared/tools/cuda_emu/emu_driver.cpp (run by .ci/emu/run_emu.sh), extended for the 8-bit
// KV caches: every attention case runs with each cache type (auto, fp8 e4m3, fp8 e5m2, int8; the reference
// dequantizes float(code) * scale in float32), every code's value comes back exactly through the kernel, and
// laneserve_store_kv_quantized writes the codes and scales of the contract's formula, byte for byte. Also: sliding
// windows (each lane reads only its last `window` tokens; the reference sums over those alone) and head_dim 256.
// Exit status 0 only if every case passed and the emulator recorded no error.
#define EMU_IMPLEMENTATION
#include "cuda_emu.h"
#include "paged_attention.h"  // the launchers, from kernel_tu.cpp (the real kernel file)

#include <algorithm>
#include <chrono>
#include <map>
#include <tuple>

namespace {

// ---- independent dtype conversions (round to nearest even), not the CUDA headers' ----
uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
uint16_t to_bf16(float f) {
  uint32_t u = f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}
double from_bf16(uint16_t h) { return u2f(uint32_t(h) << 16); }
double from_f16(uint16_t h) {
  const int e = (h >> 10) & 31, m = h & 1023;
  const double s = (h & 0x8000) ? -1 : 1;
  if (e == 0) return s * std::ldexp(double(m), -24);
  if (e == 31) return m ? NAN : s * INFINITY;
  return s * std::ldexp(double(m | 1024), e - 25);
}
uint16_t to_f16(float f) {  // exact RNE via search on the decoded grid (slow but obviously right)
  if (std::isnan(f)) return 0x7e00;
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double a = std::fabs(double(f));
  if (a >= 65520.0) return sign | 0x7c00;
  uint16_t lo = 0, hi = 0x7bff;  // largest magnitude <= a
  while (lo < hi) { uint16_t mid = uint16_t((lo + hi + 1) / 2); if (from_f16(mid) <= a) lo = mid; else hi = uint16_t(mid - 1); }
  if (lo == 0x7bff) return sign | lo;
  const double d0 = a - from_f16(lo), d1 = from_f16(uint16_t(lo + 1)) - a;
  const uint16_t r = d0 < d1 ? lo : d1 < d0 ? uint16_t(lo + 1) : ((lo & 1) ? uint16_t(lo + 1) : lo);
  return sign | r;
}

// ---- 8-bit codes: decoded from the formats' definitions, encoded by search on the decoded grid ----
enum { AUTO, E4M3, E5M2, INT8 };  // the launchers' cache_dtype
const char* KV_NAME[4] = {"auto", "fp8_e4m3", "fp8_e5m2", "int8"};
const float QMAX[4] = {0.f, 448.f, 57344.f, 127.f};
double decode_ref(int kv, uint8_t c) {
  const double s = (c & 0x80) ? -1 : 1;
  if (kv == INT8) return int8_t(c);
  if (kv == E4M3) {  // 2^(e-7) * (1 + m/8); e = 0: 2^-6 * m/8; S.1111.111 NaN
    const int e = (c >> 3) & 15, m = c & 7;
    if (e == 15 && m == 7) return NAN;
    return s * (e ? std::ldexp(8 + m, e - 10) : std::ldexp(m, -9));
  }
  const int e = (c >> 2) & 31, m = c & 3;  // 2^(e-15) * (1 + m/4); e = 0: 2^-14 * m/4; e = 31: inf, NaN
  if (e == 31) return m ? NAN : s * INFINITY;
  return s * (e ? std::ldexp(4 + m, e - 17) : std::ldexp(m, -16));
}
// Round to nearest, ties to the even code; beyond the largest finite code, against the next one up as torch
// does (e4m3: 480, NaN; e5m2: 61440, inf). int8: round half to even, clamp to +-127.
uint8_t encode_ref(int kv, float y) {
  if (kv == INT8) return uint8_t(int8_t(std::clamp(std::nearbyint(y), -127.f, 127.f)));
  const uint8_t sign = std::signbit(y) ? 0x80 : 0;
  if (std::isnan(y)) return sign | 0x7f;
  const double a = std::fabs(double(y));
  const int top = kv == E4M3 ? 0x7e : 0x7b;
  int lo = 0;  // the largest code <= a (positive codes grow with their value)
  while (lo < top && decode_ref(kv, uint8_t(lo + 1)) <= a) ++lo;
  const double next = lo < top ? decode_ref(kv, uint8_t(lo + 1)) : kv == E4M3 ? 480.0 : 61440.0;
  const double d0 = a - decode_ref(kv, uint8_t(lo)), d1 = next - a;
  const bool up = d1 < d0 || (d1 == d0 && (lo & 1));
  return sign | uint8_t(!up ? lo : lo < top ? lo + 1 : kv == E4M3 ? 0x7f : 0x7c);
}
// The contract's quantization of one row of n values, in float32: returns the scale, writes the codes.
float quantize_ref(int kv, const float* x, int n, uint8_t* codes) {
  float amax = 0.f;
  for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float q = QMAX[kv] / amax, inv = std::isfinite(q) ? q : 0.f;
  for (int i = 0; i < n; ++i) codes[i] = encode_ref(kv, x[i] * inv);
  return amax / QMAX[kv];
}

struct Rng {
  uint64_t s;
  uint64_t next() { uint64_t z = (s += 0x9e3779b97f4a7c15ull); z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull; z = (z ^ (z >> 27)) * 0x94d049bb133111ebull; return z ^ (z >> 31); }
  double uniform() { return (next() >> 11) * (1.0 / 9007199254740992.0); }
  float normal() { double u1 = uniform(), u2 = uniform(); if (u1 < 1e-300) u1 = 1e-300; return float(std::sqrt(-2 * std::log(u1)) * std::cos(6.283185307179586 * u2)); }
  int below(int n) { return int(next() % uint64_t(n)); }
};

const char* DTYPE_NAME[3] = {"float32", "float16", "bfloat16"};
int esize(int dt) { return dt == 0 ? 4 : 2; }

// A typed buffer of exactly `n` elements (malloc'ed exactly, so ASan catches any overrun).
struct Buf {
  int dt; size_t n; void* p;
  Buf(int dt_, size_t n_) : dt(dt_), n(n_) { size_t b = std::max<size_t>(16, (n * esize(dt) + 15) / 16 * 16); p = aligned_alloc(16, b); memset(p, 0xff, b); }
  ~Buf() { free(p); }
  Buf(const Buf&) = delete;
  void set(size_t i, float v) {
    if (dt == 0) static_cast<float*>(p)[i] = v;
    else static_cast<uint16_t*>(p)[i] = dt == 1 ? to_f16(v) : to_bf16(v);
  }
  double get(size_t i) const {
    if (dt == 0) return static_cast<const float*>(p)[i];
    const uint16_t h = static_cast<const uint16_t*>(p)[i];
    return dt == 1 ? from_f16(h) : from_bf16(h);
  }
};

struct Tol { double atol, rtol; };
const Tol TOL[3] = {{1e-4, 1e-3}, {1e-3, 3e-3}, {2e-3, 1.2e-2}};  // as test_attention.py's TOLERANCE

struct Stats { double max_abs = 0, max_rel = 0, max_ulp = 0; size_t n = 0; };
// One unit in the last place of the output dtype at magnitude |x| (normal range).
double ulp(int dt, double x) {
  const int mant = dt == 0 ? 23 : dt == 1 ? 10 : 7, emin = dt == 1 ? -14 : -126;
  int e; std::frexp(std::fabs(x), &e);  // |x| in [2^(e-1), 2^e)
  return std::ldexp(1.0, std::max(e - 1, emin) - mant);
}
std::map<std::pair<int, int>, Stats> g_stats;  // per (cache type, dtype)
int g_fail = 0, g_cases = 0;

struct AttnCase {
  int dt, head_dim, num_heads, num_kv_heads, block_size;
  std::vector<int> lens;      // context length per lane (the kernel clamps to the table's capacity)
  int extra_cols = 2;         // unused block-table columns per lane
  int q_row_heads = 0;        // query row stride in heads (0: num_heads, i.e. contiguous)
  bool garbage_tables = false;  // unused table entries hold huge ids (would fault if read)
  float q_scale = 2.0f;
  uint64_t seed = 1;
  const char* note = "";
  int overclaim = 0;  // context_lens[0] passed to the kernel = lens[0] + overclaim (table sized for lens[0])
  int kv = AUTO;      // the cache type
  int window = 0;     // > 0: a sliding window, each lane's last `window` tokens
};

// An 8-bit cache and its scales, exactly sized (so ASan catches any overrun); [slots, kv_heads, head_dim] codes.
struct Codes {
  uint8_t* codes; float* scales;
  Codes(size_t rows, int hd) : codes(static_cast<uint8_t*>(malloc(rows * hd))), scales(static_cast<float*>(malloc(rows * 4))) {}
  ~Codes() { free(codes), free(scales); }
  Codes(const Codes&) = delete;
};

std::string lens_str(const std::vector<int>& v) {
  std::string s;
  for (int x : v) s += (s.empty() ? "" : ",") + std::to_string(x);
  return s;
}

void run_attention(const AttnCase& c) {
  ++g_cases;
  Rng rng{c.seed * 7919 + 17};
  const int seqs = int(c.lens.size()), bs = c.block_size, hd = c.head_dim, kvh = c.num_kv_heads, nh = c.num_heads;
  const int group = nh / kvh;
  std::vector<int> need(seqs);
  int total = 0, maxneed = 1;
  for (int i = 0; i < seqs; ++i) { need[i] = (std::max(c.lens[i], 0) + bs - 1) / bs; total += need[i]; maxneed = std::max(maxneed, need[i]); }
  const int num_blocks = total + 3, max_blocks = maxneed + c.extra_cols;
  std::vector<int> perm(num_blocks);
  for (int i = 0; i < num_blocks; ++i) perm[i] = i;
  for (int i = num_blocks - 1; i > 0; --i) std::swap(perm[i], perm[rng.below(i + 1)]);
  int* tables = static_cast<int*>(aligned_alloc(16, (size_t(seqs) * max_blocks * 4 + 15) / 16 * 16));
  int next = 0;
  for (int i = 0; i < seqs; ++i)
    for (int b = 0; b < max_blocks; ++b)
      tables[i * max_blocks + b] = b < need[i] ? perm[next++] : c.garbage_tables ? 0x7fffff00 + b : 0;
  int* lens = static_cast<int*>(aligned_alloc(16, (seqs * 4 + 15) / 16 * 16));
  for (int i = 0; i < seqs; ++i) lens[i] = c.lens[i] + (i == 0 ? c.overclaim : 0);
  const size_t cache_n = size_t(num_blocks) * bs * kvh * hd, rows = cache_n / hd;
  Buf kc(c.kv ? 0 : c.dt, c.kv ? 1 : cache_n), vc(c.kv ? 0 : c.dt, c.kv ? 1 : cache_n);
  Codes kq(c.kv ? rows : 1, hd), vq(c.kv ? rows : 1, hd);
  std::vector<double> kd(cache_n), vd(cache_n);  // the values the reference reads: for 8-bit caches, dequantized
  if (!c.kv) {
    for (size_t i = 0; i < cache_n; ++i) kc.set(i, rng.normal()), kd[i] = kc.get(i);
    for (size_t i = 0; i < cache_n; ++i) vc.set(i, rng.normal()), vd[i] = vc.get(i);
  } else {  // rows of varied magnitudes, quantized by the contract's formula
    std::vector<float> x(hd);
    for (auto [q, d] : {std::pair(&kq, &kd), std::pair(&vq, &vd)})
      for (size_t r = 0; r < rows; ++r) {
        const float mag = float(std::exp(0.5 * rng.normal()));
        for (int j = 0; j < hd; ++j) x[j] = rng.normal() * mag;
        q->scales[r] = quantize_ref(c.kv, x.data(), hd, q->codes + r * hd);
        for (int j = 0; j < hd; ++j) (*d)[r * hd + j] = float(decode_ref(c.kv, q->codes[r * hd + j])) * q->scales[r];
      }
  }
  const int qrow = (c.q_row_heads ? c.q_row_heads : nh) * hd;
  Buf q(c.dt, size_t(seqs) * qrow);
  for (size_t i = 0; i < q.n; ++i) q.set(i, rng.normal() * c.q_scale);
  Buf out(c.dt, size_t(seqs) * nh * hd);  // poisoned (0xff: NaN) by Buf: every element must be written
  const float scale = float(1.0 / std::sqrt(double(hd)));

  PagedAttentionParams p{};
  p.out = out.p;
  p.query = q.p, p.k_cache = c.kv ? (void*)kq.codes : kc.p, p.v_cache = c.kv ? (void*)vq.codes : vc.p;
  p.k_scale = c.kv ? kq.scales : nullptr, p.v_scale = c.kv ? vq.scales : nullptr, p.cache_dtype = c.kv;
  p.block_tables = tables, p.context_lens = lens;
  p.num_seqs = seqs, p.num_heads = nh, p.num_kv_heads = kvh, p.head_dim = hd, p.block_size = bs;
  p.max_blocks = max_blocks, p.dtype = c.dt;
  p.q_stride_seq = qrow, p.q_stride_head = hd, p.scale = scale, p.window = c.window;
  p.num_splits = laneserve_attention_splits(int64_t(max_blocks) * bs);  // as binding.cpp does
  float *tmp_out = nullptr, *tmp_ml = nullptr;
  if (p.num_splits > 1) {  // exactly the binding's sizes, poisoned with NaN
    const size_t r = size_t(seqs) * nh * p.num_splits;
    tmp_out = static_cast<float*>(aligned_alloc(16, (r * hd * 4 + 15) / 16 * 16));
    tmp_ml = static_cast<float*>(aligned_alloc(16, (r * 2 * 4 + 15) / 16 * 16));
    for (size_t i = 0; i < r * hd; ++i) tmp_out[i] = NAN;
    for (size_t i = 0; i < r * 2; ++i) tmp_ml[i] = NAN;
  }
  p.tmp_out = tmp_out, p.tmp_ml = tmp_ml;
  const size_t err_before = emu::S.errors.size();
  const auto t0 = std::chrono::steady_clock::now();
  const char* err = laneserve_paged_attention(&p, nullptr);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  // float64 reference: softmax(q.k * scale) v over the lane's first min(max(len,0), capacity) tokens.
  Stats st;
  int bad = 0;
  std::string first_bad;
  std::vector<double> logits, w;
  for (int s = 0; s < seqs; ++s) {
    const int ctx = std::min(std::max(lens[s], 0), max_blocks * bs);
    const int first = c.window > 0 && ctx > c.window ? ctx - c.window : 0;  // the window's first token
    for (int h = 0; h < nh; ++h) {
      const int kh = h / group;
      std::vector<double> ref(hd, 0.0);
      if (ctx > 0) {
        logits.assign(ctx, 0);
        double mx = -INFINITY;
        for (int t = 0; t < ctx; ++t) {
          if (t < first) { logits[t] = -INFINITY; continue; }
          const size_t base = ((size_t(tables[s * max_blocks + t / bs]) * bs + t % bs) * kvh + kh) * hd;
          double dot = 0;
          for (int d = 0; d < hd; ++d) dot += q.get(size_t(s) * qrow + size_t(h) * hd + d) * kd[base + d];
          logits[t] = dot * scale;
          mx = std::max(mx, logits[t]);
        }
        double sum = 0;
        for (int t = 0; t < ctx; ++t) sum += (logits[t] = std::exp(logits[t] - mx));
        for (int t = first; t < ctx; ++t) {
          const size_t base = ((size_t(tables[s * max_blocks + t / bs]) * bs + t % bs) * kvh + kh) * hd;
          const double wt = logits[t] / sum;
          for (int d = 0; d < hd; ++d) ref[d] += wt * vd[base + d];
        }
      }
      for (int d = 0; d < hd; ++d) {
        const double o = out.get((size_t(s) * nh + h) * hd + d), e = ref[d];
        const double ae = std::fabs(o - e), re = ae / std::max(std::fabs(e), 1e-6);
        const bool ok = std::isfinite(o) && ae <= TOL[c.dt].atol + TOL[c.dt].rtol * std::fabs(e) &&
                        (ctx > 0 || o == 0.0);
        if (std::isfinite(o)) { st.max_abs = std::max(st.max_abs, ae); if (std::fabs(e) >= 0.25) st.max_ulp = std::max(st.max_ulp, ae / ulp(c.dt, e)); if (std::fabs(e) > 1e-3) st.max_rel = std::max(st.max_rel, re); }
        else st.max_abs = INFINITY;
        ++st.n;
        if (!ok) {
          if (!bad) { char b[200]; snprintf(b, sizeof b, "first bad: lane %d (len %d) head %d dim %d: got %.6g want %.6g", s, c.lens[s], h, d, o, e); first_bad = b; }
          ++bad;
        }
      }
    }
  }
  const bool emu_err = emu::S.errors.size() != err_before;
  const bool pass = !err && !bad && !emu_err;
  g_fail += !pass;
  Stats& g = g_stats[{c.kv, c.dt}];
  g.max_abs = std::max(g.max_abs, st.max_abs), g.max_rel = std::max(g.max_rel, st.max_rel), g.n += st.n;
  g.max_ulp = std::max(g.max_ulp, st.max_ulp);
  printf("%s attn %-8s kv=%-8s hd=%-3d heads=%d/%d bs=%-2d splits=%-2d lens=[%s]%s%s%s  max_abs=%.3g max_rel=%.3g ulp=%.2f (%.1fs)\n",
         pass ? "PASS" : "FAIL", DTYPE_NAME[c.dt], KV_NAME[c.kv], hd, nh, kvh, bs, p.num_splits, lens_str(std::vector<int>(lens, lens + seqs)).c_str(),
         c.q_row_heads ? " strided-q" : "", c.garbage_tables ? " garbage-table-tail" : "", c.note, st.max_abs, st.max_rel, st.max_ulp, secs);
  if (err) printf("     launcher error: %s\n", err);
  if (bad) printf("     %d bad elements; %s\n", bad, first_bad.c_str());
  for (size_t i = err_before; i < emu::S.errors.size(); ++i) printf("     emulator: %s\n", emu::S.errors[i].c_str());
  fflush(stdout);
  free(tables), free(lens), free(tmp_out), free(tmp_ml);
}

// Slots for `tokens` new tokens: shuffled, every 4th -1 (padding), token 1's the very last of the cache.
int64_t* new_slots(Rng& rng, int nslots, int tokens) {
  std::vector<int> perm(nslots);
  for (int i = 0; i < nslots; ++i) perm[i] = i;
  for (int i = nslots - 1; i > 0; --i) std::swap(perm[i], perm[rng.below(i + 1)]);
  int64_t* slots = static_cast<int64_t*>(aligned_alloc(16, (tokens * 8 + 15) / 16 * 16));
  for (int t = 0; t < tokens; ++t) slots[t] = t % 4 == 0 ? -1 : perm[t];
  if (tokens > 2) slots[1] = nslots - 1;
  return slots;
}

// store_kv: exact bytes; slot -1 skipped; everything else untouched.
void run_store(int dt, int kvh, int hd, int num_blocks, int bs, int tokens, int row_stride_heads, uint64_t seed) {
  ++g_cases;
  Rng rng{seed};
  const size_t row = size_t(kvh) * hd, cache_n = size_t(num_blocks) * bs * row;
  const size_t stride = size_t(row_stride_heads) * hd;  // elements between consecutive tokens' rows
  Buf kc(dt, cache_n), vc(dt, cache_n), key(dt, tokens * stride), val(dt, tokens * stride);
  for (size_t i = 0; i < cache_n; ++i) kc.set(i, rng.normal()), vc.set(i, rng.normal());
  for (size_t i = 0; i < key.n; ++i) key.set(i, rng.normal()), val.set(i, rng.normal());
  const size_t es = esize(dt);
  std::vector<char> ek(static_cast<char*>(kc.p), static_cast<char*>(kc.p) + cache_n * es);
  std::vector<char> ev(static_cast<char*>(vc.p), static_cast<char*>(vc.p) + cache_n * es);
  int64_t* slots = new_slots(rng, num_blocks * bs, tokens);
  for (int t = 0; t < tokens; ++t)
    if (slots[t] >= 0) {
      memcpy(ek.data() + slots[t] * row * es, static_cast<char*>(key.p) + t * stride * es, row * es);
      memcpy(ev.data() + slots[t] * row * es, static_cast<char*>(val.p) + t * stride * es, row * es);
    }
  const size_t err_before = emu::S.errors.size();
  const char* err = laneserve_store_kv(kc.p, vc.p, key.p, val.p, slots, tokens, int64_t(stride * es), int64_t(stride * es),
                                       int(row * es), nullptr);
  const bool same = !memcmp(ek.data(), kc.p, cache_n * es) && !memcmp(ev.data(), vc.p, cache_n * es);
  const bool pass = !err && same && emu::S.errors.size() == err_before;
  g_fail += !pass;
  const int row_bytes = int(row * es);
  printf("%s store_kv %-8s kv_heads=%d hd=%d row_bytes=%d threads=%d tokens=%d (every 4th slot -1) key_stride=%zu B%s\n",
         pass ? "PASS" : "FAIL", DTYPE_NAME[dt], kvh, hd, row_bytes,
         row_bytes / 16 < 256 ? (row_bytes / 16 + 31) / 32 * 32 : 256, tokens, stride * es, same ? "" : "  BYTES DIFFER");
  if (err) printf("     launcher error: %s\n", err);
  for (size_t i = err_before; i < emu::S.errors.size(); ++i) printf("     emulator: %s\n", emu::S.errors[i].c_str());
  fflush(stdout);
  free(slots);
}

// Every code of an 8-bit cache through the kernel: lanes of one token (weight 1), whose output is their V row
// exactly, float(code) * scale; the codes are V's rows, 64 per lane, NaN and inf included (scales not powers of
// two; fp8 subnormals times the scale well above 1, so a flushed or misplaced one shows).
void run_decode_all(int kv) {
  ++g_cases;
  const int lanes = 4, hd = 64, bs = 8;
  const float vscale = kv == E4M3 ? 1536.f : kv == E5M2 ? 196608.f : 1.5f;
  Codes kq(size_t(lanes) * bs, hd), vq(size_t(lanes) * bs, hd);
  memset(kq.codes, 0, size_t(lanes) * bs * hd), memset(vq.codes, 0, size_t(lanes) * bs * hd);
  for (int r = 0; r < lanes * bs; ++r) kq.scales[r] = 1.f, vq.scales[r] = vscale;
  int tables[lanes], lens[lanes];
  for (int b = 0; b < lanes; ++b) {  // lane b: block b, whose first token's V row holds codes 64b .. 64b + 63
    tables[b] = b, lens[b] = 1;
    for (int d = 0; d < hd; ++d) vq.codes[size_t(b) * bs * hd + d] = uint8_t(b * hd + d);
  }
  Buf q(0, size_t(lanes) * hd), out(0, size_t(lanes) * hd);
  for (size_t i = 0; i < q.n; ++i) q.set(i, 0.5f);
  PagedAttentionParams p{};
  p.out = out.p, p.query = q.p, p.k_cache = kq.codes, p.v_cache = vq.codes, p.k_scale = kq.scales, p.v_scale = vq.scales;
  p.block_tables = tables, p.context_lens = lens, p.cache_dtype = kv;
  p.num_seqs = lanes, p.num_heads = 1, p.num_kv_heads = 1, p.head_dim = hd, p.block_size = bs, p.max_blocks = 1;
  p.dtype = 0, p.q_stride_seq = hd, p.q_stride_head = hd, p.scale = 0.125f, p.num_splits = laneserve_attention_splits(bs);
  const size_t err_before = emu::S.errors.size();
  const char* err = laneserve_paged_attention(&p, nullptr);
  int bad = 0;
  for (int b = 0; b < lanes; ++b)
    for (int d = 0; d < hd; ++d) {
      const uint8_t c = uint8_t(b * hd + d);
      const float want = float(decode_ref(kv, c)) * vscale, got = static_cast<float*>(out.p)[b * hd + d];
      if (!(got == want || (std::isnan(got) && std::isnan(want)))) {
        if (bad++ < 5) printf("     code 0x%02x: got %.9g want %.9g\n", c, got, want);
      }
    }
  const bool pass = !err && !bad && emu::S.errors.size() == err_before;
  g_fail += !pass;
  printf("%s decode every code kv=%-8s (256 codes, V scale %g, exact)\n", pass ? "PASS" : "FAIL", KV_NAME[kv], vscale);
  if (err) printf("     launcher error: %s\n", err);
  for (size_t i = err_before; i < emu::S.errors.size(); ++i) printf("     emulator: %s\n", emu::S.errors[i].c_str());
  fflush(stdout);
}

// laneserve_store_kv_quantized: codes and scales exactly the contract's; slot -1 skipped; everything else untouched.
// Tokens 1 to 3 carry crafted rows: QMAX (so inv is 1 and x * inv is x) then the midpoints between neighbouring
// codes (ties, to even), and just above and below them; token 2's first K row is all zeros (amax 0).
void run_store_q(int dt, int kv, int kvh, int hd, int num_blocks, int bs, int tokens, int row_stride_heads, uint64_t seed) {
  ++g_cases;
  Rng rng{seed};
  const size_t nrows = size_t(num_blocks) * bs * kvh, stride = size_t(row_stride_heads) * hd;
  Codes kq(nrows, hd), vq(nrows, hd);
  for (size_t i = 0; i < nrows * hd; ++i) kq.codes[i] = uint8_t(rng.next()), vq.codes[i] = uint8_t(rng.next());
  for (size_t r = 0; r < nrows; ++r) kq.scales[r] = rng.normal(), vq.scales[r] = rng.normal();
  Buf key(dt, tokens * stride), val(dt, tokens * stride);
  std::vector<float> mids;
  for (int c = 0; c < (kv == INT8 ? 127 : kv == E4M3 ? 0x7e : 0x7b); ++c)
    mids.push_back(float((decode_ref(kv, uint8_t(c)) + decode_ref(kv, uint8_t(c + 1))) / 2));
  for (int t = 0; t < tokens; ++t)
    for (int h = 0; h < kvh; ++h)
      for (auto* b : {&key, &val}) {
        const float mag = float(std::exp(rng.normal()));
        for (int d = 0; d < hd; ++d) {
          float x = rng.normal() * mag;
          if (t >= 1 && t <= 3) {
            const float m = mids[(h * hd + d) % mids.size()];
            x = d == 0 ? QMAX[kv] : t == 1 ? m : std::nextafter(m, t == 2 ? INFINITY : 0.f);
            if (d % 2) x = -x;
          }
          if (t == 2 && h == 0 && b == &key) x = 0.f;
          b->set(t * stride + size_t(h) * hd + d, x);
        }
      }
  std::vector<uint8_t> ek(kq.codes, kq.codes + nrows * hd), ev(vq.codes, vq.codes + nrows * hd);
  std::vector<float> eks(kq.scales, kq.scales + nrows), evs(vq.scales, vq.scales + nrows), x(hd);
  int64_t* slots = new_slots(rng, num_blocks * bs, tokens);
  for (int t = 0; t < tokens; ++t)
    for (int h = 0; t % 4 && h < kvh; ++h) {
      const size_t row = size_t(slots[t]) * kvh + h;
      for (auto [b, codes, scales] : {std::tuple(&key, &ek, &eks), std::tuple(&val, &ev, &evs)}) {
        for (int d = 0; d < hd; ++d) x[d] = float(b->get(t * stride + size_t(h) * hd + d));
        (*scales)[row] = quantize_ref(kv, x.data(), hd, codes->data() + row * hd);
      }
    }
  const size_t es = esize(dt), err_before = emu::S.errors.size();
  const char* err = laneserve_store_kv_quantized(kq.codes, vq.codes, kq.scales, vq.scales, key.p, val.p, slots, tokens, kvh, hd,
                                                 int64_t(stride * es), int64_t(stride * es), dt, kv, nullptr);
  const bool same = !memcmp(ek.data(), kq.codes, nrows * hd) && !memcmp(ev.data(), vq.codes, nrows * hd) &&
                    !memcmp(eks.data(), kq.scales, nrows * 4) && !memcmp(evs.data(), vq.scales, nrows * 4);
  const bool pass = !err && same && emu::S.errors.size() == err_before;
  g_fail += !pass;
  printf("%s store_kv %-8s kv=%-8s kv_heads=%d hd=%d tokens=%d (every 4th slot -1; ties, zeros) key_stride=%zu B%s\n",
         pass ? "PASS" : "FAIL", DTYPE_NAME[dt], KV_NAME[kv], kvh, hd, tokens, stride * es, same ? "" : "  BYTES DIFFER");
  if (!same)
    for (size_t i = 0, shown = 0; i < nrows * hd && shown < 5; ++i)
      if (ek[i] != kq.codes[i]) printf("     K row %zu dim %zu: code 0x%02x want 0x%02x\n", i / hd, i % hd, kq.codes[i], ek[i]), ++shown;
  if (err) printf("     launcher error: %s\n", err);
  for (size_t i = err_before; i < emu::S.errors.size(); ++i) printf("     emulator: %s\n", emu::S.errors[i].c_str());
  fflush(stdout);
  free(slots);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "full";
  const auto t0 = std::chrono::steady_clock::now();
  uint64_t seed = 1;
  std::vector<AttnCase> cases;
  const std::pair<int, int> HEADS[] = {{4, 4}, {4, 2}, {9, 3}, {8, 2}, {8, 1}};  // GQA 1, 2, 3, 4, 8
  // Sliding windows (Gemma 3's local layers), in every mode: one split and several, windows shorter and longer than a
  // lane, a window start mid-block; and head_dim 256 (Gemma 3), which an fp32 cache does not take.
  for (int dt = 0; dt < 3; ++dt)
    for (int window : {5, 16, 600}) {
      AttnCase w{dt, 64, 8, 2, 16, {1, 5, 6, 17, 100, 700, 1500}, 2, 0, false, 2.0f, seed++, " window"};
      w.window = window;
      cases.push_back(w);
    }
  for (int dt = 0; dt < 3; ++dt) {
    AttnCase w{dt, 256, 4, 1, 16, {1, 17, 513, 700}, 2, 0, false, 2.0f, seed++, " head_dim 256, window 512"};
    w.window = 512;
    cases.push_back(w);
  }
  if (mode == "quick" || mode == "sched") {
    for (int dt = 0; dt < 3; ++dt)
      for (int hd : {64, 128})
        cases.push_back({dt, hd, 9, 3, 16, {1, 15, 16, 17, 513, 40}, 2, 0, false, 2.0f, seed++});
  } else {
    // Short lanes (one split): every dtype x head_dim x GQA x block size.
    for (int dt = 0; dt < 3; ++dt)
      for (int hd : {64, 128})
        for (auto [nh, kvh] : HEADS)
          for (int bs : {8, 16, 32})
            cases.push_back({dt, hd, nh, kvh, bs, {1, bs - 1, bs, bs + 1, 15, 16, 17, 100}, 2, 0, false, 2.0f, seed++});
    // Multi-split (several partitions, reduce kernel): every dtype x head_dim x GQA, block sizes cycled.
    int k = 0;
    for (int dt = 0; dt < 3; ++dt)
      for (int hd : {64, 128})
        for (auto [nh, kvh] : HEADS) {
          const int bs = (int[]){8, 16, 32}[k++ % 3];
          cases.push_back({dt, hd, nh, kvh, bs, {1, 17, 511, 512, 513, 1500, 4100}, 2, 0, false, 2.0f, seed++});
        }
    // Edge cases.
    for (int dt = 0; dt < 3; ++dt) {
      // empty (0) and negative lanes, single split and multi split; a length beyond the table (clamped)
      cases.push_back({dt, 64, 9, 3, 16, {40, 0, 1, -5}, 2, 0, false, 2.0f, seed++, " empty/negative lanes"});
      cases.push_back({dt, 128, 8, 2, 16, {700, 0, 1, -5, 1100}, 2, 0, false, 2.0f, seed++, " empty lanes, multi-split"});
      // fused-QKV query view: row stride 15 heads for 9 query heads; garbage in unused table entries
      cases.push_back({dt, 64, 9, 3, 16, {40, 700, 1, 16}, 2, 15, true, 2.0f, seed++, ""});
      // peaked softmax (large q) so the running max changes late and across splits
      cases.push_back({dt, 128, 4, 1, 32, {3000, 600}, 0, 0, false, 12.0f, seed++, " peaked q*12"});
      // wide table: 64 splits (MAX_SPLITS), split len > PARTITION and starting mid-block
      cases.push_back({dt, 64, 2, 1, 16, {40000, 5, 33000}, 1000, 0, false, 2.0f, seed++, " 64 splits"});
      // a length beyond the table's capacity (kernel clamps; reference clamps the same way)
      // GQA 6: two blocks per KV head, the second with only 2 of GMAX=4 heads
      cases.push_back({dt, 128, 12, 2, 16, {1, 33, 600}, 2, 0, false, 2.0f, seed++, " GQA 6"});
      AttnCase over{dt, 64, 4, 4, 8, {100, 5}, 0, 0, false, 2.0f, seed++, " len>capacity (clamped)"};
      over.overclaim = 200;  // context_lens[0] = 300, table covers 104 tokens
      cases.push_back(over);
    }
  }
  for (int kv = AUTO; kv <= INT8; ++kv)
    for (auto c : cases) {
      c.kv = kv;
      if (c.head_dim == 256 && c.dt == 0 && kv == AUTO) continue;  // refused: a float32 row spans two warps
      run_attention(c);
    }
  if (mode != "sched") {
    for (int kv = E4M3; kv <= INT8; ++kv) run_decode_all(kv);
    for (int dt = 0; dt < 3; ++dt) {
      run_store(dt, 8, 128, 9, 16, 20, 48, seed++);  // fused projection rows (stride 48 heads), 256 threads
      run_store(dt, 3, 64, 6, 16, 10, 3, seed++);    // contiguous rows, 32 threads for 24 (fp32: 48) vectors
      run_store(dt, 1, 64, 4, 8, 7, 1, seed++);      // tiny rows: 8 (fp32: 16) vectors
      run_store(dt, 16, 128, 3, 8, 9, 16, seed++);   // 512+ vectors: several per thread
      for (int kv = E4M3; kv <= INT8; ++kv) {
        run_store_q(dt, kv, 8, 128, 9, 16, 20, 48, seed++);  // fused projection rows: 8 warps for 16 rows
        run_store_q(dt, kv, 3, 64, 6, 16, 10, 3, seed++);    // 6 warps, one row each
        run_store_q(dt, kv, 1, 64, 4, 8, 7, 1, seed++);      // 2 warps: a K row and a V row
        run_store_q(dt, kv, 2, 80, 3, 8, 9, 2, seed++);      // head_dim not a multiple of 32
      }
    }
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  printf("\nsummary: %d cases, %d failed; blocks emulated %llu, fiber switches %llu, %.1fs; sched=%s\n", g_cases, g_fail,
         (unsigned long long)emu::S.blocks_run, (unsigned long long)emu::S.switches, secs,
         getenv("EMU_SCHED") ? getenv("EMU_SCHED") : "fwd");
  for (auto& [key, s] : g_stats) {
    const auto [kv, dt] = key;
    printf("  kv=%-8s %-8s elements %zu  max_abs_err %.3g  max_rel_err(|ref|>1e-3) %.3g  max_err(|ref|>=0.25) %.2f ulp of %s  (tolerance atol %g rtol %g)\n",
           KV_NAME[kv], DTYPE_NAME[dt], s.n, s.max_abs, s.max_rel, s.max_ulp, DTYPE_NAME[dt], TOL[dt].atol, TOL[dt].rtol);
  }
  printf("  shared memory section: %zu bytes\n", emu::shared_bytes());
  if (!emu::S.errors.empty()) printf("  emulator errors recorded: %zu\n", emu::S.errors.size());
  return g_fail || !emu::S.errors.empty() ? 1 : 0;
}
