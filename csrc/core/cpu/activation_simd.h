// SIMD versions of the fp32 backward g(y, m) for the CPU kernels: one algorithm
// (grad_from_output_*, its loop in activation_simd_body.inc), written once over a small vector
// interface with two implementations, AVX-512 (16 lanes) and AVX2 + FMA (8 lanes), chosen at
// run time.
// The scalar act_grad_from_output<A>(float, bool) in activation_math.h stays the
// definition and the CUDA path: this is the same computation step for step (the same
// pieces, the same Horner order), and tests/cpp/core checks that every path agrees with it.
// Intrinsics because GCC does not if-convert the scalar code's piece selection, so the loop
// around it stays scalar (3x slower than PyTorch's backward); and the AVX-512 version looks
// the coefficients up with two-register permutes instead of gathers, which cost most of the
// AVX2 version's time.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TEMPO_HAVE_SIMD_KERNELS 1
// GCC 12's AVX-512 intrinsic headers trip -Wmaybe-uninitialized (their _mm512_undefined_*);
// -Wpsabi notes that the internal vector helpers pass __m512 by value (they are all inlined).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wpsabi"
#include <immintrin.h>

#include <array>
#include <cstdint>

#include "../math/activation_math.h"

namespace tempo::cpu_simd {

constexpr int kPieceSlots = 64;  // coefficient tables padded to 64 pieces for the permutes
static_assert(math::kActPieces <= kPieceSlots, "the AVX-512 lookup holds at most 64 pieces");

#define TEMPO_AVX2 __attribute__((target("avx2,fma")))
#define TEMPO_AVX512 __attribute__((target("avx512f,avx2,fma")))

// ---- AVX2: 8 lanes, masks as all-ones float lanes, coefficients by gather -------------------
struct Avx2 {
  using F = __m256;
  using I = __m256i;
  using M = __m256;
  static constexpr int kLanes = 8;
  TEMPO_AVX2 static F load(const float* p) { return _mm256_loadu_ps(p); }
  TEMPO_AVX2 static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  TEMPO_AVX2 static F set(float v) { return _mm256_set1_ps(v); }
  TEMPO_AVX2 static I seti(int v) { return _mm256_set1_epi32(v); }
  TEMPO_AVX2 static M lane_bits(const uint8_t* mask, int64_t group) {
    const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i b = _mm256_and_si256(_mm256_set1_epi32(mask[group]), sel);
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, sel));
  }
  TEMPO_AVX2 static F add(F a, F b) { return _mm256_add_ps(a, b); }
  TEMPO_AVX2 static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  TEMPO_AVX2 static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  TEMPO_AVX2 static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  TEMPO_AVX2 static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  TEMPO_AVX2 static F max(F a, F b) { return _mm256_max_ps(a, b); }  // b when a is NaN
  TEMPO_AVX2 static F min(F a, F b) { return _mm256_min_ps(a, b); }
  TEMPO_AVX2 static F abs(F a) { return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
  TEMPO_AVX2 static M ge(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_GE_OQ); }
  TEMPO_AVX2 static M gt(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
  TEMPO_AVX2 static M le(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_LE_OQ); }
  TEMPO_AVX2 static M igt(I a, I b) { return _mm256_castsi256_ps(_mm256_cmpgt_epi32(a, b)); }
  TEMPO_AVX2 static M mand(M a, M b) { return _mm256_and_ps(a, b); }
  TEMPO_AVX2 static M mor(M a, M b) { return _mm256_or_ps(a, b); }
  TEMPO_AVX2 static M mandnot(M a, M b) { return _mm256_andnot_ps(a, b); }  // ~a & b
  TEMPO_AVX2 static F select(M m, F if_true, F if_false) { return _mm256_blendv_ps(if_false, if_true, m); }
  TEMPO_AVX2 static I selecti(M m, I if_true, I if_false) {
    return _mm256_blendv_epi8(if_false, if_true, _mm256_castps_si256(m));
  }
  TEMPO_AVX2 static I cvtt(F a) { return _mm256_cvttps_epi32(a); }
  TEMPO_AVX2 static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  TEMPO_AVX2 static I iadd(I a, I b) { return _mm256_add_epi32(a, b); }
  TEMPO_AVX2 static I isub(I a, I b) { return _mm256_sub_epi32(a, b); }
  TEMPO_AVX2 static I iand(I a, I b) { return _mm256_and_si256(a, b); }
  TEMPO_AVX2 static I ior(I a, I b) { return _mm256_or_si256(a, b); }
  TEMPO_AVX2 static I srl23(I a) { return _mm256_srli_epi32(a, 23); }
  TEMPO_AVX2 static I as_int(F a) { return _mm256_castps_si256(a); }
  TEMPO_AVX2 static F as_float(I a) { return _mm256_castsi256_ps(a); }
  // Coefficient k of piece idx per lane, from the row-major table (pieces x (degree + 1)).
  struct Table {
    const float* coef;
  };
  template <Activation A>
  static Table table() {
    return Table{math::act_coef<A>()};
  }
  TEMPO_AVX2 static I piece_offset(I idx) { return _mm256_mullo_epi32(idx, _mm256_set1_epi32(math::kActDegree + 1)); }
  TEMPO_AVX2 static F coef(const Table& t, I offset, int k) { return _mm256_i32gather_ps(t.coef + k, offset, 4); }
};

