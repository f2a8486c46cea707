// The row kernels compiled for the build's baseline (x86-64: SSE2, vectors of 2 float64; any other CPU): see kernel_variants.h.
#include "kernel_variants.h"

namespace maskln_native {

MASKLN_VARIANT(base, MASKLN_BASE, 2)
MASKLN_INSTANTIATE(base)

}  // namespace maskln_native
