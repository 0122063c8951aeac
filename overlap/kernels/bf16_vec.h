// bf16 <-> f32 on 16 lanes (AVX-512F), for every kernel that widens or rounds bf16 itself.
//
// Widening is exact (a bf16 is the high half of an f32). Rounding is c10's float -> bf16 (to
// nearest even, NaN -> 0x7FC0), so a loop's vector body and its scalar tail (c10::BFloat16(v)
// or layer_ops' bf16_bits) give the same bits: a value never depends on where it fell.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace overlap {

// 16 consecutive bf16 (any 2-byte type holding bf16 bits) -> f32.
inline __m512 widen_bf16x16(const void* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// f32 -> bf16 bits, one per i32 lane (the low 16 bits).
inline __m512i bf16_bits_x16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

// f32 rounded to bf16 and back: what storing and reloading a bf16 gives.
inline __m512 round_bf16x16(__m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits_x16(v), 16)); }

}  // namespace overlap
#endif
