// Masked layer normalization on CPU: ATen glue around the row kernels of masked_layer_norm.h.
//
// forward(x, valid, scale, bias, eps) -> (y, mean, rstd)
// backward(dy, x, valid, scale, mean, rstd, eps, output_mask) -> the requested of
//     (dx, dscale, dbias)
//
// Rows are split over threads with at::parallel_for. A row's results never depend on the
// split, and dscale and dbias are sums of per-block sums over fixed blocks of rows (their size
// depends on the shape alone), added in block order in float64: their bits never depend on the
// thread count either.
//
// Instruction sets: the row kernels are compiled three times in this one translation unit,
// for the baseline of the build (x86-64: SSE2), for AVX2+FMA and for AVX-512, through GCC's
// target attribute on thin wrappers that inline (flatten) the whole kernel; the widest the CPU
// supports is picked once at run time (__builtin_cpu_supports). No -march flag: the library
// runs on any x86-64, and elsewhere (ARM, MSVC) only the baseline is built.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

#include "masked_layer_norm.h"

namespace maskln_native {

// --- instruction-set variants ---------------------------------------------------------------

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && !defined(_MSC_VER)
#define MASKLN_X86 1
#define MASKLN_AVX2 __attribute__((target("avx2,fma,f16c"), flatten))
#define MASKLN_AVX512 \
  __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c"), flatten))
#endif
#if defined(__GNUC__)
#define MASKLN_BASE __attribute__((flatten))
#else
#define MASKLN_BASE
#endif

template <typename T>
struct Kernels {
  void (*forward)(const ForwardArgs<T>&, int64_t, int64_t);
  void (*backward)(const BackwardArgs<T>&, int64_t, int64_t, double*, double*);
  void (*backward_sums)(const BackwardArgs<T>&, int64_t, int64_t, double*, double*);
  void (*backward_dx)(const BackwardArgs<T>&, int64_t, int64_t);
  void (*backward_dbias)(const BackwardArgs<T>&, int64_t, int64_t, double*);
};

#define MASKLN_VARIANT(NAME, ATTRIBUTES, W)                                                    \
  template <typename T>                                                                       \
  ATTRIBUTES void forward_##NAME(const ForwardArgs<T>& a, int64_t begin, int64_t end) {       \
    forward_rows<T, W>(a, begin, end);                                                           \
  }                                                                                           \
  template <typename T>                                                                       \
  ATTRIBUTES void backward_##NAME(                                                            \
      const BackwardArgs<T>& a, int64_t begin, int64_t end, double* dscale, double* dbias) {  \
    backward_rows<T, W, true, true>(a, begin, end, dscale, dbias);                                   \
  }                                                                                           \
  template <typename T>                                                                       \
  ATTRIBUTES void backward_sums_##NAME(                                                       \
      const BackwardArgs<T>& a, int64_t begin, int64_t end, double* dscale, double* dbias) {  \
    backward_rows<T, W, false, true>(a, begin, end, dscale, dbias);                                   \
  }                                                                                           \
  template <typename T>                                                                       \
  ATTRIBUTES void backward_dx_##NAME(const BackwardArgs<T>& a, int64_t begin, int64_t end) {  \
    backward_rows<T, W, true, false>(a, begin, end, nullptr, nullptr);                         \
  }                                                                                           \
  template <typename T>                                                                       \
  ATTRIBUTES void backward_dbias_##NAME(                                                      \
      const BackwardArgs<T>& a, int64_t begin, int64_t end, double* dbias) {                  \
    backward_rows_dbias<T, W>(a, begin, end, dbias);                                             \
  }                                                                                           \
  template <typename T>                                                                       \
  Kernels<T> kernels_##NAME() {                                                               \
    return {&forward_##NAME<T>, &backward_##NAME<T>, &backward_sums_##NAME<T>,                \
            &backward_dx_##NAME<T>, &backward_dbias_##NAME<T>};                               \
  }

MASKLN_VARIANT(base, MASKLN_BASE, 2)
#ifdef MASKLN_X86
MASKLN_VARIANT(avx2, MASKLN_AVX2, 4)
MASKLN_VARIANT(avx512, MASKLN_AVX512, 8)
#endif

