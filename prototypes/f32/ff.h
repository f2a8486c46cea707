// Float-float arithmetic on vectors of 16 float32 lanes: the building blocks of ff_rows.h.
//
// A float-float (ff) value is an unevaluated sum hi + lo of two float32 numbers, about 48 bits
// of significand (Dekker, 1971; Joldes, Muller & Popescu, 2017). Every operation here is plain
// IEEE float32 arithmetic, lane by lane, in a fixed order, so with -ffp-contract=off the bits
// depend on the data alone:
//
//     two_sum(a, b)       s + e == a + b exactly                 (Knuth: 6 operations)
//     fast_two_sum(a, b)  s + e == a + b exactly, |a| >= |b|      (Dekker: 3 operations)
//     two_prod(a, b)      p + e == a * b exactly                  (p = fl(a * b), e below)
//
// The one place the instruction set shows is e = fl(a * b - p) of two_prod. AVX2 and AVX-512
// compute it with a fused multiply-subtract; the portable path computes a * b exactly in
// float64 (24 + 24 bits fit in 53), subtracts p (exact: the difference fits in the product's
// bits) and rounds once to float32. Both round the same exact number once, to nearest even, so
// they give the same bits on every input, including when e is subnormal (where a split-based
// Dekker product would not). float64 appears only there, and only on the portable path.
//
// The vectors are GCC/Clang vector extensions of 16 lanes (64 bytes). The compiler splits them
// into its registers: one zmm with AVX-512, two ymm with AVX2, four xmm with SSE2. So the lane
// count, and with it every summation order, is 16 whatever the instruction set.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#define MASKLN_F32_X86 1
#endif

#define MASKLN_F32_INLINE inline __attribute__((always_inline))
// No function taking or returning F may stay out of line: a 64-byte vector is passed in a zmm
// register by AVX-512 code and in memory by other code, so an out-of-line call between the
// two targets (hidden by -Wno-psabi) reads garbage. Each ISA's kernel is one flattened function.

