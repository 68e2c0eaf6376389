// The number types of lite_tensor.h (which includes this), as torch's C++ API names them:
// Half, BFloat16 and the two float8 formats, each converting to and from float32 as
// torch's .to does (rounding to nearest even; the float8 formats' limits below).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace pagedlm_lite {

// float16 <-> float32, rounding to nearest even (as torch's .to and at::Half do): with
// F16C one instruction each way, else the same result in integer arithmetic.
inline float half_bits_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  if (exponent == 0x1f) {  // inf, nan
    return __builtin_bit_cast(float, sign | 0x7f800000u | (mantissa << 13));
  }
  if (exponent == 0) {  // zero and subnormals: mantissa * 2^-24, exact in float
    const float value = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -value : value;
  }
  return __builtin_bit_cast(float, sign | ((exponent + 112) << 23) | (mantissa << 13));
#endif
}

inline uint16_t float_to_half_bits(float f) {
#if defined(__F16C__)
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  const uint32_t bits = __builtin_bit_cast(uint32_t, f);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7e00 | static_cast<uint16_t>((magnitude >> 13) & 0x3ff);
  if (magnitude >= 0x477ff000u) return sign | 0x7c00;  // rounds to or beyond 65520: inf
  if (magnitude < 0x38800000u) {  // below 2^-14: a subnormal step is 2^-24
    // Rounds to nearest even in the current (default) rounding mode; exact below 2^-14.
    const float steps = std::nearbyint(__builtin_bit_cast(float, magnitude) * 16777216.0f);
    return sign | static_cast<uint16_t>(steps);
  }
  const uint32_t odd = (magnitude >> 13) & 1;
  return sign | static_cast<uint16_t>((magnitude - (112u << 23) + 0xfff + odd) >> 13);
#endif
}

struct Half {
  uint16_t x;
  struct from_bits_t {};
  static constexpr from_bits_t from_bits() { return {}; }
  Half() = default;
  constexpr Half(uint16_t bits, from_bits_t) : x(bits) {}
  Half(float f) : x(float_to_half_bits(f)) {}  // NOLINT: implicit, as at::Half's
  operator float() const { return half_bits_to_float(x); }
};

struct BFloat16 {
  uint16_t x;
  BFloat16() = default;
  // Rounds to nearest even; any nan becomes the quiet nan 0x7fc0 (as c10's conversion).
  BFloat16(float f) {  // NOLINT
    const uint32_t bits = __builtin_bit_cast(uint32_t, f);
    x = std::isnan(f) ? 0x7fc0 : static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
  }
  operator float() const { return __builtin_bit_cast(float, static_cast<uint32_t>(x) << 16); }
};

// A float8 with kMantissa mantissa bits and exponent bias kBias, from float32 by rounding
// to nearest even, as torch's conversions: e4m3fn has no infinity and saturates (anything
// from 448 up, inf included, is 448; nan is its nan 0x7f); e5m2 gives inf from 61440 up
// and nan 0x7f for nan.
template <int kMantissa, int kBias, bool kFn>
inline uint8_t float_to_fp8(float f) {
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  const float a = std::fabs(f);
  if (std::isnan(a)) return sign | 0x7f;
  if (kFn && a >= 448.f) return sign | 0x7e;
  if (!kFn && a >= 65536.f) return sign | 0x7c;
  const int min_exponent = 1 - kBias;  // of the smallest normal number
  int e;
  std::frexp(a, &e);  // a = m * 2^e with m in [0.5, 1)
  e -= 1;             // a = m * 2^e with m in [1, 2)
  if (a == 0.f || e < min_exponent) {
    // Subnormal: a multiple of 2^(min_exponent - kMantissa); the count is the bits (a
    // count of 2^kMantissa is the smallest normal number, whose bits it also is).
    const float steps = std::nearbyint(std::ldexp(a, kMantissa - min_exponent));
    return sign | static_cast<uint8_t>(steps);
  }
  // (m - 1) * 2^kMantissa, exact in float, rounded; a carry moves to the exponent.
  int q = static_cast<int>(std::nearbyint((std::ldexp(a, -e) - 1.f) * (1 << kMantissa)));
  if (q == (1 << kMantissa)) {
    q = 0;
    ++e;
  }
  return sign | static_cast<uint8_t>(((e + kBias) << kMantissa) | q);
}

// Float8 values widen exactly through float16: an e5m2 byte is a float16's top byte; an
// e4m3fn byte's sign moved to bit 15 and the rest to bits 7..14 is a float16 worth
// value / 256 (for normal and subnormal values alike), or a nan for its nan.
struct Float8_e5m2 {
  uint8_t x;
  Float8_e5m2() = default;
  Float8_e5m2(float f) : x(float_to_fp8<2, 15, false>(f)) {}  // NOLINT
  operator float() const { return half_bits_to_float(static_cast<uint16_t>(x) << 8); }
};
struct Float8_e4m3fn {
  uint8_t x;
  Float8_e4m3fn() = default;
  Float8_e4m3fn(float f) : x(float_to_fp8<3, 7, true>(f)) {}  // NOLINT
  operator float() const {
    if ((x & 0x7f) == 0x7f) return std::nanf("");
    const uint16_t h = static_cast<uint16_t>(((x & 0x80) << 8) | ((x & 0x7f) << 7));
    return half_bits_to_float(h) * 256.f;
  }
};

}  // namespace pagedlm_lite