// ---- AVX-512: 16 lanes, mask registers, coefficients by two-register permutes ---------------
struct Avx512 {
  using F = __m512;
  using I = __m512i;
  using M = __mmask16;
  static constexpr int kLanes = 16;
  TEMPO_AVX512 static F load(const float* p) { return _mm512_loadu_ps(p); }
  TEMPO_AVX512 static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  TEMPO_AVX512 static F set(float v) { return _mm512_set1_ps(v); }
  TEMPO_AVX512 static I seti(int v) { return _mm512_set1_epi32(v); }
  TEMPO_AVX512 static M lane_bits(const uint8_t* mask, int64_t group) {
    return static_cast<M>(mask[2 * group] | (mask[2 * group + 1] << 8));
  }
  TEMPO_AVX512 static F add(F a, F b) { return _mm512_add_ps(a, b); }
  TEMPO_AVX512 static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  TEMPO_AVX512 static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  TEMPO_AVX512 static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  TEMPO_AVX512 static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  TEMPO_AVX512 static F max(F a, F b) { return _mm512_max_ps(a, b); }  // b when a is NaN
  TEMPO_AVX512 static F min(F a, F b) { return _mm512_min_ps(a, b); }
  TEMPO_AVX512 static F abs(F a) { return _mm512_abs_ps(a); }
  TEMPO_AVX512 static M ge(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
  TEMPO_AVX512 static M gt(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  TEMPO_AVX512 static M le(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ); }
  TEMPO_AVX512 static M igt(I a, I b) { return _mm512_cmpgt_epi32_mask(a, b); }
  TEMPO_AVX512 static M mand(M a, M b) { return static_cast<M>(a & b); }
  TEMPO_AVX512 static M mor(M a, M b) { return static_cast<M>(a | b); }
  TEMPO_AVX512 static M mandnot(M a, M b) { return static_cast<M>(~a & b); }
  TEMPO_AVX512 static F select(M m, F if_true, F if_false) { return _mm512_mask_blend_ps(m, if_false, if_true); }
  TEMPO_AVX512 static I selecti(M m, I if_true, I if_false) { return _mm512_mask_blend_epi32(m, if_false, if_true); }
  TEMPO_AVX512 static I cvtt(F a) { return _mm512_cvttps_epi32(a); }
  TEMPO_AVX512 static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  TEMPO_AVX512 static I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
  TEMPO_AVX512 static I isub(I a, I b) { return _mm512_sub_epi32(a, b); }
  TEMPO_AVX512 static I iand(I a, I b) { return _mm512_and_si512(a, b); }
  TEMPO_AVX512 static I ior(I a, I b) { return _mm512_or_si512(a, b); }
  TEMPO_AVX512 static I srl23(I a) { return _mm512_srli_epi32(a, 23); }
  TEMPO_AVX512 static I as_int(F a) { return _mm512_castps_si512(a); }
  TEMPO_AVX512 static F as_float(I a) { return _mm512_castsi512_ps(a); }
  // Coefficient-major copy of the table: coefficient k of all 64 piece slots is contiguous.
  struct Table {
    const float* by_coef;
  };
  template <Activation A>
  static Table table() {
    static const std::array<float, (math::kActDegree + 1)* kPieceSlots> t = [] {
      std::array<float, (math::kActDegree + 1) * kPieceSlots> out{};
      const float* c = math::act_coef<A>();
      for (int p = 0; p < math::kActPieces; ++p)
        for (int k = 0; k <= math::kActDegree; ++k) out[k * kPieceSlots + p] = c[p * (math::kActDegree + 1) + k];
      return out;
    }();
    return Table{t.data()};
  }
  TEMPO_AVX512 static I piece_offset(I idx) { return idx; }
  TEMPO_AVX512 static F coef(const Table& t, I idx, int k) {
    const float* row = t.by_coef + k * kPieceSlots;
    const F lo = _mm512_permutex2var_ps(_mm512_loadu_ps(row), idx, _mm512_loadu_ps(row + 16));
    const F hi = _mm512_permutex2var_ps(_mm512_loadu_ps(row + 32), idx, _mm512_loadu_ps(row + 48));
    return _mm512_mask_blend_ps(_mm512_test_epi32_mask(idx, _mm512_set1_epi32(32)), lo, hi);
  }
};

#define TEMPO_SIMD_V Avx2
#define TEMPO_SIMD_TARGET TEMPO_AVX2
#define TEMPO_SIMD_NAME grad_from_output_avx2
#include "activation_simd_body.inc"
#undef TEMPO_SIMD_V
#undef TEMPO_SIMD_TARGET
#undef TEMPO_SIMD_NAME
#define TEMPO_SIMD_V Avx512
#define TEMPO_SIMD_TARGET TEMPO_AVX512
#define TEMPO_SIMD_NAME grad_from_output_avx512
#include "activation_simd_body.inc"
#undef TEMPO_SIMD_V
#undef TEMPO_SIMD_TARGET
#undef TEMPO_SIMD_NAME

enum class Isa { kScalar, kAvx2, kAvx512 };
inline Isa best_isa() {
  static const Isa isa = __builtin_cpu_supports("avx512f")                                   ? Isa::kAvx512
                         : (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) ? Isa::kAvx2
                                                                                             : Isa::kScalar;
  return isa;
}

#undef TEMPO_AVX2
#undef TEMPO_AVX512

}  // namespace tempo::cpu_simd
#pragma GCC diagnostic pop
#endif
