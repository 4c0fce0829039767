// One float vector type and its few operations, for whichever instruction set the build
// targets (`atom_core.cpu_features.VARIANTS` sets the flags): AVX-512 (16 lanes, 32
// registers), AVX2 + FMA + F16C (8 lanes, 16 registers), or portable GCC/Clang vectors (8
// lanes) that compile on any target, aarch64 included. Kernels are written once against
// these; where an instruction set has something better (vdpbf16ps, vpdpwssd), the kernel
// says so under its own #if.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "float_convert.h"

namespace atom::simd {

#if defined(__AVX512F__)

constexpr int kLanes = 16;
constexpr int kRegisters = 32;
using vf = __m512;

inline vf zero() { return _mm512_setzero_ps(); }
inline vf set1(float v) { return _mm512_set1_ps(v); }
inline vf load(const float* p) { return _mm512_loadu_ps(p); }
inline vf load(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline vf load(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline void store(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf max(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf abs(vf a) { return _mm512_abs_ps(a); }
inline float reduce_add(vf v) { return _mm512_reduce_add_ps(v); }
inline float reduce_max(vf v) { return _mm512_reduce_max_ps(v); }
// kLanes pairs of bfloat16 (2 kLanes values): lane c gets its pair's first and second value.
inline void load_pairs(const c10::BFloat16* p, vf& first, vf& second) {
  const __m512i v = _mm512_loadu_si512(p);
  first = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  second = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}
// Bit i set where lane i compares so.
inline uint32_t mask_ge(vf v, vf t) { return _mm512_cmp_ps_mask(v, t, _CMP_GE_OQ); }
inline uint32_t mask_eq(vf v, vf t) { return _mm512_cmp_ps_mask(v, t, _CMP_EQ_OQ); }
inline uint32_t mask_nan(vf v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }
// The four horizontal sums of a, b, c, d into out[0..3].
inline void hsum4(vf a, vf b, vf c, vf d, float* out) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1)));
}

#elif defined(__AVX2__)

constexpr int kLanes = 8;
constexpr int kRegisters = 16;
using vf = __m256;

inline vf zero() { return _mm256_setzero_ps(); }
inline vf set1(float v) { return _mm256_set1_ps(v); }
inline vf load(const float* p) { return _mm256_loadu_ps(p); }
inline vf load(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline vf load(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void store(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf max(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf abs(vf a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), a); }
inline float reduce_add(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float reduce_max(vf v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline void load_pairs(const c10::BFloat16* p, vf& first, vf& second) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  first = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  second = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}
inline uint32_t mask_ge(vf v, vf t) { return _mm256_movemask_ps(_mm256_cmp_ps(v, t, _CMP_GE_OQ)); }
inline uint32_t mask_eq(vf v, vf t) { return _mm256_movemask_ps(_mm256_cmp_ps(v, t, _CMP_EQ_OQ)); }
inline uint32_t mask_nan(vf v) { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)); }
inline void hsum4(vf a, vf b, vf c, vf d, float* out) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
}

#else  // portable: the compiler's generic vectors

constexpr int kLanes = 8;
constexpr int kRegisters = 16;
typedef float vf __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(32)));

inline vf zero() { return vf{}; }
inline vf set1(float v) { return vf{} + v; }
inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <typename T>
inline vf load(const T* p) {
  vf v;
  for (int i = 0; i < kLanes; ++i) v[i] = to_float(p[i]);
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
inline vf fmadd(vf a, vf b, vf c) { return a * b + c; }
inline vf add(vf a, vf b) { return a + b; }
inline vf mul(vf a, vf b) { return a * b; }
inline vf max(vf a, vf b) {
  for (int i = 0; i < kLanes; ++i) a[i] = a[i] < b[i] ? b[i] : a[i];
  return a;
}
inline vf abs(vf a) { return (vf)((vu)a & 0x7FFFFFFFu); }
inline float reduce_add(vf v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}
inline float reduce_max(vf v) {
  float s = v[0];
  for (int i = 1; i < kLanes; ++i) s = s < v[i] ? v[i] : s;
  return s;
}
inline void load_pairs(const c10::BFloat16* p, vf& first, vf& second) {
  vu u;
  std::memcpy(&u, p, sizeof(u));
  first = (vf)(u << 16);
  second = (vf)(u & 0xFFFF0000u);
}
inline uint32_t mask_ge(vf v, vf t) {
  uint32_t m = 0;
  for (int i = 0; i < kLanes; ++i) m |= static_cast<uint32_t>(v[i] >= t[i]) << i;
  return m;
}
inline uint32_t mask_eq(vf v, vf t) {
  uint32_t m = 0;
  for (int i = 0; i < kLanes; ++i) m |= static_cast<uint32_t>(v[i] == t[i]) << i;
  return m;
}
inline uint32_t mask_nan(vf v) {
  uint32_t m = 0;
  for (int i = 0; i < kLanes; ++i) m |= static_cast<uint32_t>(v[i] != v[i]) << i;
  return m;
}
inline void hsum4(vf a, vf b, vf c, vf d, float* out) {
  out[0] = reduce_add(a);
  out[1] = reduce_add(b);
  out[2] = reduce_add(c);
  out[3] = reduce_add(d);
}

#endif

// How a weight stream (read once a step) is prefetched: non-temporally (NTA) on AMD's cores,
// which keep such lines out of the other caches, so that a decode step evicts less of what
// the interpreter and the small ops use; T2 elsewhere: Intel's server cores read a stream
// prefetched NTA at a third of the bandwidth of T0 or T2 (docs/performance.md, twenty-sixth
// session). ATOM_STREAM_PREFETCH=nta or t2 chooses either (set before the kernels load).
inline bool stream_nta_default() {
  if (const char* e = std::getenv("ATOM_STREAM_PREFETCH"); e && *e) return std::strcmp(e, "t2") != 0;
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  __cpuid(0, a, b, c, d);
  return b == 0x68747541u;  // "AuthenticAMD"
#else
  return true;
#endif
}
inline const bool stream_nta = stream_nta_default();

// Prefetch a line of a stream read once (see stream_nta).
inline void prefetch_stream(const void* p) {
  if (stream_nta) __builtin_prefetch(p, 0, 0);
  else __builtin_prefetch(p, 0, 1);
}
// Prefetch into L2 (read again soon).
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

}  // namespace atom::simd

// The variant's op namespace (ATOM_OPS_NS, set per build by cpp.py): one level of macro
// indirection, so the name is expanded before TORCH_LIBRARY pastes it.
#define ATOM_TORCH_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define ATOM_TORCH_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)
#define ATOM_STR2(x) #x
#define ATOM_STR(x) ATOM_STR2(x)
