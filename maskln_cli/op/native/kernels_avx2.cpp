// The row kernels compiled for AVX2 (vectors of 4 float64), on x86 only: see kernel_variants.h.
#include "kernel_variants.h"

namespace maskln_native {

#ifdef MASKLN_X86
MASKLN_VARIANT(avx2, MASKLN_AVX2, 4)
MASKLN_INSTANTIATE(avx2)
#endif

}  // namespace maskln_native
