// Masked layer and RMS normalization on CPU: tensors, checks and bindings around kernels.cpp.
//
//   forward(x, valid, scale, bias, eps) -> (y, mean, rstd)
//   backward(dy, x, valid, scale, mean, rstd, eps, output_mask) -> the requested of
//       (dx, dscale, dbias)
//   rms_forward(x, valid, scale, eps, offset) -> (y, rstd)
//   rms_backward(dy, x, valid, scale, rstd, eps, offset, output_mask) -> the requested of
//       (dx, dscale)
//
// One implementation of each direction (norm_forward, norm_backward), the norm a parameter: a
// null bias (and mean) is RMSNorm's.
//
// y and dx have x's layout (torch.empty_like(x)); mean and rstd are [..., 1] in the compute
// dtype (float32 for float32, float16 and bfloat16; float64 for float64), 0 on invalid rows;
// dscale and dbias have scale's dtype. Two ways in: pybind functions (bindings.cpp: the
// cheapest call, which maskln's eager path and its autograd.Function take), and the CPU
// kernels of maskln's own custom ops, maskln::masked_layer_norm(_backward), once
// register_maskln_kernels is called (what graphs from torch.compile and torch.export call):
// maskln::masked_layer_norm(_backward) and maskln::masked_rms_norm(_backward).
// The library defines no ops of its own (no TORCH_LIBRARY): the ops, their fake kernels,
// autograd and vmap rules are defined once, in maskln_cli/op/library.py.
// No C++ autograd node: maskln's autograd is a Python autograd.Function, which torch.func
// transforms and second-order gradients need (a C++ node saved about 20 us per call but
// supported neither).
//
// Only the headers each part needs (not torch/extension.h, which alone took 26 s of CPU to
// compile): the three translation units compile side by side.
#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <initializer_list>

#include <cmath>
#include <memory>
#include <tuple>
#include <vector>

#include "kernels.h"
#include "ops.h"

namespace maskln_native {

// --- checks and layout ----------------------------------------------------------------------

Dtype kernel_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return Dtype::kFloat;
    case at::kDouble:
      return Dtype::kDouble;
    case at::kHalf:
      return Dtype::kHalf;
    case at::kBFloat16:
      return Dtype::kBFloat16;
    default:
      TORCH_CHECK(false, "maskln native: x must be float32, float64, float16 or bfloat16, got ",
                  t);
  }
}

at::ScalarType compute_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// What memory safety needs; the op's own checks (maskln_cli.op.checks.check_inputs) say more.
void check_inputs(const at::Tensor& x, const at::Tensor& valid, const at::Tensor& scale,
                  const at::Tensor* bias, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.layout() == at::kStrided,
              "maskln native: x must be a dense CPU tensor");
  kernel_dtype(x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, "maskln native: x must have a channel axis");
  TORCH_CHECK(valid.scalar_type() == at::kBool && valid.device().is_cpu() &&
                  valid.layout() == at::kStrided,
              "maskln native: valid must be a dense bool CPU tensor");
  TORCH_CHECK(valid.sizes() == x.sizes().slice(0, x.dim() - 1),
              "maskln native: valid must have x's leading shape ", x.sizes().slice(0, x.dim() - 1),
              ", got ", valid.sizes());
  const int64_t C = x.size(-1);
  const auto p = compute_type(x.scalar_type());
  for (const at::Tensor* param : {&scale, bias}) {
    if (param == nullptr) {
      continue;
    }
    TORCH_CHECK(param->device().is_cpu() && param->layout() == at::kStrided &&
                    param->dim() == 1 && param->size(0) == C,
                "maskln native: scale and bias must be dense CPU tensors of shape [", C, "]");
    TORCH_CHECK(param->scalar_type() == x.scalar_type() || param->scalar_type() == p,
                "maskln native: scale and bias must have x's dtype or ", p, ", got ",
                param->scalar_type());
  }
  TORCH_CHECK(eps > 0.0 && std::isfinite(eps), "maskln native: eps must be finite and positive");
}

// t itself when it already has the dtype and contiguous rows (no dispatcher call), else a copy.
at::Tensor contiguous_as(const at::Tensor& t, at::ScalarType dtype) {
  if (t.scalar_type() == dtype && t.is_contiguous()) {
    return t;
  }
  return t.to(dtype).contiguous();
}