enum Isa : int { kBase = 0, kAvx2 = 1, kAvx512 = 2 };
const char* const kIsaNames[] = {"base", "avx2", "avx512"};

int supported_isa() {
#ifdef MASKLN_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq")) {
    return kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return kAvx2;
  }
#endif
  return kBase;
}

int parse_isa(const std::string& name) {
  for (int i = 0; i <= kAvx512; ++i) {
    if (name == kIsaNames[i]) {
      return i;
    }
  }
  TORCH_CHECK(false, "maskln native: unknown instruction set '", name,
              "' (expected base, avx2 or avx512)");
}

// The widest supported, or MASKLN_NATIVE_ISA's choice when the CPU supports it.
int initial_isa() {
  const int widest = supported_isa();
  const char* chosen = std::getenv("MASKLN_NATIVE_ISA");
  if (chosen == nullptr || *chosen == '\0') {
    return widest;
  }
  return std::min(parse_isa(chosen), widest);
}

std::atomic<int>& current_isa() {
  static std::atomic<int> isa{initial_isa()};
  return isa;
}

template <typename T>
Kernels<T> kernels() {
#ifdef MASKLN_X86
  switch (current_isa().load(std::memory_order_relaxed)) {
    case kAvx512:
      return kernels_avx512<T>();
    case kAvx2:
      return kernels_avx2<T>();
    default:
      break;
  }
#endif
  return kernels_base<T>();
}

std::string isa() { return kIsaNames[current_isa().load()]; }

// Selects an instruction set (tests compare their bits); returns the previous one.
std::string set_isa(const std::string& name) {
  const int wanted = parse_isa(name);
  TORCH_CHECK(wanted <= supported_isa(), "maskln native: this CPU does not support ", name);
  return kIsaNames[current_isa().exchange(wanted)];
}

// --- shapes, checks and layout --------------------------------------------------------------

constexpr int64_t kGrainElements = 32768;  // below this, a chunk costs more to fork than to run
constexpr int64_t kBlockElements = 16384;  // backward blocks: at least this many elements
constexpr int64_t kMaxBlocks = 64;

bool is_supported(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

at::ScalarType compute_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

void check_inputs(const at::Tensor& x, const at::Tensor& valid, const at::Tensor& scale,
                  const at::Tensor& bias, double eps, bool with_bias) {
  TORCH_CHECK(x.device().is_cpu() && x.layout() == at::kStrided,
              "maskln native: x must be a dense CPU tensor");
  TORCH_CHECK(is_supported(x.scalar_type()),
              "maskln native: x must be float32, float64, float16 or bfloat16, got ",
              x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, "maskln native: x must have a channel axis");
  TORCH_CHECK(valid.scalar_type() == at::kBool && valid.device().is_cpu(),
              "maskln native: valid must be a bool CPU tensor");
  TORCH_CHECK(valid.sizes() == x.sizes().slice(0, x.dim() - 1),
              "maskln native: valid must have x's leading shape ", x.sizes().slice(0, x.dim() - 1),
              ", got ", valid.sizes());
  const int64_t C = x.size(-1);
  const auto p = compute_type(x.scalar_type());
  for (const at::Tensor* param : {&scale, &bias}) {
    if (param == &bias && !with_bias) {
      continue;
    }
    TORCH_CHECK(param->device().is_cpu() && param->dim() == 1 && param->size(0) == C,
                "maskln native: scale and bias must be CPU tensors of shape [", C, "]");
    TORCH_CHECK(param->scalar_type() == x.scalar_type() || param->scalar_type() == p,
                "maskln native: scale and bias must have x's dtype or ", p);
  }
  TORCH_CHECK(eps > 0.0 && std::isfinite(eps), "maskln native: eps must be finite and positive");
}

// t itself when it already has dtype and contiguous rows (no dispatcher call), else a copy.
at::Tensor contiguous_as(const at::Tensor& t, at::ScalarType dtype) {
  if (t.scalar_type() == dtype && t.is_contiguous()) {
    return t;
  }
  return t.to(dtype).contiguous();
}

at::Tensor contiguous(const at::Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }

std::vector<int64_t> statistics_shape(const at::Tensor& x) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = 1;
  return shape;
}

