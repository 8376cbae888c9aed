// The part of c10's Half that the kernels use, for the harness's build without torch: a float16's bits (`x`),
// their exact float32 value, and c10::detail::fp16_ieee_to_fp32_value (vec.h's conversion where F16C is off).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace c10 {
namespace detail {

inline float fp16_ieee_to_fp32_value(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exponent = (h >> 10) & 31, mantissa = h & 1023;
  uint32_t bits;
  if (exponent == 31) {
    bits = sign | 0x7F800000u | mantissa << 13;
  } else if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float32
    const float v = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -v : v;
  } else {
    bits = sign | (exponent + 112) << 23 | mantissa << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace detail

struct Half {
  uint16_t x;
  operator float() const { return detail::fp16_ieee_to_fp32_value(x); }
};

}  // namespace c10