at::Tensor contiguous(const at::Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }

// torch.empty_like(x), without the dispatcher when x has the default strides (an empty x never
// does: the strides of its empty_like may be 0, as in an expanded x).
at::Tensor output_like(const at::Tensor& x) {
  const auto sizes = x.sizes();
  const auto strides = x.strides();
  int64_t expected = 1;
  bool standard = x.numel() != 0;
  for (int64_t d = x.dim() - 1; d >= 0 && standard; --d) {
    standard = strides[d] == expected;
    expected *= sizes[d];
  }
  if (standard) {
    return at::detail::empty_cpu(sizes, x.scalar_type());
  }
  return at::empty_like(x, at::MemoryFormat::Preserve);
}

std::vector<int64_t> statistics_shape(const at::Tensor& x) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = 1;
  return shape;
}

// --- the op's contract ------------------------------------------------------------------------
//
// The dispatcher ops are what torch.ops.maskln.masked_layer_norm(_backward) run on CPU tensors
// (register_maskln_kernels), called by anyone, exported graphs included: they check every
// condition of maskln_cli.op.checks.check_inputs here, cheaply, and when one fails call that
// Python function back (set_contract_error) for its TypeError or ValueError and message. The
// pybind functions skip this: maskln's Python code checks before calling them.

ContractError* contract_error = nullptr;  // set once from Python, never destroyed

void set_contract_error(ContractError report) {
  delete contract_error;
  contract_error = new ContractError(std::move(report));
}