// --- forward --------------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_impl(
    const at::Tensor& x, const at::Tensor& valid, const at::Tensor& scale, const at::Tensor& bias,
    double eps, bool keep_statistics) {
  check_inputs(x, valid, scale, bias, eps, true);
  const auto p = compute_type(x.scalar_type());
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Preserve);
  at::Tensor mean, rstd;
  const int64_t C = x.size(-1);
  const int64_t rows = C == 0 ? valid.numel() : x.numel() / C;
  if (keep_statistics) {
    const auto options = x.options().dtype(p);
    if (C == 0) {  // nothing to normalize: statistics 0, as the composite path
      mean = at::zeros(statistics_shape(x), options);
      rstd = at::zeros(statistics_shape(x), options);
    } else {
      mean = at::empty(statistics_shape(x), options);
      rstd = at::empty(statistics_shape(x), options);
    }
  }
  if (rows == 0 || C == 0) {
    return {y, mean, rstd};
  }
  const at::Tensor x_rows = contiguous(x);
  const at::Tensor valid_rows = contiguous(valid);
  const at::Tensor scale_p = contiguous_as(scale, p);
  const at::Tensor bias_p = contiguous_as(bias, p);
  // y has x's layout (empty_like); rows are written contiguous, and copied when they differ.
  const at::Tensor y_rows = y.is_contiguous() ? y : at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "maskln_forward", [&] {
    using P = typename Compute<scalar_t>::type;
    ForwardArgs<scalar_t> args{
        x_rows.const_data_ptr<scalar_t>(),
        valid_rows.const_data_ptr<bool>(),
        scale_p.const_data_ptr<P>(),
        bias_p.const_data_ptr<P>(),
        y_rows.mutable_data_ptr<scalar_t>(),
        keep_statistics ? mean.mutable_data_ptr<P>() : nullptr,
        keep_statistics ? rstd.mutable_data_ptr<P>() : nullptr,
        C,
        eps};
    const auto kernel = kernels<scalar_t>().forward;
    const int64_t grain = std::max<int64_t>(1, kGrainElements / C);
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) { kernel(args, begin, end); });
  });
  if (!y_rows.is_same(y)) {
    y.copy_(y_rows);
  }
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(
    const at::Tensor& x, const at::Tensor& valid, const at::Tensor& scale, const at::Tensor& bias,
    double eps) {
  return forward_impl(x, valid, scale, bias, eps, true);
}

// --- backward -------------------------------------------------------------------------------

// Rows per block of the parameter sums: at least kBlockElements elements, at most kMaxBlocks
// blocks, and block sums (2 C float64 each) of at most a quarter of x's bytes. From the shape
// and dtype alone, never the thread count.
int64_t block_rows(int64_t rows, int64_t C, int64_t element_size) {
  const int64_t max_blocks =
      std::max<int64_t>(1, std::min<int64_t>(kMaxBlocks, rows * element_size / 64));
  const int64_t by_count = (rows + max_blocks - 1) / max_blocks;
  const int64_t by_size = (kBlockElements + C - 1) / C;
  return std::max<int64_t>(1, std::max(by_count, by_size));
}

// Writes out[c] = sum over blocks b, in order, of partial[b * C + c].
void reduce_blocks(const std::vector<double>& partial, int64_t blocks, int64_t C, at::Tensor& out) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "maskln_sums", [&] {
    scalar_t* data = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, C, kGrainElements / 8, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        double total = 0.0;
        for (int64_t b = 0; b < blocks; ++b) {
          total += partial[b * C + c];
        }
        data[c] = narrow<scalar_t>(total);
      }
    });
  });
}

