// The element types of qvpic's native kernels (rotate_halves.cpp, decoder_ops.cpp): values are computed in
// float32 and stored as the tensor's dtype; bfloat16 as raw bits, rounded as torch rounds.
#pragma once
#include <cstdint>
#include <cstring>

namespace qvpic {

struct Float32 {
  using T = float;
  static inline float load(float x) { return x; }
  static inline float store(float x) { return x; }
};

struct BFloat16 {  // as raw bits: the top half of a float32
  using T = uint16_t;
  static inline float load(uint16_t bits) {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  static inline uint16_t store(float f) {  // round to nearest even, NaN to quiet NaN: torch's own conversion
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
};

}  // namespace qvpic
