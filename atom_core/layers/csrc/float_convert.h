// Float conversions every Atom CPU kernel shares (included through `load_extension`'s
// include path): widen any activation dtype to float, and narrow back with torch's
// rounding, branch-free so the loops using them vectorise; and the exp torch's kernels use.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <sleef.h>  // shipped with torch; libtorch_cpu exports the functions its vector kernels call

namespace atom {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return __builtin_bit_cast(float, static_cast<uint32_t>(x.x) << 16); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline T from_float(float f);
template <>
inline float from_float<float>(float f) { return f; }
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float f) {  // round to nearest even, as torch does
  const uint32_t bits = __builtin_bit_cast(uint32_t, f);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return c10::BFloat16(static_cast<uint16_t>(f != f ? 0x7FC0u : rounded), c10::BFloat16::from_bits());
}
template <>
inline c10::Half from_float<c10::Half>(float f) { return c10::Half(f); }

// exp over kLanes floats in place, with the function torch's vectorised CPU kernels call
// (Sleef's 1-ulp expf; its AVX2 and AVX-512 versions agree on every float).
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
inline void exp_lanes(float* v) { _mm512_storeu_ps(v, Sleef_expf16_u10(_mm512_loadu_ps(v))); }
#elif defined(__AVX2__)
constexpr int64_t kLanes = 8;
inline void exp_lanes(float* v) { _mm256_storeu_ps(v, Sleef_expf8_u10(_mm256_loadu_ps(v))); }
#else
constexpr int64_t kLanes = 0;
inline void exp_lanes(float*) {}
#endif

}  // namespace atom