std::vector<at::Tensor> backward_impl(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& valid, const at::Tensor& scale,
    const at::Tensor& mean, const at::Tensor& rstd, double eps, bool need_dx, bool need_dscale,
    bool need_dbias) {
  check_inputs(x, valid, scale, scale, eps, false);
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.device().is_cpu(),
              "maskln native: dy must have x's shape ", x.sizes(), ", got ", dy.sizes());
  const int64_t C = x.size(-1);
  const int64_t rows = C == 0 ? valid.numel() : x.numel() / C;
  TORCH_CHECK(mean.numel() == rows && rstd.numel() == rows,
              "maskln native: mean and rstd must have one value per row (", rows, ")");
  const auto p = compute_type(x.scalar_type());
  at::Tensor dx, dscale, dbias;
  if (need_dx) {
    dx = at::empty_like(x, at::MemoryFormat::Preserve);
  }
  if (need_dscale) {
    dscale = at::empty({C}, scale.options());
  }
  if (need_dbias) {
    dbias = at::empty({C}, scale.options());
  }
  const bool need_sums = need_dscale || need_dbias;
  if (!need_dx && !need_sums) {
    return {};
  }
  if (rows == 0 || C == 0) {
    for (at::Tensor* sum : {&dscale, &dbias}) {
      if (sum->defined()) {
        sum->zero_();
      }
    }
  } else {
    const at::Tensor x_rows = contiguous(x);
    const at::Tensor dy_rows = contiguous_as(dy, x.scalar_type());
    const at::Tensor valid_rows = contiguous(valid);
    const at::Tensor scale_p = contiguous_as(scale, p);
    const at::Tensor mean_p = contiguous_as(mean, p);
    const at::Tensor rstd_p = contiguous_as(rstd, p);
    at::Tensor dx_rows;
    if (need_dx) {
      dx_rows = dx.is_contiguous() ? dx : at::empty(x.sizes(), x.options());
    }
    const int64_t per_block = block_rows(rows, C, x.element_size());
    const int64_t blocks = need_sums ? (rows + per_block - 1) / per_block : 0;
    std::vector<double> partial_dscale(need_dscale || need_dx ? blocks * C : 0);
    std::vector<double> partial_dbias(need_sums ? blocks * C : 0);
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, x.scalar_type(), "maskln_backward", [&] {
          using P = typename Compute<scalar_t>::type;
          BackwardArgs<scalar_t> args{
              dy_rows.const_data_ptr<scalar_t>(),
              x_rows.const_data_ptr<scalar_t>(),
              valid_rows.const_data_ptr<bool>(),
              scale_p.const_data_ptr<P>(),
              mean_p.const_data_ptr<P>(),
              rstd_p.const_data_ptr<P>(),
              need_dx ? dx_rows.mutable_data_ptr<scalar_t>() : nullptr,
              C,
              eps};
          const Kernels<scalar_t> k = kernels<scalar_t>();
          if (!need_sums) {  // dx alone: any split of the rows
            const int64_t grain = std::max<int64_t>(1, kGrainElements / C);
            at::parallel_for(
                0, rows, grain, [&](int64_t begin, int64_t end) { k.backward_dx(args, begin, end); });
            return;
          }
          at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
            for (int64_t b = first; b < last; ++b) {
              const int64_t begin = b * per_block;
              const int64_t end = std::min(rows, begin + per_block);
              double* block_dbias = partial_dbias.data() + b * C;
              std::fill(block_dbias, block_dbias + C, 0.0);
              if (!need_dscale && !need_dx) {
                k.backward_dbias(args, begin, end, block_dbias);
                continue;
              }
              double* block_dscale = partial_dscale.data() + b * C;
              std::fill(block_dscale, block_dscale + C, 0.0);
              if (need_dx) {
                k.backward(args, begin, end, block_dscale, block_dbias);
              } else {
                k.backward_sums(args, begin, end, block_dscale, block_dbias);
              }
            }
          });
        });
    if (need_dscale) {
      reduce_blocks(partial_dscale, blocks, C, dscale);
    }
    if (need_dbias) {
      reduce_blocks(partial_dbias, blocks, C, dbias);
    }
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
  return backward_impl(dy, x, valid, scale, mean, rstd, eps, output_mask[0], output_mask[1],
                       output_mask[2]);
}

