// Masked layer normalization and masked RMSNorm in float32 with compensated (float-float)
// arithmetic: the row kernels, forward and backward side by side. No float64 (but see ff.h's
// two_prod on the portable path).
//
// For each valid row x of C channels (centered: LayerNorm; not centered: RMSNorm), shift p =
// x[0] (LayerNorm; 0 for RMSNorm) and every sum an ff sum per lane (ff.h):
//
//     d      = x - p, exactly: d.hi + d.lo (two_sum)
//     mu     = sum(d) / C                         (LayerNorm; RMSNorm: 0)
//     mean   = p + mu
//     var    = sum(d^2) / C - mu^2,  d^2 exact (two_prod) but for d.lo^2
//     rstd   = 1 / sqrt(var + eps)                (one Newton step in ff)
//     xhat   = (x - mean) * rstd,   x - mean exact (two_sum) then times rstd in ff
//     y      = xhat * scale + bias, rounded once from ff
//
// and the backward pass, wdy = dy * scale (exact, two_prod):
//
//     c1     = mean_C(xhat * wdy) = rstd * (sum(d * wdy) - mu * sum(wdy)) / C
//     c2     = mean_C(wdy)                        (LayerNorm; RMSNorm: 0)
//     dx     = rstd * (wdy - xhat * c1 - c2),  the bracket in ff, rounded once after rstd
//     dscale = sum over valid rows of dy * xhat,  dbias = sum over valid rows of dy
//
// Every sum runs in 16 lanes (lane l: elements j = l mod 16), each lane an ff pair (hi by
// two_sum, lo by plain adds) over runs of kRun vectors, runs added in ff; lanes are then added
// in one fixed order (ff.h, fold_rows). The bits depend on the data and C alone: not on the
// instruction set, the thread count or how rows are batched.
//
// Error, in u = 2^-24: a lane's run of n = kRun terms has error below n^2 u^2 of the sum of the
// magnitudes of its terms (2^-36 for n = 64), runs and lanes add a few u^2 each. With
// k = 1 + mu^2 / var (how far p is from the mean, in standard deviations), var's relative error
// is about 3 k 2^-36: rows with k > kReshiftRatio are redone with p = the mean found (k then
// about 1). So mean, var and rstd come out within about 2^-30 relative, deviations within 2^-33
// of the standard deviation, and y and dx are one rounding (0.5 ulp) of a value that is right
// to about 2^-30 of its terms.
//
// Rows whose arithmetic overflows (squares of deviations above 2^64, float32 rows near its
// maximum) or whose var + eps is below 2^-100 (deviations and eps so small that squares and
// eps lose bits in float32) are redone on a copy scaled by a power of two (exact), with eps
// scaled alike: rescued_*_row. Invalid rows are +0.0, never read.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "ff.h"

namespace maskln_f32 {

constexpr int64_t kRun = 64;             // vectors per lane run before runs are added in ff
constexpr float kReshiftRatio = 64.0f;   // mean square / var above this: shift again
constexpr float kSmallestVariance = 0x1p-100f;  // var + eps below this: rescaled
constexpr int64_t kBatchBytes = 256 << 10;      // 16 rows per batch while they take at most this
constexpr int64_t kColumnRun = 64;       // rows between renormalizations of the column sums

enum Trouble : int32_t { kFine = 0, kReshift = 1, kRescale = 2 };

// Per call: C and eps as ff, in every lane.
struct Constants {
  Ff channels;
  Ff eps;
  double eps_value;
};

inline Ff ff_of(double v) {
  const float hi = static_cast<float>(v);
  const float lo = static_cast<float>(v - static_cast<double>(hi));
  return {splat(hi), splat(lo)};
}

inline Constants constants(int64_t C, double eps) {
  const float hi = static_cast<float>(C);
  const float lo = static_cast<float>(C - static_cast<int64_t>(hi));
  return {{splat(hi), splat(lo)}, ff_of(eps), eps};
}

// Rows per batch: 16 (their lane sums folded together) while they fit kBatchBytes, else 1.
inline int64_t rows_per_batch(int64_t row_bytes) {
  return kLanes * row_bytes <= kBatchBytes ? kLanes : 1;
}

// --- lane sums of a row -----------------------------------------------------------------------

// The moments of one row, per lane: s1 = sum(d), s2 = sum(d^2), and with kGrad sw = sum(wdy),
// sdw = sum(d * wdy). x (and dy) of type T, scale float; d = x - shift exactly.
template <class Isa, bool kCentered, bool kGrad>
struct Moments {
  Ff s1{}, s2{}, sw{}, sdw{};  // the sums of the runs so far
  F h1{}, l1{}, h2{}, l2{}, hw{}, lw{}, hdw{}, ldw{};  // the current run
  int64_t run = 0;

