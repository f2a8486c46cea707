// The row kernels compiled for AVX-512 (vectors of 8 float64), on x86 only: see kernel_variants.h.
#include "kernel_variants.h"

namespace maskln_native {

#ifdef MASKLN_X86
MASKLN_VARIANT(avx512, MASKLN_AVX512, 8)
MASKLN_INSTANTIATE(avx512)
#endif

}  // namespace maskln_native
