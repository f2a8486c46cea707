// Masked layer and RMS normalization: the row kernels, forward and backward side by side, with
// the norm a template parameter (kCentered: LayerNorm subtracts the mean, RMSNorm does not).
//
// LayerNorm: for each valid row x of C channels (Ba et al., 2016), with the corrected two-pass
// variance (Chan, Golub & LeVeque, 1983), every statistic accumulated in float64:
//
//     mean  = sum(x) / C
//     xc    = x - mean
//     shift = sum(xc) / C                      (the rounding error of mean, about 0)
//     rstd  = 1 / sqrt(sum(xc * xc) / C - shift^2 + eps)
//     xhat  = (xc - shift) * rstd
//     y     = xhat * scale + bias
//
// and the backward pass, with wdy = dy * scale (names as in PyTorch's layer_norm_kernel.cpp):
//
//     dbias  = sum over valid rows of dy
//     dscale = sum over valid rows of dy * xhat
//     dx     = rstd * (wdy - xhat * c1 - c2),   c1 = mean_C(xhat * wdy),  c2 = mean_C(wdy)
//
// RMSNorm (Zhang & Sennrich, 2019), the same without the mean and the bias, and with an offset
// on the gain (Gemma's 1 + scale); wg = dy * (scale + offset):
//
//     rstd   = 1 / sqrt(sum(x * x) / C + eps)
//     xhat   = x * rstd
//     y      = xhat * (scale + offset)
//     dscale = sum over valid rows of dy * xhat
//     dx     = rstd * (wg - xhat * c1),   c1 = mean_C(xhat * wg)
//
// Invalid rows are written +0.0 (and their statistics 0) without reading them, so whatever they
// hold never reaches an output or a gradient. Rows whose arithmetic overflows (float64 |x| from
// about 1e154) or underflows (deviations of 1e-146 and less, with an eps as tiny), or whose
// saved rstd is too small to be exact, are redone by normalized_row: scaled by powers of two,
// as maskln_cli/functional.py does.
//
// mean is computed as sum * (1 / C): shift takes up its rounding. The statistics' second pass
// and the backward's second pass read rows from cache (rows go in L1-sized batches, see
// batch_rows). Tried and dropped: summing a batch's dscale and dbias terms in registers,
// column by column across its rows, instead of adding each row's to the block sums in L1 (no
// faster at C = 16, slower from C = 384).
//
// This header has no ATen, only loops over raw rows with GCC/Clang vector extensions (vectors
// of W float64, W chosen by the instruction set that kernels.cpp compiles them for). Sums run
// in kLanes lanes added in one fixed order, so with -ffp-contract=off the bits do not depend on
// W. Needs GCC or Clang (cpp_extension's compilers on Linux and macOS).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__GNUC__)
#define MASKLN_INLINE inline __attribute__((always_inline))
#define MASKLN_NOINLINE __attribute__((noinline))
#else
#define MASKLN_INLINE inline
#define MASKLN_NOINLINE
#endif

