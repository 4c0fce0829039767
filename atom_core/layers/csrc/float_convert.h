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

#if defined(__AVX512F__) && defined(__AVX512BW__)
// from_float<c10::BFloat16> on 16 lanes (the same rounding and NaN, not vcvtneps2bf16's flush
// of denormals): the bfloat16 bits in each 32-bit lane's low half.
inline __m512i bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd), 16);
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

// from_float<T> of the lanes of v that `keep` names, stored at p (the others untouched).
inline void store_lanes(float* p, __m512 v, __mmask16 keep) { _mm512_mask_storeu_ps(p, keep, v); }
inline void store_lanes(c10::BFloat16* p, __m512 v, __mmask16 keep) {
  _mm512_mask_cvtepi32_storeu_epi16(p, keep, bf16_bits(v));
}
inline void store_lanes(c10::Half* p, __m512 v, __mmask16 keep) {  // as c10::Half(float) under F16C: vcvtps2ph
  _mm256_mask_storeu_epi16(p, keep, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

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