namespace maskln_f32 {

constexpr int kLanes = 16;
using F = float __attribute__((vector_size(64)));
using I = int32_t __attribute__((vector_size(64)));
using U = uint32_t __attribute__((vector_size(64)));
using D = double __attribute__((vector_size(128)));

MASKLN_F32_INLINE F splat(float v) { return F{} + v; }

// --- the exact error of a product, per instruction set ----------------------------------------

struct Portable {
  static MASKLN_F32_INLINE F product_error(F a, F b, F p) {
    const D exact = __builtin_convertvector(a, D) * __builtin_convertvector(b, D);
    return __builtin_convertvector(exact - __builtin_convertvector(p, D), F);
  }
};

#ifdef MASKLN_F32_X86
struct Avx2 {
  __attribute__((target("avx2,fma"))) static inline F product_error(F a, F b, F p) {
    __m256 x[2], y[2], z[2];
    std::memcpy(x, &a, sizeof a);
    std::memcpy(y, &b, sizeof b);
    std::memcpy(z, &p, sizeof p);
    x[0] = _mm256_fmsub_ps(x[0], y[0], z[0]);
    x[1] = _mm256_fmsub_ps(x[1], y[1], z[1]);
    F e;
    std::memcpy(&e, x, sizeof e);
    return e;
  }
};

struct Avx512 {
  __attribute__((target("avx512f"))) static inline F product_error(F a, F b, F p) {
    return (F)_mm512_fmsub_ps((__m512)a, (__m512)b, (__m512)p);
  }
};
#endif

// --- error-free transformations and float-float operations ------------------------------------

struct Ff {
  F hi, lo;
};

MASKLN_F32_INLINE void two_sum(F a, F b, F& s, F& e) {
  s = a + b;
  const F bb = s - a;
  e = (a - (s - bb)) + (b - bb);
}

MASKLN_F32_INLINE void fast_two_sum(F a, F b, F& s, F& e) {
  s = a + b;
  e = b - (s - a);
}

template <class Isa>
MASKLN_F32_INLINE void two_prod(F a, F b, F& p, F& e) {
  p = a * b;
  e = Isa::product_error(a, b, p);
}

MASKLN_F32_INLINE Ff normalized(F hi, F lo) {
  Ff r;
  fast_two_sum(hi, lo, r.hi, r.lo);
  return r;
}

// a + b, "sloppy" (Joldes et al., Algorithm 5): absolute error of a few u^2 (|a| + |b|), which
// is all a sum measured against its terms needs (u = 2^-24).
MASKLN_F32_INLINE Ff add(Ff a, Ff b) {
  F s, e;
  two_sum(a.hi, b.hi, s, e);
  return normalized(s, e + (a.lo + b.lo));
}

MASKLN_F32_INLINE Ff negate(Ff a) { return {-a.hi, -a.lo}; }

// a * b, error a few u^2 |a b|.
template <class Isa>
MASKLN_F32_INLINE Ff mul(Ff a, Ff b) {
  F p, e;
  two_prod<Isa>(a.hi, b.hi, p, e);
  return normalized(p, e + (a.hi * b.lo + a.lo * b.hi));
}

// a / b (b nonzero), one correction step: error a few u^2 |a / b|.
template <class Isa>
MASKLN_F32_INLINE Ff div(Ff a, Ff b) {
  const F q = a.hi / b.hi;
  F p, e;
  two_prod<Isa>(q, b.hi, p, e);
  // a - q b, exactly in its leading part: a.hi - p cancels (Sterbenz)
  const F r = (((a.hi - p) - e) + a.lo) - q * b.lo;
  return normalized(q, r / b.hi);
}

// --- per-lane helpers (the statistics of 16 rows at once; not in inner loops) ----------------

MASKLN_F32_INLINE F lane_sqrt(F v) {
  F r;
  for (int l = 0; l < kLanes; ++l) {
    r[l] = std::sqrt(v[l]);
  }
  return r;
}

MASKLN_F32_INLINE F select(I mask, F a, F b) {  // mask lanes -1: a, 0: b
  U ua, ub;
  std::memcpy(&ua, &a, sizeof a);
  std::memcpy(&ub, &b, sizeof b);
  const U m = (U)mask;
  const U r = (ua & m) | (ub & ~m);
  F out;
  std::memcpy(&out, &r, sizeof r);
  return out;
}

// 1 / sqrt(v) for v >= 2^-126 normal and finite (the caller rescues other rows): one Newton
// step from the correctly rounded 1 / sqrt(v.hi), its residual 1 - v r^2 computed exactly
// enough in ff (v r first, so that r^2 never overflows): relative error a few u^2.
template <class Isa>
MASKLN_F32_INLINE Ff rsqrt(Ff v) {
  const F r = splat(1.0f) / lane_sqrt(v.hi);
  F a, ae, b, be;
  two_prod<Isa>(v.hi, r, a, ae);  // v.hi r = a + ae, about sqrt(v)
  two_prod<Isa>(a, r, b, be);     // a r = b + be, about 1
  const F rest = be + (ae * r + (v.lo * r) * r);
  const F residual = (splat(1.0f) - b) - rest;  // 1 - v r^2: 1 - b is exact
  return normalized(r, (r * residual) * 0.5f);
}

// --- loads and stores of 16 elements as float32 ------------------------------------------------

MASKLN_F32_INLINE F load(const float* p) {
  F v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
MASKLN_F32_INLINE F load(const c10::BFloat16* p) {  // bfloat16: the upper half of a float
  uint16_t bits[kLanes];
  std::memcpy(bits, p, sizeof bits);
  U wide;
  for (int l = 0; l < kLanes; ++l) {
    wide[l] = static_cast<uint32_t>(bits[l]) << 16;
  }
  F v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}
MASKLN_F32_INLINE F load(const c10::Half* p) {
  F v;
  for (int l = 0; l < kLanes; ++l) {
    v[l] = static_cast<float>(p[l]);
  }
  return v;
}

MASKLN_F32_INLINE void store(float* p, F v) { std::memcpy(p, &v, sizeof v); }
template <typename T>
MASKLN_F32_INLINE void store(T* p, F v) {  // the half dtypes: rounded from float by c10
  for (int l = 0; l < kLanes; ++l) {
    p[l] = static_cast<T>(v[l]);
  }
}

// The first n (< 16) elements of p, the other lanes pad.
template <typename T>
MASKLN_F32_INLINE F load_partial(const T* p, int64_t n, float pad) {
  float buffer[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    buffer[l] = l < n ? static_cast<float>(p[l]) : pad;
  }
  return load(static_cast<const float*>(buffer));
}

template <typename T>
MASKLN_F32_INLINE void store_partial(T* p, int64_t n, F v) {
  for (int64_t l = 0; l < n; ++l) {
    p[l] = static_cast<T>(v[l]);
  }
}

// --- sums across lanes: 16 rows' lane sums folded into one vector, lane r = row r ------------
//
// The fixed order of every lane sum: lane l + lane (l + 8), then + 4, + 2, + 1, each an ff add.
// Folding 16 rows at once (a butterfly of two-source shuffles) costs what folding one row
// costs, so short rows pay for it once per 16 rows.

// From the concatenation (a, b): x takes the lanes whose index mod 2h is below h, y the rest.
template <int kHalf>
struct FoldMasks;
template <>
struct FoldMasks<8> {
  static constexpr I x = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  static constexpr I y = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
};
template <>
struct FoldMasks<4> {
  static constexpr I x = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  static constexpr I y = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
};
template <>
struct FoldMasks<2> {
  static constexpr I x = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  static constexpr I y = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
};
template <>
struct FoldMasks<1> {
  static constexpr I x = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  static constexpr I y = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
};

template <int kHalf>
MASKLN_F32_INLINE Ff fold_pair(const Ff& a, const Ff& b) {
  constexpr I mx = FoldMasks<kHalf>::x;
  constexpr I my = FoldMasks<kHalf>::y;
  const Ff x{__builtin_shuffle(a.hi, b.hi, mx), __builtin_shuffle(a.lo, b.lo, mx)};
  const Ff y{__builtin_shuffle(a.hi, b.hi, my), __builtin_shuffle(a.lo, b.lo, my)};
  return add(x, y);
}

// rows[r] holds row r's 16 lane sums; returns lane r = the sum of row r, in the order above.
MASKLN_F32_INLINE Ff fold_rows(const Ff (&rows)[kLanes]) {
  Ff level1[8], level2[4], level3[2];
  for (int i = 0; i < 8; ++i) {
    level1[i] = fold_pair<8>(rows[2 * i], rows[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    level2[i] = fold_pair<4>(level1[2 * i], level1[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    level3[i] = fold_pair<2>(level2[2 * i], level2[2 * i + 1]);
  }
  return fold_pair<1>(level3[0], level3[1]);
}

}  // namespace maskln_f32
