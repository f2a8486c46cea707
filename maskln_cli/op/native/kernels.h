// The interface between the kernels (kernels.cpp: run over threads, the instruction set picked;
// kernels_base/avx2/avx512.cpp: the row kernels compiled for each) and masked_layer_norm.cpp
// (tensors and bindings). Separate units so that ninja compiles them side by side: the bindings'
// headers alone take about as long as one instruction set's kernels.
#pragma once

#include <cstdint>
#include <string>

namespace maskln_native {

enum class Dtype : int { kFloat, kDouble, kHalf, kBFloat16 };

// Contiguous rows; mean, rstd, scale and bias in the compute dtype (double for double x, else
// float). mean and rstd null: the statistics are not kept. RMSNorm (centered false): bias and
// mean null, the gain is scale + offset.
struct ForwardCall {
  bool centered;
  double offset;
  Dtype dtype;
  const void* x;
  const bool* valid;
  const void* scale;
  const void* bias;
  void* y;
  void* mean;
  void* rstd;
  int64_t rows;
  int64_t C;
  double eps;
};

// dx, dscale, dbias null: not wanted. dscale and dbias have sums_dtype (scale's own dtype).
// RMSNorm (centered false): mean and dbias null, the gain is scale + offset.
struct BackwardCall {
  bool centered;
  double offset;
  Dtype dtype;
  const void* dy;
  const void* x;
  const bool* valid;
  const void* scale;
  const void* mean;
  const void* rstd;
  void* dx;
  void* dscale;
  void* dbias;
  Dtype sums_dtype;
  int64_t rows;
  int64_t C;
  double eps;
};

void run_forward(const ForwardCall& call);
void run_backward(const BackwardCall& call);

// Rows per block of the parameter sums: from the shape and dtype alone.
int64_t block_rows(int64_t rows, int64_t C, int64_t element_size);

std::string isa();
std::string set_isa(const std::string& name);
// Whether at::parallel_for here runs on torch's threads (this file compiled with OpenMP).
bool intra_op_parallel();

}  // namespace maskln_native
