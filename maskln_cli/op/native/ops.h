// The tensor-level entry points of masked_layer_norm.cpp, for bindings.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <tuple>
#include <vector>

namespace maskln_native {

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_impl(
    const at::Tensor& x, const at::Tensor& valid, const at::Tensor& scale, const at::Tensor& bias,
    double eps, bool keep_statistics);

std::vector<at::Tensor> backward_py(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& valid, const at::Tensor& scale,
    const at::Tensor& mean, const at::Tensor& rstd, double eps, std::vector<bool> output_mask);

at::Tensor forward_autograd(const at::Tensor& x, const at::Tensor& valid, const at::Tensor& scale,
                            const at::Tensor& bias, double eps);

bool register_maskln_kernels(bool enable);

}  // namespace maskln_native