std::vector<at::Tensor> backward_py(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& valid, const at::Tensor& scale,
    const at::Tensor& mean, const at::Tensor& rstd, double eps, std::vector<bool> output_mask) {
  TORCH_CHECK(output_mask.size() == 3, "maskln native: output_mask must have 3 entries");
  return backward_impl(dy, x, valid, scale, mean, rstd, eps, output_mask[0], output_mask[1],
                       output_mask[2]);
}

// --- autograd in C++: forward and backward without Python in between -------------------------

struct MaskedLayerNormFunction : public torch::autograd::Function<MaskedLayerNormFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& valid, const at::Tensor& scale,
                            const at::Tensor& bias, double eps) {
    auto [y, mean, rstd] = forward_impl(x, valid, scale, bias, eps, true);
    ctx->save_for_backward({x, valid, scale, mean, rstd});
    ctx->saved_data["eps"] = eps;
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    // create_graph: these kernels are not differentiable; the composite path is.
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "maskln native autograd: first-order gradients only (create_graph=True needs "
                "maskln's composite path)");
    const auto saved = ctx->get_saved_variables();
    const bool need_dx = ctx->needs_input_grad(0);
    const bool need_dscale = ctx->needs_input_grad(2);
    const bool need_dbias = ctx->needs_input_grad(3);
    const double eps = ctx->saved_data["eps"].toDouble();
    auto grads = backward_impl(grad_outputs[0], saved[0], saved[1], saved[2], saved[3], saved[4],
                               eps, need_dx, need_dscale, need_dbias);
    auto next = grads.begin();
    at::Tensor dx = need_dx ? *next++ : at::Tensor();
    at::Tensor dscale = need_dscale ? *next++ : at::Tensor();
    at::Tensor dbias = need_dbias ? *next++ : at::Tensor();
    return {dx, at::Tensor(), dscale, dbias, at::Tensor()};
  }
};

at::Tensor forward_autograd(const at::Tensor& x, const at::Tensor& valid, const at::Tensor& scale,
                            const at::Tensor& bias, double eps) {
  return MaskedLayerNormFunction::apply(x, valid, scale, bias, eps);
}

}  // namespace maskln_native

// The dispatcher's ops, with the schemas of maskln's own custom ops (maskln::masked_layer_norm
// and maskln::masked_layer_norm_backward), so that either can call or replace the other.
TORCH_LIBRARY(maskln_native, m) {
  m.def("forward(Tensor x, Tensor valid, Tensor scale, Tensor bias, float eps)"
        " -> (Tensor, Tensor, Tensor)");
  m.def("backward(Tensor dy, Tensor x, Tensor valid, Tensor scale, Tensor mean, Tensor rstd,"
        " float eps, bool[] output_mask) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(maskln_native, CPU, m) {
  m.impl("forward", &maskln_native::forward);
  m.impl("backward", &maskln_native::backward);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "maskln's native CPU kernels for masked layer normalization";
  m.def("forward", &maskln_native::forward_impl, pybind11::arg("x"), pybind11::arg("valid"),
        pybind11::arg("scale"), pybind11::arg("bias"), pybind11::arg("eps"),
        pybind11::arg("keep_statistics") = true,
        "(y, mean, rstd); mean and rstd undefined (None) without keep_statistics");
  m.def("backward", &maskln_native::backward_py, pybind11::arg("dy"), pybind11::arg("x"),
        pybind11::arg("valid"), pybind11::arg("scale"), pybind11::arg("mean"),
        pybind11::arg("rstd"), pybind11::arg("eps"), pybind11::arg("output_mask"),
        "The requested of (dx, dscale, dbias), in that order");
  m.def("forward_autograd", &maskln_native::forward_autograd,
        "y, differentiable (first order) through a C++ autograd node");
  m.def("isa", &maskln_native::isa, "The instruction set the kernels run with");
  m.def("set_isa", &maskln_native::set_isa, "Select base, avx2 or avx512; returns the previous");
}
