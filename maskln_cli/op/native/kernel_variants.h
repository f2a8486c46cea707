// The row kernels' variants, one per instruction set: kernels_base.cpp, kernels_avx2.cpp and
// kernels_avx512.cpp each compile masked_layer_norm.h's kernels for one (three translation
// units, so that ninja compiles them side by side: together they were the build's longest unit
// by far), and kernels.cpp picks one at run time. The same source and flags in each: with
// -ffp-contract=off and sums in a fixed order, all three give the same bits.
#pragma once

#include <cstdint>

#include "masked_layer_norm.h"

namespace maskln_native {

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define MASKLN_X86 1
#define MASKLN_AVX2 __attribute__((target("avx2,fma,f16c"), flatten))
#define MASKLN_AVX512 \
  __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c"), flatten))
#endif
#define MASKLN_BASE __attribute__((flatten))

template <typename T>
struct Kernels {
  void (*forward)(const ForwardArgs<T>&, int64_t, int64_t);
  void (*backward)(const BackwardArgs<T>&, int64_t, int64_t, double*, double*);
  void (*backward_sums)(const BackwardArgs<T>&, int64_t, int64_t, double*, double*);
  void (*backward_dx)(const BackwardArgs<T>&, int64_t, int64_t, double*, double*);
  void (*backward_dbias)(const BackwardArgs<T>&, int64_t, int64_t, double*);
};

// Short rows of these lengths get kernels with the length known at compile time (the loops
// over a row unroll); any other length, the general kernels. The bits are the same.
#define MASKLN_BY_LENGTH(EXPRESSION)               \
  switch (a.C) {                                   \
    case 16: {                                     \
      constexpr int64_t kC = 16;                   \
      return EXPRESSION;                           \
    }                                              \
    case 32: {                                     \
      constexpr int64_t kC = 32;                   \
      return EXPRESSION;                           \
    }                                              \
    case 64: {                                     \
      constexpr int64_t kC = 64;                   \
      return EXPRESSION;                           \
    }                                              \
    default: {                                     \
      constexpr int64_t kC = 0;                    \
      return EXPRESSION;                           \
    }                                              \
  }

#define MASKLN_VARIANT(NAME, ATTRIBUTES, W)                                                    \
  template <typename T, bool kCentered>                                                       \
  ATTRIBUTES void forward_##NAME(const ForwardArgs<T>& a, int64_t begin, int64_t end) {       \
    MASKLN_BY_LENGTH((forward_rows<T, W, kCentered, kC>(a, begin, end)))                      \
  }                                                                                           \
  template <typename T, bool kCentered>                                                       \
  ATTRIBUTES void backward_##NAME(                                                            \
      const BackwardArgs<T>& a, int64_t begin, int64_t end, double* dscale, double* dbias) {  \
    MASKLN_BY_LENGTH(                                                                         \
        (backward_rows<T, W, kCentered, true, true, kC>(a, begin, end, dscale, dbias)))       \
  }                                                                                           \
  template <typename T, bool kCentered>                                                       \
  ATTRIBUTES void backward_sums_##NAME(                                                       \
      const BackwardArgs<T>& a, int64_t begin, int64_t end, double* dscale, double* dbias) {  \
    MASKLN_BY_LENGTH(                                                                         \
        (backward_rows<T, W, kCentered, false, true, kC>(a, begin, end, dscale, dbias)))      \
  }                                                                                           \
  template <typename T, bool kCentered>                                                       \
  ATTRIBUTES void backward_dx_##NAME(                                                         \
      const BackwardArgs<T>& a, int64_t begin, int64_t end, double* dscale, double* dbias) {  \
    MASKLN_BY_LENGTH(                                                                         \
        (backward_rows<T, W, kCentered, true, false, kC>(a, begin, end, dscale, dbias)))      \
  }                                                                                           \
  template <typename T>                                                                       \
  ATTRIBUTES void backward_dbias_##NAME(                                                      \
      const BackwardArgs<T>& a, int64_t begin, int64_t end, double* dbias) {                  \
    backward_rows_dbias<T, W>(a, begin, end, dbias);                                          \
  }                                                                                           \
  template <typename T, bool kCentered>                                                       \
  Kernels<T> kernels_##NAME() {                                                               \
    return {&forward_##NAME<T, kCentered>, &backward_##NAME<T, kCentered>,                    \
            &backward_sums_##NAME<T, kCentered>, &backward_dx_##NAME<T, kCentered>,           \
            &backward_dbias_##NAME<T>};                                                       \
  }

// The kernels of the norm (kCentered: LayerNorm; else RMSNorm) for each instruction set,
// defined by MASKLN_VARIANT in that set's file (avx2 and avx512 on x86 only).
template <typename T, bool kCentered>
Kernels<T> kernels_base();
template <typename T, bool kCentered>
Kernels<T> kernels_avx2();
template <typename T, bool kCentered>
Kernels<T> kernels_avx512();

// In one instruction set's file: its kernels for every element type and both norms.
#define MASKLN_INSTANTIATE(NAME)                                 \
  template Kernels<float> kernels_##NAME<float, true>();          \
  template Kernels<float> kernels_##NAME<float, false>();         \
  template Kernels<double> kernels_##NAME<double, true>();        \
  template Kernels<double> kernels_##NAME<double, false>();       \
  template Kernels<c10::Half> kernels_##NAME<c10::Half, true>();  \
  template Kernels<c10::Half> kernels_##NAME<c10::Half, false>(); \
  template Kernels<c10::BFloat16> kernels_##NAME<c10::BFloat16, true>(); \
  template Kernels<c10::BFloat16> kernels_##NAME<c10::BFloat16, false>();

}  // namespace maskln_native
