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
#if defined(__AVX2__)
#include <immintrin.h>
#endif

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

#if defined(__AVX512F__)
// fixed_exp on 16 lanes with explicit instructions, for loops the compiler leaves scalar:
// the same operations in the same order, so the same bits as the scalar function, lane by
// lane. The clamps keep the scalar's NaN behaviour: max/min return their second operand
// when either is NaN, so a NaN x passes through as it does through the comparisons above.
inline __m512 fixed_exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
  x = _mm512_min_ps(_mm512_set1_ps(88.0f), x);
  const __m512 n = _mm512_roundscale_ps(
      _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693145751953125f)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(1.428606765330187e-06f)));
  __m512 p = _mm512_set1_ps(1.3888889e-3f);
  for (const float c : {8.3333338e-3f, 4.1666668e-2f, 1.6666667e-1f, 0.5f, 1.0f, 1.0f})
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(c));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif

#if defined(__AVX2__)
// fixed_exp16 on 8 lanes (AVX2 + FMA builds, whose compiler flags forbid contraction, so
// mul then add as written): the same operations, the same bits, lane by lane.
inline __m256 fixed_exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
  x = _mm256_min_ps(_mm256_set1_ps(88.0f), x);
  const __m256 n = _mm256_round_ps(
      _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693145751953125f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(1.428606765330187e-06f)));
  __m256 p = _mm256_set1_ps(1.3888889e-3f);
  for (const float c : {8.3333338e-3f, 4.1666668e-2f, 1.6666667e-1f, 0.5f, 1.0f, 1.0f})
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

}  // namespace overlap
