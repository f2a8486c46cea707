// The Python module: plain functions through pybind11, the cheapest way in from Python.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "kernels.h"
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "maskln's native CPU kernels for masked layer and RMS normalization";
  // The kernels run without Python's lock (arguments are converted before it is released, the
  // results after it is taken again): other Python threads, a data loader's or a server's, go
  // on meanwhile, as they do beside torch's own ops. Nothing in them calls Python.
  m.def("forward", &maskln_native::forward_impl, py::arg("x"), py::arg("valid"),
        py::arg("scale"), py::arg("bias"), py::arg("eps"), py::arg("keep_statistics") = true,
        py::call_guard<py::gil_scoped_release>(),
        "(y, mean, rstd); mean and rstd are None without keep_statistics");
  m.def("backward", &maskln_native::backward_py, py::arg("dy"), py::arg("x"), py::arg("valid"),
        py::arg("scale"), py::arg("mean"), py::arg("rstd"), py::arg("eps"),
        py::arg("output_mask"), py::call_guard<py::gil_scoped_release>(),
        "The requested of (dx, dscale, dbias), in that order");
  m.def("rms_forward", &maskln_native::rms_forward_impl, py::arg("x"), py::arg("valid"),
        py::arg("scale"), py::arg("eps"), py::arg("offset"), py::arg("keep_statistics") = true,
        py::call_guard<py::gil_scoped_release>(),
        "RMSNorm's (y, rstd); rstd is None without keep_statistics");
  m.def("rms_backward", &maskln_native::rms_backward_py, py::arg("dy"), py::arg("x"),
        py::arg("valid"), py::arg("scale"), py::arg("rstd"), py::arg("eps"), py::arg("offset"),
        py::arg("output_mask"), py::call_guard<py::gil_scoped_release>(),
        "RMSNorm's requested of (dx, dscale), in that order");
  // With Python's lock held: a check of a few fields costs less than releasing it.
  m.def(
      "within_contract",
      [](const at::Tensor& x, const at::Tensor& valid, const at::Tensor& scale,
         const std::optional<at::Tensor>& bias, double eps, double offset) {
        return maskln_native::within_contract(x, valid, scale, bias ? &*bias : nullptr, eps,
                                              offset);
      },
      py::arg("x"), py::arg("valid"), py::arg("scale"), py::arg("bias"), py::arg("eps"),
      py::arg("offset"),
      "Whether the inputs meet the op's contract (bias None: RMSNorm's); never raises");
  m.def("register_maskln_kernels", &maskln_native::register_maskln_kernels,
        py::arg("enable") = true,
        "Make forward and backward the CPU kernels of maskln::masked_layer_norm(_backward),"
        " and rms_forward and rms_backward those of maskln::masked_rms_norm(_backward)"
        " (enable=False withdraws them); returns whether they were registered");
  m.def(
      "set_contract_error",
      [](py::function report) {
        // Held for the life of the process: never destroyed after the interpreter.
        auto* held = new py::function(std::move(report));
        maskln_native::set_contract_error([held](const at::Tensor& x, const at::Tensor& valid,
                                                 const at::Tensor& scale, const at::Tensor& bias,
                                                 double eps, double offset) {
          py::gil_scoped_acquire gil;
          // raises: error_already_set reaches Python. An undefined bias (RMSNorm's) is None.
          (*held)(x, valid, scale, bias, eps, offset);
        });
      },
      py::arg("report"),
      "The Python function the dispatcher ops call, for its error, on inputs outside the"
      " op's contract: report(x, valid, scale, bias, eps, offset), bias None for RMSNorm");
  m.def(
      "set_python_autograd",
      [](const std::string& norm, py::function forward, py::function backward) {
        // Held for the life of the process, as the contract error's function.
        auto* held_forward = new py::function(std::move(forward));
        auto* held_backward = new py::function(std::move(backward));
        if (norm == "rms") {
          maskln_native::set_rms_python_autograd(
              [held_forward](c10::DispatchKeySet keys, const at::Tensor& x,
                             const at::Tensor& valid, const at::Tensor& scale, double eps,
                             double offset) {
                py::gil_scoped_acquire gil;
                return (*held_forward)(keys, x, valid, scale, eps, offset)
                    .cast<std::tuple<at::Tensor, at::Tensor>>();
              },
              [held_backward](c10::DispatchKeySet keys, const at::Tensor& dy,
                              const at::Tensor& x, const at::Tensor& valid,
                              const at::Tensor& scale, const at::Tensor& rstd, double eps,
                              double offset, std::vector<bool> output_mask) {
                py::gil_scoped_acquire gil;
                return (*held_backward)(keys, dy, x, valid, scale, rstd, eps, offset,
                                        output_mask)
                    .cast<std::vector<at::Tensor>>();
              });
          return;
        }
        TORCH_CHECK(norm == "layer", "maskln native: unknown norm '", norm, "'");
        maskln_native::set_python_autograd(
            [held_forward](c10::DispatchKeySet keys, const at::Tensor& x, const at::Tensor& valid,
                           const at::Tensor& scale, const at::Tensor& bias, double eps) {
              py::gil_scoped_acquire gil;
              return (*held_forward)(keys, x, valid, scale, bias, eps)
                  .cast<std::tuple<at::Tensor, at::Tensor, at::Tensor>>();
            },
            [held_backward](c10::DispatchKeySet keys, const at::Tensor& dy, const at::Tensor& x,
                            const at::Tensor& valid, const at::Tensor& scale,
                            const at::Tensor& mean, const at::Tensor& rstd, double eps,
                            std::vector<bool> output_mask) {
              py::gil_scoped_acquire gil;
              return (*held_backward)(keys, dy, x, valid, scale, mean, rstd, eps, output_mask)
                  .cast<std::vector<at::Tensor>>();
            });
      },
      py::arg("norm"), py::arg("forward"), py::arg("backward"),
      "A norm's ('layer' or 'rms') Python autograd kernels, which the C++ ones call when a"
      " derivative may be taken, with the op's own arguments after the dispatch keyset");
  m.def("isa", &maskln_native::isa, "The instruction set the kernels run with");
  m.def("intra_op_parallel", &maskln_native::intra_op_parallel,
        "Whether the kernels' loops run on torch's intra-op threads (built with OpenMP)");
  m.def("set_isa", &maskln_native::set_isa, py::arg("name"),
        "Select base, avx2 or avx512 (tests compare their bits); returns the previous one");
}
