// The tensor-level entry points of masked_layer_norm.cpp, for bindings.cpp: LayerNorm's and
// RMSNorm's.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
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

// RMSNorm: (y, rstd), rstd undefined without keep_statistics; the requested of (dx, dscale).
std::tuple<at::Tensor, at::Tensor> rms_forward_impl(
    const at::Tensor& x, const at::Tensor& valid, const at::Tensor& scale, double eps,
    double offset, bool keep_statistics);

std::vector<at::Tensor> rms_backward_py(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& valid, const at::Tensor& scale,
    const at::Tensor& rstd, double eps, double offset, std::vector<bool> output_mask);

bool register_maskln_kernels(bool enable);

// Whether the inputs meet the op's contract (every condition of maskln_cli.op.checks'
// check_inputs, or check_rms_inputs' when bias is null), without raising: the public functions'
// check of plain tensors, whose messages Python gives when this says no.
bool within_contract(const at::Tensor& x, const at::Tensor& valid, const at::Tensor& scale,
                     const at::Tensor* bias, double eps, double offset);

// Raises the op's own error for inputs outside its contract (maskln_cli.op.checks, called back
// in Python): the dispatcher ops check the contract in C++ and, only when it is not met, call
// this for the message, so that there is one source of messages. bias is undefined (None in
// Python) for RMSNorm, whose offset it checks too.
using ContractError = std::function<void(const at::Tensor& x, const at::Tensor& valid,
                                         const at::Tensor& scale, const at::Tensor& bias,
                                         double eps, double offset)>;
void set_contract_error(ContractError report);

// The ops' autograd kernels written in Python (maskln_cli.op.library), which the C++ autograd
// kernels call back whenever a derivative may be taken, with the same arguments.
using PythonForward = std::function<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    c10::DispatchKeySet keys, const at::Tensor& x, const at::Tensor& valid,
    const at::Tensor& scale, const at::Tensor& bias, double eps)>;
using PythonBackward = std::function<std::vector<at::Tensor>(
    c10::DispatchKeySet keys, const at::Tensor& dy, const at::Tensor& x, const at::Tensor& valid,
    const at::Tensor& scale, const at::Tensor& mean, const at::Tensor& rstd, double eps,
    std::vector<bool> output_mask)>;
void set_python_autograd(PythonForward forward, PythonBackward backward);

using PythonRmsForward = std::function<std::tuple<at::Tensor, at::Tensor>(
    c10::DispatchKeySet keys, const at::Tensor& x, const at::Tensor& valid,
    const at::Tensor& scale, double eps, double offset)>;
using PythonRmsBackward = std::function<std::vector<at::Tensor>(
    c10::DispatchKeySet keys, const at::Tensor& dy, const at::Tensor& x, const at::Tensor& valid,
    const at::Tensor& scale, const at::Tensor& rstd, double eps, double offset,
    std::vector<bool> output_mask)>;
void set_rms_python_autograd(PythonRmsForward forward, PythonRmsBackward backward);

}  // namespace maskln_native
