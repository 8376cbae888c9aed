// The part of c10's BFloat16 that the kernels use, for the harness's build without torch: the bits (`x`), the top
// half of a float32.
#pragma once
#include <cstdint>
#include <cstring>

namespace c10 {

struct BFloat16 {
  uint16_t x;
  BFloat16() = default;
  BFloat16(float f) {  // rounded to nearest, ties to even; NaN to a quiet NaN
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    x = f != f ? uint16_t{0x7FC0} : static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
  }
  operator float() const {
    const uint32_t bits = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
};

}  // namespace c10