namespace maskln_native {

// The dtype of mean, rstd, scale and bias for x of dtype T: float for float and the half
// dtypes (computed with float64 statistics, returned in float), double for double.
template <typename T>
struct Compute {
  using type = float;
};
template <>
struct Compute<double> {
  using type = double;
};

MASKLN_INLINE double widen(float v) { return v; }
MASKLN_INLINE double widen(double v) { return v; }
MASKLN_INLINE double widen(c10::Half v) { return static_cast<float>(v); }
MASKLN_INLINE double widen(c10::BFloat16 v) { return static_cast<float>(v); }

template <typename T>
MASKLN_INLINE T narrow(double v) {
  // Half dtypes round through float, as the float32 composite rounds its result.
  return static_cast<T>(static_cast<float>(v));
}
template <>
MASKLN_INLINE double narrow<double>(double v) {
  return v;
}

// --- vectors of W float64: GCC and Clang vector extensions ----------------------------------
//
// Each instruction-set variant picks W (8 for AVX-512, 4 for AVX2, 2 for SSE2 and NEON), the
// width of its registers. The compiler lowers each operation lane by lane in IEEE arithmetic;
// sums always run in kLanes lanes (kLanes / W vectors) added up in one fixed order, so every
// variant computes the very same bits.

template <int W>
struct Vec;
template <>
struct Vec<8> {
  using d = double __attribute__((vector_size(64)));
  using f = float __attribute__((vector_size(32)));
  using u16 = uint16_t __attribute__((vector_size(16)));
  using u32 = uint32_t __attribute__((vector_size(32)));
};
template <>
struct Vec<4> {
  using d = double __attribute__((vector_size(32)));
  using f = float __attribute__((vector_size(16)));
  using u16 = uint16_t __attribute__((vector_size(8)));
  using u32 = uint32_t __attribute__((vector_size(16)));
};
template <>
struct Vec<2> {
  using d = double __attribute__((vector_size(16)));
  using f = float __attribute__((vector_size(8)));
  using u16 = uint16_t __attribute__((vector_size(4)));
  using u32 = uint32_t __attribute__((vector_size(8)));
};

template <int W, typename V = typename Vec<W>::d>
MASKLN_INLINE V load(const double* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <int W, typename V = typename Vec<W>::d>
MASKLN_INLINE V load(const float* p) {
  typename Vec<W>::f v;
  std::memcpy(&v, p, sizeof v);
  return __builtin_convertvector(v, V);
}
template <int W, typename V = typename Vec<W>::d>
MASKLN_INLINE V load(const c10::BFloat16* p) {  // bfloat16: the upper half of a float
  typename Vec<W>::u16 bits;
  std::memcpy(&bits, p, sizeof bits);
  const typename Vec<W>::u32 wide = __builtin_convertvector(bits, typename Vec<W>::u32) << 16;
  typename Vec<W>::f v;
  std::memcpy(&v, &wide, sizeof v);
  return __builtin_convertvector(v, V);
}
#if defined(__FLT16_MAX__)  // the compiler has _Float16 (GCC 12 and Clang on x86, ARM)
// F16C's vcvtph2ps where the target has it; elsewhere libgcc's exact conversions.
template <int W>
struct Half16;
template <>
struct Half16<8> {
  using h = _Float16 __attribute__((vector_size(16)));
};
template <>
struct Half16<4> {
  using h = _Float16 __attribute__((vector_size(8)));
};
template <>
struct Half16<2> {
  using h = _Float16 __attribute__((vector_size(4)));
};

template <int W, typename V = typename Vec<W>::d>
MASKLN_INLINE V load(const c10::Half* p) {
  typename Half16<W>::h h;
  std::memcpy(&h, p, sizeof h);
  return __builtin_convertvector(__builtin_convertvector(h, typename Vec<W>::f), V);
}
#else
template <int W, typename V = typename Vec<W>::d>
MASKLN_INLINE V load(const c10::Half* p) {
  float f[W];
  for (int k = 0; k < W; ++k) {
    f[k] = static_cast<float>(p[k]);
  }
  return load<W>(static_cast<const float*>(f));
}
#endif

template <int W, typename V>
MASKLN_INLINE void store(double* p, V v) {
  std::memcpy(p, &v, sizeof v);
}
template <int W, typename V>
MASKLN_INLINE void store(float* p, V v) {
  const auto f = __builtin_convertvector(v, typename Vec<W>::f);
  std::memcpy(p, &f, sizeof f);
}
template <int W, typename V, typename T>
MASKLN_INLINE void store(T* p, V v) {  // the half dtypes: through float, rounded by c10
  const auto f = __builtin_convertvector(v, typename Vec<W>::f);
  for (int k = 0; k < W; ++k) {
    p[k] = static_cast<T>(f[k]);
  }
}
template <int W, typename V>
MASKLN_INLINE void store(c10::BFloat16* p, V v) {  // float's upper half, rounded as c10 does
  using U = typename Vec<W>::u32;
  const auto f = __builtin_convertvector(v, typename Vec<W>::f);
  U bits;
  std::memcpy(&bits, &f, sizeof bits);
  U rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16;  // to nearest, ties to even
  rounded = (bits & 0x7FFFFFFF) > 0x7F800000 ? U{} + 0x7FC0 : rounded;  // NaN: c10's quiet NaN
  const auto half = __builtin_convertvector(rounded, typename Vec<W>::u16);
  std::memcpy(p, &half, sizeof half);
}
#if defined(__FLT16_MAX__)
template <int W, typename V>
MASKLN_INLINE void store(c10::Half* p, V v) {  // through float, rounded to nearest even
  using H = typename Half16<W>::h;
  const H h = __builtin_convertvector(__builtin_convertvector(v, typename Vec<W>::f), H);
  std::memcpy(p, &h, sizeof h);
}
#endif

constexpr int64_t kLanes = 16;  // lanes of every sum: two AVX-512 registers, four AVX2 ones
constexpr int64_t kRun = 64 * kLanes;  // elements per lane run before runs are added up

// K float64 sums of terms over j in [0, n). vector(j, sums) adds the terms of elements j to
// j + W - 1 into sums[0..K), scalar(j, sums) those of element j, for the last n % kLanes
// elements. Lane l sums the elements j = l (mod kLanes); after every kRun elements the lanes
// are added to a second set of lanes, so a lane never adds more than 64 terms plus n / kRun
// run totals (float32 statistics of 2**22-channel rows, and long float64 rows, stay within a
// few ulps). Lanes are then added in one fixed order: l + (l + 8), then + 4, + 2, + 1.
template <int W, int K, typename Vector, typename Scalar>
MASKLN_INLINE void accumulate(int64_t n, Vector vector, Scalar scalar, double (&totals)[K]) {
  using V = typename Vec<W>::d;
  constexpr int Q = kLanes / W;
  V outer[Q][K] = {};
  const int64_t whole = n - n % kLanes;
  int64_t j = 0;
  while (j < whole) {
    const int64_t stop = std::min(whole, j + kRun);
    V inner[Q][K] = {};
    for (; j < stop; j += kLanes) {
      for (int q = 0; q < Q; ++q) {
        vector(j + q * W, inner[q]);
      }
    }
    for (int q = 0; q < Q; ++q) {
      for (int k = 0; k < K; ++k) {
        outer[q][k] += inner[q][k];
      }
    }
  }
  double rest[K] = {};
  for (; j < n; ++j) {
    scalar(j, rest);
  }
  for (int k = 0; k < K; ++k) {
    double lanes[kLanes / 2];
    for (int q = 0; q < Q / 2; ++q) {
      const V half = outer[q][k] + outer[q + Q / 2][k];  // lanes l + (l + 8)
      std::memcpy(lanes + q * W, &half, sizeof half);
    }
    const double a0 = lanes[0] + lanes[4], a1 = lanes[1] + lanes[5];
    const double a2 = lanes[2] + lanes[6], a3 = lanes[3] + lanes[7];
    totals[k] = ((a0 + a2) + (a1 + a3)) + rest[k];
  }
}

// Rows per batch: the statistics of a batch's rows are computed pass by pass across its rows,
// so that the divisions, square roots and lane sums of several rows are in flight together
// (one row at a time, their latency dominated rows of 16 channels); a batch stays in L1.
constexpr int64_t kBatchBytes = 16 << 10;
constexpr int64_t kMaxBatch = 32;

MASKLN_INLINE int64_t batch_rows(int64_t row_bytes) {
  return std::clamp<int64_t>(kBatchBytes / std::max<int64_t>(1, row_bytes), 1, kMaxBatch);
}

// --- the rescue: one row, scaled by powers of two (maskln_cli/functional.py) ---------------

constexpr int kExponentLimit = 960;  // scalings stay within 2**+-960: finite factors

// Above this rstd, var + eps is below DBL_MIN / DBL_EPSILON (about 1e-292): the squares of the
// deviations (float64 rows of 1e-146 and less, with an eps as small) were subnormal numbers,
// or close to them, and lost precision. float32 statistics never get here (eps > 2**-150).
constexpr double kLargestExactRstd = 1e146;

// e with magnitude * 2**-e in [1/2, 1); -inf (as kExponentLimit below) for 0; 0 for NaN, inf.
inline int row_exponent(double magnitude) {
  if (!std::isfinite(magnitude)) {
    return 0;
  }
  if (magnitude == 0.0) {
    return -kExponentLimit;
  }
  int exponent = 0;
  std::frexp(magnitude, &exponent);
  return std::clamp(exponent, -kExponentLimit, kExponentLimit);
}

inline double max_magnitude(const double* row, int64_t n) {
  double largest = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    const double magnitude = std::fabs(row[j]);
    if (!(magnitude <= largest)) {  // NaN wins, so that the row's exponent becomes 0
      largest = magnitude;
      if (std::isnan(magnitude)) {
        break;
      }
    }
  }
  return largest;
}

inline double plain_sum(const double* row, int64_t n) {
  double total[1];
  accumulate<2>(
      n, [&](int64_t j, Vec<2>::d* s) { s[0] += load<2>(row + j); },
      [&](int64_t j, double* s) { s[0] += row[j]; }, total);
  return total[0];
}

// In place: row (x of one valid row, in float64) becomes xhat. Returns rs and exponent with
// rstd = rs * 2**-exponent, and the row's mean, as normalized_rows and row_means compute them:
//
//     xs = x * 2**-e1;  xc = xs - mean(xs) - mean(xs - mean(xs));  d = xc * 2**-e2
//     rs = 1 / sqrt(mean(d * d) + eps * 4**-(e1 + e2));  xhat = d * rs
//
// Uncentered (RMSNorm), xc = xs and the mean is 0. Scaling by powers of two rounds nothing; NaN
// or inf in the row makes it NaN, as the formula.
struct Rescued {
  double rs;
  int exponent;
  double mean;
};

MASKLN_NOINLINE inline Rescued normalized_row(double* row, int64_t n, double eps, bool centered) {
  const int e1 = row_exponent(max_magnitude(row, n));
  for (int64_t j = 0; j < n; ++j) {
    row[j] = std::ldexp(row[j], -e1);
  }
  double scaled_mean = 0.0;
  if (centered) {
    scaled_mean = plain_sum(row, n) / static_cast<double>(n);
    for (int64_t j = 0; j < n; ++j) {
      row[j] -= scaled_mean;
    }
    const double shift = plain_sum(row, n) / static_cast<double>(n);
    for (int64_t j = 0; j < n; ++j) {
      row[j] -= shift;
    }
  }
  // Deviations scaled to below 1, never below sqrt(eps)'s exponent, where eps dominates.
  int eps_exponent = 0;
  std::frexp(eps, &eps_exponent);
  eps_exponent = (eps_exponent + (eps_exponent > 0 ? 1 : 0)) / 2;  // ceil(e / 2)
  const int e2 = std::clamp(
      std::max(row_exponent(max_magnitude(row, n)), eps_exponent - e1), -kExponentLimit,
      kExponentLimit);
  double squares[1];
  for (int64_t j = 0; j < n; ++j) {
    row[j] = std::ldexp(row[j], -e2);
  }
  accumulate<2>(
      n,
      [&](int64_t j, Vec<2>::d* s) {
        const Vec<2>::d d = load<2>(row + j);
        s[0] += d * d;
      },
      [&](int64_t j, double* s) { s[0] += row[j] * row[j]; }, squares);
  const int exponent = e1 + e2;
  const double scaled_eps = std::ldexp(eps, -2 * exponent);
  const double variance = squares[0] / static_cast<double>(n) + scaled_eps;
  const double rs = 1.0 / std::sqrt(std::max(variance, std::numeric_limits<double>::min()));
  for (int64_t j = 0; j < n; ++j) {
    row[j] *= rs;
  }
  return {rs, exponent, std::ldexp(scaled_mean, e1)};
}

// --- forward --------------------------------------------------------------------------------

template <typename T>
struct ForwardArgs {
  using P = typename Compute<T>::type;
  const T* x;         // [rows, C], contiguous
  const bool* valid;  // [rows]
  const P* scale;     // [C]
  const P* bias;      // [C]; null for RMSNorm
  T* y;               // [rows, C], contiguous
  P* mean;            // [rows], or null when the statistics are not kept (always for RMSNorm)
  P* rstd;            // [rows], or null when the statistics are not kept
  int64_t C;
  double eps;
  double offset;      // RMSNorm's gain is scale + offset
};

template <typename T, bool kCentered>
MASKLN_NOINLINE void forward_row_rescued(const ForwardArgs<T>& a, int64_t i) {
  using P = typename ForwardArgs<T>::P;
  const int64_t C = a.C;
  std::vector<double> row(C);
  const T* x = a.x + i * C;
  for (int64_t j = 0; j < C; ++j) {
    row[j] = widen(x[j]);
  }
  const Rescued r = normalized_row(row.data(), C, a.eps, kCentered);
  T* y = a.y + i * C;
  for (int64_t j = 0; j < C; ++j) {
    if constexpr (kCentered) {
      y[j] = narrow<T>(row[j] * widen(a.scale[j]) + widen(a.bias[j]));
    } else {
      y[j] = narrow<T>(row[j] * (widen(a.scale[j]) + a.offset));
    }
  }
  if (a.rstd != nullptr) {
    if constexpr (kCentered) {
      a.mean[i] = static_cast<P>(r.mean);
    }
    a.rstd[i] = static_cast<P>(std::ldexp(r.rs, -r.exponent));
  }
}

// RMSNorm's batch of count rows from row first: a pass for each row's sum of squares, then one
// writing y (from cache). sums[r][1] and rstd[r] are the forward_rows' statistics of row r.
template <typename T, int W, int64_t kC>
MASKLN_INLINE void forward_rows_rms(const ForwardArgs<T>& a, int64_t first, int64_t count,
                                    double inverse, double (*sums)[2], double* rstd) {
  using P = typename ForwardArgs<T>::P;
  using V = typename Vec<W>::d;
  const int64_t C = kC != 0 ? kC : a.C;
  const P* scale = a.scale;
  const double offset = a.offset;
  for (int64_t r = 0; r < count; ++r) {
    const T* x = a.x + (first + r) * C;
    double squares[1] = {0.0};
    if (a.valid[first + r]) {
      accumulate<W>(
          C,
          [&](int64_t j, V* s) {
            const V v = load<W>(x + j);
            s[0] += v * v;
          },
          [&](int64_t j, double* s) {
            const double v = widen(x[j]);
            s[0] += v * v;
          },
          squares);
    }
    sums[r][0] = 0.0;
    sums[r][1] = squares[0];
  }
  for (int64_t r = 0; r < count; ++r) {
    rstd[r] = 1.0 / std::sqrt(sums[r][1] * inverse + a.eps);
  }
  for (int64_t r = 0; r < count; ++r) {
    const int64_t i = first + r;
    T* y = a.y + i * C;
    if (!a.valid[i]) {  // +0.0 is all-zero bits in every dtype
      std::memset(static_cast<void*>(y), 0, sizeof(T) * C);
      if (a.rstd != nullptr) {
        a.rstd[i] = P(0);
      }
      continue;
    }
    // Non-finite: the row holds NaN or inf, or (float64) its squares overflowed; or (float64)
    // its squares underflowed.
    if (!std::isfinite(sums[r][1]) || rstd[r] > kLargestExactRstd) {
      forward_row_rescued<T, false>(a, i);
      continue;
    }
    const T* x = a.x + i * C;
    const double rs = rstd[r];
    int64_t j = 0;
    for (; j + W <= C; j += W) {
      store<W>(y + j, (load<W>(x + j) * rs) * (load<W>(scale + j) + offset));
    }
    for (; j < C; ++j) {
      y[j] = narrow<T>((widen(x[j]) * rs) * (widen(scale[j]) + offset));
    }
    if (a.rstd != nullptr) {
      a.rstd[i] = static_cast<P>(rs);
    }
  }
}

// Rows [begin, end), a batch of rows at a time: each row is read twice for its statistics (the
// second time from cache) and once more to write y; RMSNorm's, once for its sum of squares.
// kC: the row length when the caller knows it at compile time (0: a.C, read at run time). The
// loops over a row then unroll, which short rows need (C = 16: their loops' overhead cost as
// much as their arithmetic); the bits are the same either way.
template <typename T, int W, bool kCentered, int64_t kC = 0>
MASKLN_INLINE void forward_rows(const ForwardArgs<T>& a, int64_t begin, int64_t end) {
  using P = typename ForwardArgs<T>::P;
  using V = typename Vec<W>::d;
  const int64_t C = kC != 0 ? kC : a.C;
  const double inverse = 1.0 / static_cast<double>(C);
  const P* scale = a.scale;
  const P* bias = a.bias;
  const int64_t batch = batch_rows(C * static_cast<int64_t>(sizeof(T)));
  double mean[kMaxBatch], shift[kMaxBatch], rstd[kMaxBatch];
  double centered[kMaxBatch][2];  // sum(xc), sum(xc * xc); RMSNorm: 0, sum(x * x)
  for (int64_t first = begin; first < end; first += batch) {
    const int64_t count = std::min(batch, end - first);
    if constexpr (!kCentered) {
      forward_rows_rms<T, W, kC>(a, first, count, inverse, centered, rstd);
      continue;
    }
    for (int64_t r = 0; r < count; ++r) {
      const T* x = a.x + (first + r) * C;
      double sum[1] = {0.0};
      if (a.valid[first + r]) {
        accumulate<W>(
            C, [&](int64_t j, V* s) { s[0] += load<W>(x + j); },
            [&](int64_t j, double* s) { s[0] += widen(x[j]); }, sum);
      }
      mean[r] = sum[0] * inverse;
    }
    for (int64_t r = 0; r < count; ++r) {
      const T* x = a.x + (first + r) * C;
      const double m = mean[r];
      centered[r][0] = centered[r][1] = 0.0;
      if (a.valid[first + r]) {
        accumulate<W>(
            C,
            [&](int64_t j, V* s) {
              const V xc = load<W>(x + j) - m;
              s[0] += xc;
              s[1] += xc * xc;
            },
            [&](int64_t j, double* s) {
              const double xc = widen(x[j]) - m;
              s[0] += xc;
              s[1] += xc * xc;
            },
            centered[r]);
      }
    }
    for (int64_t r = 0; r < count; ++r) {
      shift[r] = centered[r][0] * inverse;
      const double variance = std::max(centered[r][1] * inverse - shift[r] * shift[r], 0.0);
      rstd[r] = 1.0 / std::sqrt(variance + a.eps);
    }
    for (int64_t r = 0; r < count; ++r) {
      const int64_t i = first + r;
      T* y = a.y + i * C;
      if (!a.valid[i]) {  // +0.0 is all-zero bits in every dtype
        std::memset(static_cast<void*>(y), 0, sizeof(T) * C);
        if (a.mean != nullptr) {
          a.mean[i] = P(0);
          a.rstd[i] = P(0);
        }
        continue;
      }
      // Non-finite: the row holds NaN or inf, or (float64) its sum or squares overflowed; or
      // (float64) its squares underflowed.
      if (!std::isfinite(centered[r][0]) || !std::isfinite(centered[r][1]) ||
          rstd[r] > kLargestExactRstd) {
        forward_row_rescued<T, true>(a, i);
        continue;
      }
      const T* x = a.x + i * C;
      const double m = mean[r], s = shift[r], rs = rstd[r];
      int64_t j = 0;
      for (; j + W <= C; j += W) {
        const V xhat = ((load<W>(x + j) - m) - s) * rs;
        store<W>(y + j, xhat * load<W>(scale + j) + load<W>(bias + j));
      }
      for (; j < C; ++j) {
        const double xhat = ((widen(x[j]) - m) - s) * rs;
        y[j] = narrow<T>(xhat * widen(scale[j]) + widen(bias[j]));
      }
      if (a.mean != nullptr) {
        a.mean[i] = static_cast<P>(m);
        a.rstd[i] = static_cast<P>(rs);
      }
    }
  }
}

// --- backward -------------------------------------------------------------------------------

template <typename T>
struct BackwardArgs {
  using P = typename Compute<T>::type;
  const T* dy;        // [rows, C], contiguous
  const T* x;         // [rows, C], contiguous
  const bool* valid;  // [rows]
  const P* scale;     // [C]
  const P* mean;      // [rows], as the forward saved it; null for RMSNorm
  const P* rstd;      // [rows], likewise
  T* dx;              // [rows, C], or null when not needed
  int64_t C;
  double eps;
  double offset;      // RMSNorm's gain is scale + offset
};

// Below this an rstd is subnormal, or nearly: it has lost precision (|x| near the limit).
template <typename P>
constexpr double smallest_exact_rstd() {
  return static_cast<double>(std::numeric_limits<P>::min()) /
      static_cast<double>(std::numeric_limits<P>::epsilon());
}

// dx, and the dscale and dbias terms, of one valid row from statistics recomputed by
// normalized_row (its saved rstd is too small to be exact, or its x - mean overflowed).
// RMSNorm: no mean, c2 = 0, no dbias; wdy = dy * (scale + offset).
template <typename T, bool kCentered>
MASKLN_NOINLINE void backward_row_rescued(
    const BackwardArgs<T>& a, int64_t i, double* dscale, double* dbias) {
  const int64_t C = a.C;
  const double channels = static_cast<double>(C);
  const T* x = a.x + i * C;
  const T* dy = a.dy + i * C;
  std::vector<double> xhat(C);
  for (int64_t j = 0; j < C; ++j) {
    xhat[j] = widen(x[j]);
  }
  const Rescued r = normalized_row(xhat.data(), C, a.eps, kCentered);
  const auto weighted = [&](int64_t j) {
    if constexpr (kCentered) {
      return widen(dy[j]) * widen(a.scale[j]);
    } else {
      return widen(dy[j]) * (widen(a.scale[j]) + a.offset);
    }
  };
  double c1 = 0.0, c2 = 0.0;  // mean_C(xhat * wdy), mean_C(wdy)
  for (int64_t j = 0; j < C; ++j) {
    const double wdy = weighted(j);
    c1 += xhat[j] * wdy;
    c2 += wdy;
  }
  c1 /= channels;
  c2 = kCentered ? c2 / channels : 0.0;
  if (a.dx != nullptr) {
    T* dx = a.dx + i * C;
    for (int64_t j = 0; j < C; ++j) {
      const double wdy = weighted(j);
      // rstd = rs * 2**-exponent, applied last so that tiny results round once
      dx[j] = narrow<T>(std::ldexp(((wdy - xhat[j] * c1) - c2) * r.rs, -r.exponent));
    }
  }
  if (dscale != nullptr) {
    for (int64_t j = 0; j < C; ++j) {
      const double g = widen(dy[j]);
      dscale[j] += g * xhat[j];
      if constexpr (kCentered) {
        dbias[j] += g;
      }
    }
  }
}

// RMSNorm's backward of count rows from row first (see backward_rows): a pass for each row's
// c1 = mean_C(xhat * wg), then one for dx and the dscale terms (from cache).
template <typename T, int W, bool kDx, bool kSums, int64_t kC>
MASKLN_INLINE void backward_rows_rms(const BackwardArgs<T>& a, int64_t first, int64_t count,
                                     double inverse, double (*sums)[3], double* dscale) {
  using P = typename BackwardArgs<T>::P;
  using V = typename Vec<W>::d;
  const int64_t C = kC != 0 ? kC : a.C;
  const P* scale = a.scale;
  const double offset = a.offset;
  for (int64_t r = 0; r < count; ++r) {
    const int64_t i = first + r;
    sums[r][0] = 0.0;
    if (!a.valid[i]) {
      continue;
    }
    const T* x = a.x + i * C;
    const T* dy = a.dy + i * C;
    const double rstd = widen(a.rstd[i]);
    double terms[1];  // sum(xhat * wg)
    accumulate<W>(
        C,
        [&](int64_t j, V* s) {
          const V wg = load<W>(dy + j) * (load<W>(scale + j) + offset);
          s[0] += (load<W>(x + j) * rstd) * wg;
        },
        [&](int64_t j, double* s) {
          const double wg = widen(dy[j]) * (widen(scale[j]) + offset);
          s[0] += (widen(x[j]) * rstd) * wg;
        },
        terms);
    sums[r][0] = terms[0];
  }
  for (int64_t r = 0; r < count; ++r) {
    const int64_t i = first + r;
    T* dx = kDx ? a.dx + i * C : nullptr;
    if (!a.valid[i]) {  // outputs of invalid rows are constants: dx +0.0, no parameter terms
      if (kDx) {
        std::memset(static_cast<void*>(dx), 0, sizeof(T) * C);
      }
      continue;
    }
    const double rstd = widen(a.rstd[i]);
    if (!(rstd >= smallest_exact_rstd<P>())) {  // NaN too: the forward's rescued rows
      backward_row_rescued<T, false>(a, i, kSums ? dscale : nullptr, nullptr);
      continue;
    }
    const double c1 = sums[r][0] * inverse;
    const T* x = a.x + i * C;
    const T* dy = a.dy + i * C;
    int64_t j = 0;
    for (; j + W <= C; j += W) {
      const V g = load<W>(dy + j);
      const V xhat = load<W>(x + j) * rstd;
      if (kDx) {
        store<W>(dx + j, (g * (load<W>(scale + j) + offset) - xhat * c1) * rstd);
      }
      if (kSums) {
        store<W>(dscale + j, load<W>(dscale + j) + g * xhat);
      }
    }
    for (; j < C; ++j) {
      const double g = widen(dy[j]);
      const double xhat = widen(x[j]) * rstd;
      if (kDx) {
        dx[j] = narrow<T>((g * (widen(scale[j]) + offset) - xhat * c1) * rstd);
      }
      if (kSums) {
        dscale[j] += g * xhat;
      }
    }
  }
}

// Rows [begin, end) of the backward pass, a batch of rows at a time: dx (when kDx), and with
// kSums the rows' dscale and dbias terms added to dscale and dbias [C] (the caller's float64
// block sums; RMSNorm has no dbias). Each row is read twice (the second time from cache): for
// shift, c1 and c2, then for xhat, dx and the terms.
template <typename T, int W, bool kCentered, bool kDx, bool kSums, int64_t kC = 0>
MASKLN_INLINE void backward_rows(
    const BackwardArgs<T>& a, int64_t begin, int64_t end, double* dscale, double* dbias) {
  using P = typename BackwardArgs<T>::P;
  using V = typename Vec<W>::d;
  const int64_t C = kC != 0 ? kC : a.C;  // as forward_rows
  const double inverse = 1.0 / static_cast<double>(C);
  const P* scale = a.scale;
  const int64_t batch = batch_rows(2 * C * static_cast<int64_t>(sizeof(T)));
  double sums[kMaxBatch][3];  // sum(xc), sum(wdy), sum(xc * rstd * wdy)
  for (int64_t first = begin; first < end; first += batch) {
    const int64_t count = std::min(batch, end - first);
    if constexpr (!kCentered) {
      backward_rows_rms<T, W, kDx, kSums, kC>(a, first, count, inverse, sums, dscale);
      continue;
    }
    for (int64_t r = 0; r < count; ++r) {
      const int64_t i = first + r;
      sums[r][0] = sums[r][1] = sums[r][2] = 0.0;
      if (!a.valid[i]) {
        continue;
      }
      const T* x = a.x + i * C;
      const T* dy = a.dy + i * C;
      const double mean = widen(a.mean[i]);
      const double rstd = widen(a.rstd[i]);
      // xc * rstd first: rows of large values, whose xhat is moderate, do not overflow.
      accumulate<W>(
          C,
          [&](int64_t j, V* s) {
            const V xc = load<W>(x + j) - mean;
            const V wdy = load<W>(dy + j) * load<W>(scale + j);
            s[0] += xc;
            s[1] += wdy;
            s[2] += (xc * rstd) * wdy;
          },
          [&](int64_t j, double* s) {
            const double xc = widen(x[j]) - mean;
            const double wdy = widen(dy[j]) * widen(scale[j]);
            s[0] += xc;
            s[1] += wdy;
            s[2] += (xc * rstd) * wdy;
          },
          sums[r]);
    }
    for (int64_t r = 0; r < count; ++r) {
      const int64_t i = first + r;
      T* dx = kDx ? a.dx + i * C : nullptr;
      if (!a.valid[i]) {  // outputs of invalid rows are constants: dx +0.0, no parameter terms
        if (kDx) {
          std::memset(static_cast<void*>(dx), 0, sizeof(T) * C);
        }
        continue;
      }
      const double mean = widen(a.mean[i]);
      const double rstd = widen(a.rstd[i]);
      const double shift = sums[r][0] * inverse;
      if (!(rstd >= smallest_exact_rstd<P>()) || !std::isfinite(shift)) {
        backward_row_rescued<T, true>(a, i, kSums ? dscale : nullptr, dbias);
        continue;
      }
      const double c2 = sums[r][1] * inverse;
      const double c1 = sums[r][2] * inverse - shift * rstd * c2;  // mean_C(xhat * wdy)
      const T* x = a.x + i * C;
      const T* dy = a.dy + i * C;
      int64_t j = 0;
      for (; j + W <= C; j += W) {
        const V g = load<W>(dy + j);
        const V xhat = ((load<W>(x + j) - mean) - shift) * rstd;
        if (kDx) {  // rstd last: wdy - c2 cancels before it rounds (a lone channel's dx is 0)
          store<W>(dx + j, ((g * load<W>(scale + j) - xhat * c1) - c2) * rstd);
        }
        if (kSums) {
          store<W>(dscale + j, load<W>(dscale + j) + g * xhat);
          store<W>(dbias + j, load<W>(dbias + j) + g);
        }
      }
      for (; j < C; ++j) {
        const double g = widen(dy[j]);
        const double xhat = ((widen(x[j]) - mean) - shift) * rstd;
        if (kDx) {
          dx[j] = narrow<T>(((g * widen(scale[j]) - xhat * c1) - c2) * rstd);
        }
        if (kSums) {
          dscale[j] += g * xhat;
          dbias[j] += g;
        }
      }
    }
  }
}

// dbias alone: the sum of dy over valid rows, x unread.
template <typename T, int W>
MASKLN_INLINE void backward_rows_dbias(
    const BackwardArgs<T>& a, int64_t begin, int64_t end, double* dbias) {
  const int64_t C = a.C;
  for (int64_t i = begin; i < end; ++i) {
    if (!a.valid[i]) {
      continue;
    }
    const T* dy = a.dy + i * C;
    int64_t j = 0;
    for (; j + W <= C; j += W) {
      store<W>(dbias + j, load<W>(dbias + j) + load<W>(dy + j));
    }
    for (; j < C; ++j) {
      dbias[j] += widen(dy[j]);
    }
  }
}

}  // namespace maskln_native