bool is_half(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

bool meets_contract(const at::Tensor& x, const at::Tensor& valid, const at::Tensor& scale,
                    const at::Tensor& bias, double eps) {  // RMSNorm: scale stands for bias
  const auto t = x.scalar_type();
  if (!(t == at::kFloat || t == at::kDouble || is_half(t))) {
    return false;
  }
  for (const at::Tensor* tensor : {&x, &valid, &scale, &bias}) {
    if (tensor->layout() != at::kStrided) {
      return false;
    }
  }
  if (x.dim() == 0 || valid.scalar_type() != at::kBool ||
      valid.sizes() != x.sizes().slice(0, x.dim() - 1) || valid.device() != x.device()) {
    return false;
  }
  for (const at::Tensor* param : {&scale, &bias}) {
    const auto p = param->scalar_type();
    if (!(p == t || (is_half(t) && p == at::kFloat)) || param->dim() != 1 ||
        param->size(0) != x.size(-1) || param->device() != x.device()) {
      return false;
    }
  }
  // eps > 0 and finite; in float32 (the compute dtype of all but float64) not rounding to 0:
  // 2**-150 and below round to 0 (maskln_cli.op.checks.eps_rounds_to_zero).
  return eps > 0.0 && std::isfinite(eps) && (t == at::kDouble || eps > std::ldexp(1.0, -150));
}

// bias null: RMSNorm's contract, whose offset must be finite.
bool within_contract(const at::Tensor& x, const at::Tensor& valid, const at::Tensor& scale,
                     const at::Tensor* bias, double eps, double offset) {
  return bias != nullptr ? meets_contract(x, valid, scale, *bias, eps)
                         : meets_contract(x, valid, scale, scale, eps) && std::isfinite(offset);
}

void check_contract(const at::Tensor& x, const at::Tensor& valid, const at::Tensor& scale,
                    const at::Tensor* bias, double eps, double offset = 0.0) {
  if (within_contract(x, valid, scale, bias, eps, offset)) {
    return;
  }
  if (contract_error != nullptr) {  // raises the op's own error
    (*contract_error)(x, valid, scale, bias != nullptr ? *bias : at::Tensor(), eps, offset);
  }
  TORCH_CHECK(false, "maskln: the inputs are outside the op's contract (x ", x.scalar_type(),
              " ", x.sizes(), ", valid ", valid.scalar_type(), " ", valid.sizes(), ", scale ",
              scale.scalar_type(), " ", scale.sizes(), ", eps ", eps, ", offset ", offset, ")");
}

// --- forward --------------------------------------------------------------------------------

// (y, mean, rstd) of either norm: bias null is RMSNorm's (mean then undefined, the gain scale +
// offset).
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_forward(
    const at::Tensor& x, const at::Tensor& valid, const at::Tensor& scale, const at::Tensor* bias,
    double eps, double offset, bool keep_statistics) {
  check_inputs(x, valid, scale, bias, eps);
  const bool centered = bias != nullptr;
  const auto p = compute_type(x.scalar_type());
  at::Tensor y = output_like(x);
  at::Tensor mean, rstd;
  const int64_t C = x.size(-1);
  const int64_t rows = valid.numel();
  if (keep_statistics) {
    if (centered) {
      mean = at::detail::empty_cpu(statistics_shape(x), p);
    }
    rstd = at::detail::empty_cpu(statistics_shape(x), p);
    if (C == 0) {  // nothing to normalize: statistics 0, as maskln_cli.op.blocked.forward
      for (at::Tensor* statistic : {&mean, &rstd}) {
        if (statistic->defined()) {
          statistic->zero_();
        }
      }
    }
  }
  if (rows == 0 || C == 0) {
    return {y, mean, rstd};
  }
  const at::Tensor x_rows = contiguous(x);
  const at::Tensor valid_rows = contiguous(valid);
  const at::Tensor scale_p = contiguous_as(scale, p);
  const at::Tensor bias_p = centered ? contiguous_as(*bias, p) : at::Tensor();
  // Rows are written contiguous, and copied when y's layout differs.
  const at::Tensor y_rows = y.is_contiguous() ? y : at::detail::empty_cpu(x.sizes(), x.scalar_type());
  run_forward({centered, offset, kernel_dtype(x.scalar_type()), x_rows.const_data_ptr(),
               valid_rows.const_data_ptr<bool>(), scale_p.const_data_ptr(),
               centered ? bias_p.const_data_ptr() : nullptr, y_rows.mutable_data_ptr(),
               keep_statistics && centered ? mean.mutable_data_ptr() : nullptr,
               keep_statistics ? rstd.mutable_data_ptr() : nullptr, rows, C, eps});
  if (!y_rows.is_same(y)) {
    y.copy_(y_rows);
  }
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_impl(
    const at::Tensor& x, const at::Tensor& valid, const at::Tensor& scale, const at::Tensor& bias,
    double eps, bool keep_statistics) {
  return norm_forward(x, valid, scale, &bias, eps, 0.0, keep_statistics);
}

std::tuple<at::Tensor, at::Tensor> rms_forward_impl(
    const at::Tensor& x, const at::Tensor& valid, const at::Tensor& scale, double eps,
    double offset, bool keep_statistics) {
  auto [y, mean, rstd] = norm_forward(x, valid, scale, nullptr, eps, offset, keep_statistics);
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(
    const at::Tensor& x, const at::Tensor& valid, const at::Tensor& scale, const at::Tensor& bias,
    double eps) {
  check_contract(x, valid, scale, &bias, eps);
  return forward_impl(x, valid, scale, bias, eps, true);
}

std::tuple<at::Tensor, at::Tensor> rms_forward(const at::Tensor& x, const at::Tensor& valid,
                                               const at::Tensor& scale, double eps,
                                               double offset) {
  check_contract(x, valid, scale, nullptr, eps, offset);
  return rms_forward_impl(x, valid, scale, eps, offset, true);
}

// --- backward -------------------------------------------------------------------------------

// The requested of (dx, dscale, dbias) of either norm: mean null is RMSNorm's (no dbias, the
// gain scale + offset).
std::vector<at::Tensor> norm_backward(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& valid, const at::Tensor& scale,
    const at::Tensor* mean, const at::Tensor& rstd, double eps, double offset, bool need_dx,
    bool need_dscale, bool need_dbias) {
  check_inputs(x, valid, scale, nullptr, eps);
  const bool centered = mean != nullptr;
  TORCH_CHECK(centered || !need_dbias, "maskln native: RMSNorm has no bias");
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.device().is_cpu() && dy.layout() == at::kStrided,
              "maskln native: dy must be a dense CPU tensor of x's shape ", x.sizes(), ", got ",
              dy.sizes());
  const int64_t C = x.size(-1);
  const int64_t rows = valid.numel();
  TORCH_CHECK((!centered || (mean->numel() == rows && mean->device().is_cpu())) &&
                  rstd.numel() == rows && rstd.device().is_cpu(),
              "maskln native: mean and rstd must have one value per row (", rows, ")");
  const auto p = compute_type(x.scalar_type());
  at::Tensor dx, dscale, dbias;
  if (need_dx) {
    dx = output_like(x);
  }
  if (need_dscale) {
    dscale = at::detail::empty_cpu({C}, scale.scalar_type());
  }
  if (need_dbias) {
    dbias = at::detail::empty_cpu({C}, scale.scalar_type());
  }
  if (rows == 0 || C == 0) {
    for (at::Tensor* sum : {&dscale, &dbias}) {
      if (sum->defined()) {
        sum->zero_();
      }
    }
  } else if (need_dx || need_dscale || need_dbias) {
    const at::Tensor x_rows = contiguous(x);
    const at::Tensor dy_rows = contiguous_as(dy, x.scalar_type());
    const at::Tensor valid_rows = contiguous(valid);
    const at::Tensor scale_p = contiguous_as(scale, p);
    const at::Tensor mean_p = centered ? contiguous_as(*mean, p) : at::Tensor();
    const at::Tensor rstd_p = contiguous_as(rstd, p);
    at::Tensor dx_rows;
    if (need_dx) {
      dx_rows = dx.is_contiguous() ? dx : at::detail::empty_cpu(x.sizes(), x.scalar_type());
    }
    run_backward({centered, offset, kernel_dtype(x.scalar_type()), dy_rows.const_data_ptr(),
                  x_rows.const_data_ptr(), valid_rows.const_data_ptr<bool>(),
                  scale_p.const_data_ptr(), centered ? mean_p.const_data_ptr() : nullptr,
                  rstd_p.const_data_ptr(),
                  need_dx ? dx_rows.mutable_data_ptr() : nullptr,
                  need_dscale ? dscale.mutable_data_ptr() : nullptr,
                  need_dbias ? dbias.mutable_data_ptr() : nullptr,
                  kernel_dtype(scale.scalar_type()), rows, C, eps});
    if (need_dx && !dx_rows.is_same(dx)) {
      dx.copy_(dx_rows);
    }
  }
  std::vector<at::Tensor> grads;
  for (at::Tensor* grad : {&dx, &dscale, &dbias}) {
    if (grad->defined()) {
      grads.push_back(*grad);
    }
  }
  return grads;
}

std::vector<at::Tensor> backward(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& valid, const at::Tensor& scale,
    const at::Tensor& mean, const at::Tensor& rstd, double eps, c10::List<bool> output_mask) {
  TORCH_CHECK(output_mask.size() == 3, "maskln native: output_mask must have 3 entries");
  check_contract(x, valid, scale, &scale, eps);  // scale stands for bias: the same rules
  return norm_backward(dy, x, valid, scale, &mean, rstd, eps, 0.0, output_mask[0],
                       output_mask[1], output_mask[2]);
}

std::vector<at::Tensor> backward_py(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& valid, const at::Tensor& scale,
    const at::Tensor& mean, const at::Tensor& rstd, double eps, std::vector<bool> output_mask) {
  TORCH_CHECK(output_mask.size() == 3, "maskln native: output_mask must have 3 entries");
  return norm_backward(dy, x, valid, scale, &mean, rstd, eps, 0.0, output_mask[0],
                       output_mask[1], output_mask[2]);
}

std::vector<at::Tensor> rms_backward(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& valid, const at::Tensor& scale,
    const at::Tensor& rstd, double eps, double offset, c10::List<bool> output_mask) {
  TORCH_CHECK(output_mask.size() == 2, "maskln native: output_mask must have 2 entries");
  check_contract(x, valid, scale, nullptr, eps, offset);
  return norm_backward(dy, x, valid, scale, nullptr, rstd, eps, offset, output_mask[0],
                       output_mask[1], false);
}

std::vector<at::Tensor> rms_backward_py(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& valid, const at::Tensor& scale,
    const at::Tensor& rstd, double eps, double offset, std::vector<bool> output_mask) {
  TORCH_CHECK(output_mask.size() == 2, "maskln native: output_mask must have 2 entries");
  return norm_backward(dy, x, valid, scale, nullptr, rstd, eps, offset, output_mask[0],
                       output_mask[1], false);
}

// --- autograd on CPU: no Python when no derivative can be taken -------------------------------
//
// The ops' autograd is Python (maskln_cli/op/library.py, through autograd.py's Functions), and a
// Python autograd kernel runs on every call of an op whose tensors have autograd's keys, which
// every CPU tensor has: the calls in graphs that torch.compile made (whose inputs require grad,
// under no_grad), or plain torch.ops calls. These kernels, registered for AutogradCPU beside the
// CPU kernels, go below autograd at once when no derivative can be taken, and call the Python
// kernel back otherwise: an input requiring grad with grad mode on, a forward-mode tangent, or
// tensors that only Python can judge (torch.func's wrappers, fake, functional or subclass
// tensors, as when a graph is being traced).

PythonForward* python_forward = nullptr;  // set once from Python, never destroyed
PythonBackward* python_backward = nullptr;
PythonRmsForward* python_rms_forward = nullptr;
PythonRmsBackward* python_rms_backward = nullptr;

void set_python_autograd(PythonForward forward, PythonBackward backward) {
  delete python_forward;
  delete python_backward;
  python_forward = new PythonForward(std::move(forward));
  python_backward = new PythonBackward(std::move(backward));
}

void set_rms_python_autograd(PythonRmsForward forward, PythonRmsBackward backward) {
  delete python_rms_forward;
  delete python_rms_backward;
  python_rms_forward = new PythonRmsForward(std::move(forward));
  python_rms_backward = new PythonRmsBackward(std::move(backward));
}

bool derivative_possible(std::initializer_list<const at::Tensor*> differentiable,
                         std::initializer_list<const at::Tensor*> others) {
  constexpr c10::DispatchKeySet python_judges({
      c10::DispatchKey::FuncTorchGradWrapper,
      c10::DispatchKey::FuncTorchBatched,
      c10::DispatchKey::Functionalize,
      c10::DispatchKey::Python,
  });
  for (auto list : {differentiable, others}) {
    for (const at::Tensor* t : list) {
      if (t->key_set().has_any(python_judges)) {
        return true;
      }
    }
  }
  const bool grad_mode = at::GradMode::is_enabled();
  for (const at::Tensor* t : differentiable) {
    if ((grad_mode && t->requires_grad()) || t->_fw_grad(/*level=*/0).defined()) {
      return true;
    }
  }
  return false;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_autograd(
    c10::DispatchKeySet keys, const at::Tensor& x, const at::Tensor& valid,
    const at::Tensor& scale, const at::Tensor& bias, double eps) {
  if (derivative_possible({&x, &scale, &bias}, {&valid})) {
    TORCH_CHECK(python_forward != nullptr, "maskln native: set_python_autograd was not called");
    return (*python_forward)(keys, x, valid, scale, bias, eps);
  }
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("maskln::masked_layer_norm", "")
                             .typed<decltype(forward)>();
  c10::impl::ExcludeDispatchKeyGuard below_autograd(c10::autograd_dispatch_keyset);
  return op.redispatch(keys & c10::after_autograd_keyset, x, valid, scale, bias, eps);
}

std::vector<at::Tensor> backward_autograd(
    c10::DispatchKeySet keys, const at::Tensor& dy, const at::Tensor& x, const at::Tensor& valid,
    const at::Tensor& scale, const at::Tensor& mean, const at::Tensor& rstd, double eps,
    c10::List<bool> output_mask) {
  if (derivative_possible({&dy, &x, &scale}, {&valid, &mean, &rstd})) {
    TORCH_CHECK(python_backward != nullptr, "maskln native: set_python_autograd was not called");
    return (*python_backward)(keys, dy, x, valid, scale, mean, rstd, eps, output_mask.vec());
  }
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("maskln::masked_layer_norm_backward", "")
                             .typed<decltype(backward)>();
  c10::impl::ExcludeDispatchKeyGuard below_autograd(c10::autograd_dispatch_keyset);
  return op.redispatch(keys & c10::after_autograd_keyset, dy, x, valid, scale, mean, rstd, eps,
                       std::move(output_mask));
}

std::tuple<at::Tensor, at::Tensor> rms_forward_autograd(
    c10::DispatchKeySet keys, const at::Tensor& x, const at::Tensor& valid,
    const at::Tensor& scale, double eps, double offset) {
  if (derivative_possible({&x, &scale}, {&valid})) {
    TORCH_CHECK(python_rms_forward != nullptr,
                "maskln native: set_python_autograd was not called for rms");
    return (*python_rms_forward)(keys, x, valid, scale, eps, offset);
  }
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("maskln::masked_rms_norm", "")
                             .typed<decltype(rms_forward)>();
  c10::impl::ExcludeDispatchKeyGuard below_autograd(c10::autograd_dispatch_keyset);
  return op.redispatch(keys & c10::after_autograd_keyset, x, valid, scale, eps, offset);
}

std::vector<at::Tensor> rms_backward_autograd(
    c10::DispatchKeySet keys, const at::Tensor& dy, const at::Tensor& x, const at::Tensor& valid,
    const at::Tensor& scale, const at::Tensor& rstd, double eps, double offset,
    c10::List<bool> output_mask) {
  if (derivative_possible({&dy, &x, &scale}, {&valid, &rstd})) {
    TORCH_CHECK(python_rms_backward != nullptr,
                "maskln native: set_python_autograd was not called for rms");
    return (*python_rms_backward)(keys, dy, x, valid, scale, rstd, eps, offset,
                                  output_mask.vec());
  }
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("maskln::masked_rms_norm_backward", "")
                             .typed<decltype(rms_backward)>();
  c10::impl::ExcludeDispatchKeyGuard below_autograd(c10::autograd_dispatch_keyset);
  return op.redispatch(keys & c10::after_autograd_keyset, dy, x, valid, scale, rstd, eps, offset,
                       std::move(output_mask));
}

// --- the CPU kernels of maskln's own custom ops -------------------------------------------------

// Registers (or, with enable false, withdraws) forward and backward as the CPU kernels of
// maskln::masked_layer_norm and maskln::masked_layer_norm_backward (and rms_forward and
// rms_backward those of maskln::masked_rms_norm(_backward)), which maskln_cli.op.library
// defines in Python: the dispatcher then calls C++ directly for CPU tensors, ahead of the
// ops' Python implementation (CompositeExplicitAutograd), under their Python autograd and fake
// kernels. Returns whether they were registered before.
bool register_maskln_kernels(bool enable) {
  // The registrations last as long as the Libraries; never destroyed at exit (after the
  // dispatcher, perhaps), only when withdrawn. Called with Python's lock held.
  static torch::Library* cpu = nullptr;
  static torch::Library* autograd = nullptr;
  const bool was = cpu != nullptr;
  if (enable && !was) {
    auto kernels = std::make_unique<torch::Library>(torch::Library::IMPL, "maskln",
                                                    c10::DispatchKey::CPU, __FILE__, __LINE__);
    kernels->impl("masked_layer_norm", TORCH_FN(forward));
    kernels->impl("masked_layer_norm_backward", TORCH_FN(backward));
    kernels->impl("masked_rms_norm", TORCH_FN(rms_forward));
    kernels->impl("masked_rms_norm_backward", TORCH_FN(rms_backward));
    auto derivatives = std::make_unique<torch::Library>(
        torch::Library::IMPL, "maskln", c10::DispatchKey::AutogradCPU, __FILE__, __LINE__);
    derivatives->impl("masked_layer_norm", TORCH_FN(forward_autograd));
    derivatives->impl("masked_layer_norm_backward", TORCH_FN(backward_autograd));
    derivatives->impl("masked_rms_norm", TORCH_FN(rms_forward_autograd));
    derivatives->impl("masked_rms_norm_backward", TORCH_FN(rms_backward_autograd));
    cpu = kernels.release();
    autograd = derivatives.release();
  } else if (!enable && was) {
    delete autograd;
    delete cpu;
    autograd = cpu = nullptr;
  }
  return was;
}

}  // namespace maskln_native
