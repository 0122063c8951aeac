// exp for the kernels: the same bits whether the compiler vectorises the loop or not.
//
// std::exp is a libm call the compiler cannot vectorise (one call per score or activation:
// most of a prefill's attention and SwiGLU time), and a vectorised libm (libmvec) rounds
// differently from the scalar one, so a value would depend on whether it fell in a loop's
// vector body or its tail. This is plain float arithmetic (Cody-Waite reduction by ln 2, a
// degree-6 polynomial, the exponent set by integer bits); with -ffp-contract=off every lane
// and the scalar tail run the same operations in the same order. Within ~2 ulp of expf.
#pragma once

#include <cstdint>
#include <cstring>

namespace overlap {

inline float fixed_exp(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);  // 2^n stays a normal float
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693145751953125f;  // ln 2, high part (exact in float)
  r = r - n * 1.428606765330187e-06f;    // ln 2, low part
  float p = 1.3888889e-3f;
  p = p * r + 8.3333338e-3f;
  p = p * r + 4.1666668e-2f;
  p = p * r + 1.6666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace overlap