  MASKLN_F32_INLINE void step(F x, F minus_shift, F g, F scale) {
    F d = x, dl{}, s, e;
    if (kCentered) {
      two_sum(x, minus_shift, d, dl);
      two_sum(h1, d, s, e);
      h1 = s;
      l1 += e + dl;
    }
    F q, qe;
    two_prod<Isa>(d, d, q, qe);
    two_sum(h2, q, s, e);
    h2 = s;
    l2 += kCentered ? e + (qe + (d + d) * dl) : e + qe;
    if (kGrad) {
      F w, we;
      two_prod<Isa>(g, scale, w, we);
      if (kCentered) {
        two_sum(hw, w, s, e);
        hw = s;
        lw += e + we;
      }
      F t, te;
      two_prod<Isa>(d, w, t, te);
      two_sum(hdw, t, s, e);
      hdw = s;
      ldw += kCentered ? e + (te + (d * we + dl * w)) : e + (te + d * we);
    }
    if (++run == kRun) {
      close_run();
    }
  }

  MASKLN_F32_INLINE void close_run() {
    s1 = add(s1, {h1, l1});
    s2 = add(s2, {h2, l2});
    if (kGrad) {
      sw = add(sw, {hw, lw});
      sdw = add(sdw, {hdw, ldw});
    }
    h1 = l1 = h2 = l2 = hw = lw = hdw = ldw = F{};
    run = 0;
  }
};

template <class Isa, bool kCentered, bool kGrad, typename X, typename G>
MASKLN_F32_INLINE Moments<Isa, kCentered, kGrad> row_moments(
    const X* x, const G* dy, const float* scale, int64_t C, float shift) {
  Moments<Isa, kCentered, kGrad> m;
  const F minus_shift = splat(-shift);
  int64_t j = 0;
  for (; j + kLanes <= C; j += kLanes) {
    m.step(load(x + j), minus_shift, kGrad ? load(dy + j) : F{}, kGrad ? load(scale + j) : F{});
  }
  if (j < C) {  // the last, partial vector: x padded with the shift (d = 0), dy with 0
    const int64_t n = C - j;
    m.step(load_partial(x + j, n, shift), minus_shift, kGrad ? load_partial(dy + j, n, 0.0f) : F{},
           kGrad ? load_partial(scale + j, n, 0.0f) : F{});
  }
  if (m.run != 0) {
    m.close_run();
  }
  return m;
}

// --- statistics of 16 rows at once (lane r: row r) --------------------------------------------

struct Statistics {
  Ff mean, rstd, c1, c2;  // c1, c2: the backward's (0 in the forward)
  I trouble;
};

MASKLN_F32_INLINE I finite(F v) { return (v == v) & (v - v == v - v); }

template <class Isa, bool kCentered, bool kGrad>
MASKLN_F32_INLINE Statistics statistics(Ff s1, Ff s2, Ff sw, Ff sdw, F shift, const Constants& k) {
  Statistics st{};
  Ff mu{}, var;
  const Ff mean_square = div<Isa>(s2, k.channels);
  if (kCentered) {
    mu = div<Isa>(s1, k.channels);
    F mh, ml;
    two_sum(shift, mu.hi, mh, ml);
    st.mean = normalized(mh, ml + mu.lo);
    var = add(mean_square, negate(mul<Isa>(mu, mu)));
    const I positive = var.hi > 0.0f;
    var = {select(positive, var.hi, F{}), select(positive, var.lo, F{})};
  } else {
    var = mean_square;
  }
  const Ff v = add(var, k.eps);
  st.rstd = rsqrt<Isa>(v);
  I reshift = I{};
  if (kCentered) {
    reshift = mean_square.hi > var.hi * kReshiftRatio;
  }
  const I rescale = ~(finite(s1.hi) & finite(s2.hi) & finite(v.hi) & finite(st.rstd.hi)) |
                    (v.hi < kSmallestVariance);
  if (kGrad) {
    Ff centered_sdw = sdw;  // sum((d - mu) wdy)
    if (kCentered) {
      st.c2 = div<Isa>(sw, k.channels);
      centered_sdw = add(sdw, negate(mul<Isa>(mu, sw)));
    }
    st.c1 = mul<Isa>(st.rstd, div<Isa>(centered_sdw, k.channels));
  }
  st.trouble = (rescale & int32_t{kRescale}) | (reshift & int32_t{kReshift});
  return st;
}

// One row's statistics (lane 0), its lane sums folded as in a batch (with 15 empty rows).
template <class Isa, bool kCentered, bool kGrad, typename X, typename G>
MASKLN_F32_INLINE Statistics single_row_statistics(const X* x, const G* dy, const float* scale, int64_t C,
                                        float shift, const Constants& k) {
  const auto m = row_moments<Isa, kCentered, kGrad>(x, dy, scale, C, shift);
  Ff s1[kLanes] = {}, s2[kLanes] = {}, sw[kLanes] = {}, sdw[kLanes] = {};
  s1[0] = m.s1;
  s2[0] = m.s2;
  sw[0] = m.sw;
  sdw[0] = m.sdw;
  return statistics<Isa, kCentered, kGrad>(fold_rows(s1), fold_rows(s2), fold_rows(sw),
                                           fold_rows(sdw), splat(shift), k);
}

// The statistics of lane r, in every lane (for a row's pass over its channels).
struct RowStatistics {
  F minus_mean_hi, minus_mean_lo, rstd_hi, rstd_lo, c1_hi, c1_lo, minus_c2_hi, minus_c2_lo;
};

inline RowStatistics row_statistics(const Statistics& st, int r) {
  return {splat(-st.mean.hi[r]), splat(-st.mean.lo[r]), splat(st.rstd.hi[r]),
          splat(st.rstd.lo[r]),  splat(st.c1.hi[r]),    splat(st.c1.lo[r]),
          splat(-st.c2.hi[r]),   splat(-st.c2.lo[r])};
}

// xhat = (x - mean) * rstd as ff (p + pl): x - mean exact, then times rstd.
template <class Isa, bool kCentered>
MASKLN_F32_INLINE void normalize(F x, const RowStatistics& s, F& p, F& pl) {
  F dev = x, dl{};
  if (kCentered) {
    F e;
    two_sum(x, s.minus_mean_hi, dev, e);
    dl = e + s.minus_mean_lo;
  }
  F pe;
  two_prod<Isa>(dev, s.rstd_hi, p, pe);
  pl = kCentered ? pe + (dev * s.rstd_lo + dl * s.rstd_hi) : pe + dev * s.rstd_lo;
}

// --- forward --------------------------------------------------------------------------------

template <typename T>
struct ForwardArgs {
  const T* x;          // [rows, C], contiguous
  const bool* valid;   // [rows]
  const float* scale;  // [C]
  const float* bias;   // [C], or null (RMSNorm)
  T* y;                // [rows, C]
  float* mean;         // [rows], or null
  float* rstd;         // [rows], or null
  int64_t C;
};

// y of one row from its statistics; x of type X (T, or the rescued float copy).
template <class Isa, bool kCentered, typename X, typename T>
MASKLN_F32_INLINE void normalized_row(const X* x, const float* scale, const float* bias, int64_t C,
                                      const RowStatistics& s, T* y) {
  auto value = [&](F xv, F sc, F b) {
    F p, pl, q, qe;
    normalize<Isa, kCentered>(xv, s, p, pl);
    two_prod<Isa>(p, sc, q, qe);
    if (kCentered) {
      F r, re;
      two_sum(q, b, r, re);
      return r + (re + (qe + pl * sc));
    }
    return q + (qe + pl * sc);
  };
  int64_t j = 0;
  for (; j + kLanes <= C; j += kLanes) {
    store(y + j, value(load(x + j), load(scale + j), kCentered ? load(bias + j) : F{}));
  }
  if (j < C) {
    const int64_t n = C - j;
    store_partial(y + j, n,
                  value(load_partial(x + j, n, 0.0f), load_partial(scale + j, n, 0.0f),
                        kCentered ? load_partial(bias + j, n, 0.0f) : F{}));
  }
}

// e with 2^e >= max(max |x|, sqrt(eps)) > 2^(e-1): the scale that brings a row's values and
// sqrt(eps) to at most 1. 0 for rows holding NaN or inf (they stay NaN).
template <typename T>
inline int rescue_exponent(const T* x, int64_t C, double eps) {
  float largest = 0.0f;
  for (int64_t j = 0; j < C; ++j) {
    const float v = std::fabs(static_cast<float>(x[j]));
    if (!(v <= largest)) {
      largest = v;
    }
  }
  if (!std::isfinite(largest)) {
    return 0;
  }
  int e_x = -1000, e_eps = 0;
  if (largest > 0.0f) {
    std::frexp(largest, &e_x);
  }
  std::frexp(eps, &e_eps);
  return std::max(e_x, (e_eps + 1) / 2);
}

// A row the batch could not do (inlined into the ISA's kernel like the rest: see ff.h): copied to float32, scaled by 2^-e (kRescale), and shifted
// again by its mean when its first element was far from it (kReshift).
template <class Isa, bool kCentered, bool kGrad, typename T>
struct RescuedRow {
  std::vector<float> x;
  Statistics st;
  int exponent = 0;

  RescuedRow(const T* row, const T* dy, const float* scale, int64_t C, double eps, int trouble)
      : x(C) {
    exponent = (trouble & kRescale) ? rescue_exponent(row, C, eps) : 0;
    for (int64_t j = 0; j < C; ++j) {
      x[j] = std::ldexp(static_cast<float>(row[j]), -exponent);
    }
    const Constants k = constants(C, std::ldexp(eps, -2 * exponent));
    const float first = kCentered ? x[0] : 0.0f;
    const float* xs = x.data();
    st = single_row_statistics<Isa, kCentered, kGrad>(xs, dy, scale, C, first, k);
    if (kCentered && (st.trouble[0] & kReshift)) {
      st = single_row_statistics<Isa, kCentered, kGrad>(xs, dy, scale, C, st.mean.hi[0], k);
    }
  }
};

template <class Isa, bool kCentered, typename T>
MASKLN_F32_INLINE void forward_rescued_row(const ForwardArgs<T>& a, int64_t i, double eps,
                                             int trouble) {
  const int64_t C = a.C;
  const RescuedRow<Isa, kCentered, false, T> row(a.x + i * C, a.x + i * C, a.scale, C, eps,
                                                 trouble);
  normalized_row<Isa, kCentered>(row.x.data(), a.scale, a.bias, C, row_statistics(row.st, 0),
                                 a.y + i * C);
  if (a.mean != nullptr) {
    a.mean[i] = kCentered ? std::ldexp(row.st.mean.hi[0], row.exponent) : 0.0f;
    a.rstd[i] = std::ldexp(row.st.rstd.hi[0], -row.exponent);
  }
}

template <class Isa, bool kCentered, typename T>
MASKLN_F32_INLINE void forward_rows(const ForwardArgs<T>& a, const Constants& k, int64_t begin,
                                    int64_t end) {
  const int64_t C = a.C;
  const int64_t batch = rows_per_batch(C * static_cast<int64_t>(sizeof(T)));
  for (int64_t first = begin; first < end; first += batch) {
    const int64_t count = std::min(batch, end - first);
    Ff s1[kLanes] = {}, s2[kLanes] = {}, none[kLanes] = {};
    float shift[kLanes] = {};
    for (int64_t r = 0; r < count; ++r) {
      const int64_t i = first + r;
      if (a.valid[i]) {
        const T* x = a.x + i * C;
        shift[r] = kCentered ? static_cast<float>(x[0]) : 0.0f;
        const auto m = row_moments<Isa, kCentered, false>(x, x, a.scale, C, shift[r]);
        s1[r] = m.s1;
        s2[r] = m.s2;
      }
    }
    const Ff empty = fold_rows(none);
    const Statistics st = statistics<Isa, kCentered, false>(
        fold_rows(s1), fold_rows(s2), empty, empty, load(static_cast<const float*>(shift)), k);
    for (int64_t r = 0; r < count; ++r) {
      const int64_t i = first + r;
      T* y = a.y + i * C;
      if (!a.valid[i]) {  // +0.0 is all-zero bits in every dtype
        std::memset(static_cast<void*>(y), 0, sizeof(T) * C);
        if (a.mean != nullptr) {
          a.mean[i] = a.rstd[i] = 0.0f;
        }
        continue;
      }
      if (st.trouble[r] != kFine) {
        forward_rescued_row<Isa, kCentered>(a, i, k.eps_value, st.trouble[r]);
        continue;
      }
      normalized_row<Isa, kCentered>(a.x + i * C, a.scale, a.bias, C, row_statistics(st, r), y);
      if (a.mean != nullptr) {
        a.mean[i] = kCentered ? st.mean.hi[r] : 0.0f;
        a.rstd[i] = st.rstd.hi[r];
      }
    }
  }
}

// --- backward -------------------------------------------------------------------------------

template <typename T>
struct BackwardArgs {
  const T* dy;         // [rows, C], contiguous
  const T* x;          // [rows, C]
  const bool* valid;   // [rows]
  const float* scale;  // [C]
  const float* mean;   // [rows], the forward's (the shift, when finite), or null
  T* dx;               // [rows, C], or null
  int64_t C;
};

// A block's column sums, ff: dscale (hi, lo) and dbias (hi, lo), each [C], or null.
struct ColumnSums {
  float* dscale_hi;
  float* dscale_lo;
  float* dbias_hi;
  float* dbias_lo;
  int64_t rows = 0;  // valid rows added since the last renormalization
};

MASKLN_F32_INLINE void accumulate(float* hi, float* lo, int64_t j, F term, F term_lo) {
  F h = load(hi + j), l = load(lo + j), s, e;
  two_sum(h, term, s, e);
  store(hi + j, s);
  store(lo + j, l + (e + term_lo));
}

MASKLN_F32_INLINE void accumulate_partial(float* hi, float* lo, int64_t j, int64_t n, F term,
                                          F term_lo) {
  F h = load_partial(hi + j, n, 0.0f), l = load_partial(lo + j, n, 0.0f), s, e;
  two_sum(h, term, s, e);
  store_partial(hi + j, n, s);
  store_partial(lo + j, n, l + (e + term_lo));
}

inline void renormalize(float* hi, float* lo, int64_t C) {
  for (int64_t j = 0; j < C; ++j) {
    const float s = hi[j] + lo[j];
    const float bb = s - hi[j];
    lo[j] = (hi[j] - (s - bb)) + (lo[j] - bb);
    hi[j] = s;
  }
}

// dx of one row (when kDx), its dscale and dbias terms added to sums (when kSums); x of type X
// (T, or the rescued float copy), dx = 2^-exponent times the bracket (the rescued row's scale).
template <class Isa, bool kCentered, bool kDx, bool kSums, typename X, typename T>
MASKLN_F32_INLINE void gradient_row(const X* x, const T* dy, const float* scale, int64_t C,
                                    const RowStatistics& s, T* dx, ColumnSums* sums,
                                    float dx_factor) {
  const F factor = splat(dx_factor);
  auto grad = [&](F xv, F g, F sc, F& p, F& pl) {
    normalize<Isa, kCentered>(xv, s, p, pl);
    if (!kDx) {
      return F{};
    }
    F w, we, t, te, a, ae;
    two_prod<Isa>(g, sc, w, we);
    two_prod<Isa>(p, s.c1_hi, t, te);  // xhat * c1
    te += p * s.c1_lo + pl * s.c1_hi;
    two_sum(w, -t, a, ae);
    F b = a, lo = ae + (we - te);
    if (kCentered) {
      F be;
      two_sum(a, s.minus_c2_hi, b, be);
      lo = ((ae + be) + (we - te)) + s.minus_c2_lo;
    }
    F q, qe;
    two_prod<Isa>(b, s.rstd_hi, q, qe);
    return (q + (qe + (b * s.rstd_lo + lo * s.rstd_hi))) * factor;
  };
  auto terms = [&](F g, F p, F pl, F& ds, F& dsl) {
    F e;
    two_prod<Isa>(g, p, ds, e);
    dsl = e + g * pl;
  };
  int64_t j = 0;
  for (; j + kLanes <= C; j += kLanes) {
    const F g = load(dy + j);
    F p, pl;
    const F v = grad(load(x + j), g, load(scale + j), p, pl);
    if (kDx) {
      store(dx + j, v);
    }
    if (kSums) {
      F ds, dsl;
      terms(g, p, pl, ds, dsl);
      accumulate(sums->dscale_hi, sums->dscale_lo, j, ds, dsl);
      if (kCentered) {
        accumulate(sums->dbias_hi, sums->dbias_lo, j, g, F{});
      }
    }
  }
  if (j < C) {
    const int64_t n = C - j;
    const F g = load_partial(dy + j, n, 0.0f);
    F p, pl;
    const F v = grad(load_partial(x + j, n, 0.0f), g, load_partial(scale + j, n, 0.0f), p, pl);
    if (kDx) {
      store_partial(dx + j, n, v);
    }
    if (kSums) {
      F ds, dsl;
      terms(g, p, pl, ds, dsl);
      accumulate_partial(sums->dscale_hi, sums->dscale_lo, j, n, ds, dsl);
      if (kCentered) {
        accumulate_partial(sums->dbias_hi, sums->dbias_lo, j, n, g, F{});
      }
    }
  }
  if (kSums && ++sums->rows == kColumnRun) {
    renormalize(sums->dscale_hi, sums->dscale_lo, C);
    if (kCentered) {
      renormalize(sums->dbias_hi, sums->dbias_lo, C);
    }
    sums->rows = 0;
  }
}

// dx of a row whose bracket cancels: C = 2 (LayerNorm) or C = 1 (RMSNorm), where xhat's squares
// sum to C var / (var + eps) and wdy - c2 - xhat c1 leaves eps / (var + eps) = eps rstd^2 of its
// terms, below float-float's resolution when var >> eps. Its closed form instead, every factor
// in ff: LayerNorm dx = +-(wdy0 - wdy1) / 2 * eps rstd^3, RMSNorm dx = wdy * eps rstd^3.
template <class Isa, bool kCentered>
constexpr bool cancels(int64_t C) {
  return C == (kCentered ? 2 : 1);
}

template <class Isa, bool kCentered, typename T>
MASKLN_F32_INLINE void cancelled_dx(const T* dy, const float* scale, int64_t C,
                                    const RowStatistics& s, const Ff& eps, T* dx, float factor) {
  F w, we;
  two_prod<Isa>(load_partial(dy, C, 0.0f), load_partial(scale, C, 0.0f), w, we);
  Ff bracket{w, we};
  if (kCentered) {  // lane 0: (w0 - w1) / 2, lane 1: its negation
    constexpr I swap = {1, 0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const Ff other{__builtin_shuffle(w, swap), __builtin_shuffle(we, swap)};
    const Ff difference = add(bracket, negate(other));
    bracket = {difference.hi * 0.5f, difference.lo * 0.5f};
  }
  const Ff rstd{s.rstd_hi, s.rstd_lo};
  const Ff cube = mul<Isa>(mul<Isa>(rstd, rstd), rstd);
  const Ff value = mul<Isa>(bracket, mul<Isa>(eps, cube));
  store_partial(dx, C, (value.hi + value.lo) * splat(factor));
}

template <class Isa, bool kCentered, bool kDx, bool kSums, typename T>
MASKLN_F32_INLINE void backward_rescued_row(const BackwardArgs<T>& a, int64_t i, double eps,
                                              int trouble, ColumnSums* sums) {
  const int64_t C = a.C;
  const RescuedRow<Isa, kCentered, true, T> row(a.x + i * C, a.dy + i * C, a.scale, C, eps,
                                                trouble);
  const RowStatistics statistics = row_statistics(row.st, 0);
  const float factor = std::ldexp(1.0f, -row.exponent);
  gradient_row<Isa, kCentered, kDx, kSums>(row.x.data(), a.dy + i * C, a.scale, C, statistics,
                                           kDx ? a.dx + i * C : nullptr, sums, factor);
  if (kDx && cancels<Isa, kCentered>(C)) {  // eps as the rescued row's statistics scaled it
    cancelled_dx<Isa, kCentered>(a.dy + i * C, a.scale, C, statistics,
                                 ff_of(std::ldexp(eps, -2 * row.exponent)), a.dx + i * C, factor);
  }
}

template <class Isa, bool kCentered, bool kDx, bool kSums, typename T>
MASKLN_F32_INLINE void backward_rows(const BackwardArgs<T>& a, const Constants& k, int64_t begin,
                                     int64_t end, ColumnSums* sums) {
  const int64_t C = a.C;
  const int64_t batch = rows_per_batch(2 * C * static_cast<int64_t>(sizeof(T)));
  for (int64_t first = begin; first < end; first += batch) {
    const int64_t count = std::min(batch, end - first);
    Ff s1[kLanes] = {}, s2[kLanes] = {}, sw[kLanes] = {}, sdw[kLanes] = {};
    float shift[kLanes] = {};
    for (int64_t r = 0; r < count; ++r) {
      const int64_t i = first + r;
      if (a.valid[i]) {
        const T* x = a.x + i * C;
        float p = static_cast<float>(x[0]);
        if (a.mean != nullptr && std::isfinite(a.mean[i])) {
          p = a.mean[i];
        }
        shift[r] = kCentered ? p : 0.0f;
        const auto m = row_moments<Isa, kCentered, true>(x, a.dy + i * C, a.scale, C, shift[r]);
        s1[r] = m.s1;
        s2[r] = m.s2;
        sw[r] = m.sw;
        sdw[r] = m.sdw;
      }
    }
    const Statistics st = statistics<Isa, kCentered, true>(
        fold_rows(s1), fold_rows(s2), fold_rows(sw), fold_rows(sdw),
        load(static_cast<const float*>(shift)), k);
    for (int64_t r = 0; r < count; ++r) {
      const int64_t i = first + r;
      T* dx = kDx ? a.dx + i * C : nullptr;
      if (!a.valid[i]) {
        if (kDx) {
          std::memset(static_cast<void*>(dx), 0, sizeof(T) * C);
        }
        continue;
      }
      if (st.trouble[r] != kFine) {
        backward_rescued_row<Isa, kCentered, kDx, kSums>(a, i, k.eps_value, st.trouble[r], sums);
        continue;
      }
      const RowStatistics statistics = row_statistics(st, r);
      gradient_row<Isa, kCentered, kDx, kSums>(a.x + i * C, a.dy + i * C, a.scale, C, statistics,
                                               dx, sums, 1.0f);
      if (kDx && cancels<Isa, kCentered>(C)) {
        cancelled_dx<Isa, kCentered>(a.dy + i * C, a.scale, C, statistics, k.eps, dx, 1.0f);
      }
    }
  }
}

}  // namespace maskln_f32
