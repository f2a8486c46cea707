// The prototype's torch extension: the row kernels of ff_rows.h compiled for three instruction
// sets, run over torch's threads, on tensors, as plain pybind functions (not the op: phase one
// of issue 40, not wired into maskln_cli).
//
//   forward(x, valid, scale, bias, eps, centered=True) -> (y, mean, rstd)
//   backward(dy, x, valid, scale, mean, eps, output_mask, centered=True) -> [dx, dscale, dbias]
//       (None where output_mask says not wanted)
//   isa() -> "avx512" | "avx2" | "base";  set_isa(name) -> the previous one
//
// Instruction sets as maskln_cli/op/native/kernels.cpp: the kernels compiled three times in
// this unit, for the baseline (SSE2 on x86-64), AVX2 + FMA and AVX-512, through GCC's target
// attribute on thin wrappers that inline (flatten) the whole kernel; the widest the CPU has is
// picked at load, or by MASKLN_NATIVE_ISA. Threads: rows split anyhow in the forward; the
// backward's column sums go by fixed blocks of rows (from the shape alone), each block's ff
// sums added in block order: the bits never depend on the thread count.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "ff_rows.h"

namespace maskln_f32 {

#define MASKLN_F32_BASE __attribute__((flatten))
#ifdef MASKLN_F32_X86
#define MASKLN_F32_AVX2 __attribute__((target("avx2,fma,f16c"), flatten))
#define MASKLN_F32_AVX512 \
  __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c"), flatten))
#endif

template <typename T>
using ForwardKernel = void (*)(const ForwardArgs<T>&, const Constants&, int64_t, int64_t);
template <typename T>
using BackwardKernel = void (*)(const BackwardArgs<T>&, const Constants&, int64_t, int64_t,
                                ColumnSums*);

#define MASKLN_F32_VARIANT(NAME, ATTRIBUTES, ISA)                                             \
  template <typename T, bool kCentered>                                                      \
  ATTRIBUTES void forward_##NAME(const ForwardArgs<T>& a, const Constants& k, int64_t begin, \
                                 int64_t end) {                                              \
    forward_rows<ISA, kCentered, T>(a, k, begin, end);                                       \
  }                                                                                          \
  template <typename T, bool kCentered, bool kDx, bool kSums>                                \
  ATTRIBUTES void backward_##NAME(const BackwardArgs<T>& a, const Constants& k,              \
                                  int64_t begin, int64_t end, ColumnSums* sums) {            \
    backward_rows<ISA, kCentered, kDx, kSums, T>(a, k, begin, end, sums);                    \
  }

MASKLN_F32_VARIANT(base, MASKLN_F32_BASE, Portable)
#ifdef MASKLN_F32_X86
MASKLN_F32_VARIANT(avx2, MASKLN_F32_AVX2, Avx2)
MASKLN_F32_VARIANT(avx512, MASKLN_F32_AVX512, Avx512)
#endif

// --- which instruction set ------------------------------------------------------------------

enum Isa : int { kBase = 0, kAvx2 = 1, kAvx512 = 2 };
const char* const kIsaNames[] = {"base", "avx2", "avx512"};

int supported_isa() {
#ifdef MASKLN_F32_X86
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
  for (int i = kBase; i <= kAvx512; ++i) {
    if (name == kIsaNames[i]) {
      return i;
    }
  }
  TORCH_CHECK(false, "maskln f32: unknown instruction set '", name, "'");
}

std::atomic<int>& current_isa() {
  static std::atomic<int> isa{[] {
    const char* chosen = std::getenv("MASKLN_NATIVE_ISA");
    const int widest = supported_isa();
    return chosen == nullptr || *chosen == '\0' ? widest : std::min(parse_isa(chosen), widest);
  }()};
  return isa;
}

std::string isa() { return kIsaNames[current_isa().load()]; }

std::string set_isa(const std::string& name) {
  const int wanted = parse_isa(name);
  TORCH_CHECK(wanted <= supported_isa(), "maskln f32: this CPU does not support ", name);
  return kIsaNames[current_isa().exchange(wanted)];
}

template <typename T, bool kCentered>
ForwardKernel<T> forward_kernel() {
#ifdef MASKLN_F32_X86
  switch (current_isa().load(std::memory_order_relaxed)) {
    case kAvx512:
      return &forward_avx512<T, kCentered>;
    case kAvx2:
      return &forward_avx2<T, kCentered>;
    default:
      break;
  }
#endif
  return &forward_base<T, kCentered>;
}

template <typename T, bool kCentered, bool kDx, bool kSums>
BackwardKernel<T> backward_kernel() {
#ifdef MASKLN_F32_X86
  switch (current_isa().load(std::memory_order_relaxed)) {
    case kAvx512:
      return &backward_avx512<T, kCentered, kDx, kSums>;
    case kAvx2:
      return &backward_avx2<T, kCentered, kDx, kSums>;
    default:
      break;
  }
#endif
  return &backward_base<T, kCentered, kDx, kSums>;
}

// --- over threads -----------------------------------------------------------------------------

constexpr int64_t kGrainElements = 32768;
constexpr int64_t kBlockElements = 16384;
constexpr int64_t kMaxBlocks = 64;

int64_t grain_rows(int64_t C) { return std::max<int64_t>(1, kGrainElements / C); }

// As maskln_cli/op/native/kernels.cpp: from the shape alone.
int64_t block_rows(int64_t rows, int64_t C, int64_t element_size) {
  const int64_t max_blocks =
      std::max<int64_t>(1, std::min<int64_t>(kMaxBlocks, rows * element_size / 64));
  const int64_t by_count = (rows + max_blocks - 1) / max_blocks;
  const int64_t by_size = (kBlockElements + std::max<int64_t>(C, 1) - 1) / std::max<int64_t>(C, 1);
  return std::max<int64_t>(1, std::max(by_count, by_size));
}

template <typename T, bool kCentered>
void forward_typed(const ForwardArgs<T>& args, int64_t rows, double eps) {
  const Constants k = constants(args.C, eps);
  const auto kernel = forward_kernel<T, kCentered>();
  at::parallel_for(0, rows, grain_rows(args.C),
                   [&](int64_t begin, int64_t end) { kernel(args, k, begin, end); });
}

// out[c] = the ff sum over blocks b, in order, of (hi, lo)[b * C + c], rounded to float.
void reduce_blocks(const std::vector<float>& hi, const std::vector<float>& lo, int64_t blocks,
                   int64_t C, float* out) {
  for (int64_t c = 0; c < C; ++c) {
    float h = hi[c], l = lo[c];
    for (int64_t b = 1; b < blocks; ++b) {
      const float bh = hi[b * C + c], bl = lo[b * C + c];
      const float s = h + bh;
      const float bb = s - h;
      float e = (h - (s - bb)) + (bh - bb);
      e = e + (l + bl);
      h = s + e;
      l = e - (h - s);
    }
    out[c] = h + l;
  }
}

template <typename T, bool kCentered>
void backward_typed(const BackwardArgs<T>& args, int64_t rows, double eps, float* dscale,
                    float* dbias) {
  const Constants k = constants(args.C, eps);
  const int64_t C = args.C;
  const bool need_dx = args.dx != nullptr;
  const bool need_sums = dscale != nullptr || dbias != nullptr;
  if (!need_sums) {
    if (need_dx) {
      const auto kernel = backward_kernel<T, kCentered, true, false>();
      at::parallel_for(0, rows, grain_rows(C), [&](int64_t begin, int64_t end) {
        kernel(args, k, begin, end, nullptr);
      });
    }
    return;
  }
  const auto kernel = need_dx ? backward_kernel<T, kCentered, true, true>()
                              : backward_kernel<T, kCentered, false, true>();
  const int64_t per_block = block_rows(rows, C, sizeof(T));
  const int64_t blocks = (rows + per_block - 1) / per_block;
  std::vector<float> ds_hi(blocks * C, 0.0f), ds_lo(blocks * C, 0.0f);
  std::vector<float> db_hi(blocks * C, 0.0f), db_lo(blocks * C, 0.0f);
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      ColumnSums sums{ds_hi.data() + b * C, ds_lo.data() + b * C, db_hi.data() + b * C,
                      db_lo.data() + b * C, 0};
      kernel(args, k, b * per_block, std::min(rows, (b + 1) * per_block), &sums);
    }
  });
  if (dscale != nullptr) {
    reduce_blocks(ds_hi, ds_lo, blocks, C, dscale);
  }
  if (dbias != nullptr) {
    reduce_blocks(db_hi, db_lo, blocks, C, dbias);
  }
}

// --- tensors ----------------------------------------------------------------------------------

template <typename Body>
void with_element_type(at::ScalarType t, Body&& body) {
  switch (t) {
    case at::kFloat:
      return body(float{});
    case at::kHalf:
      return body(c10::Half{});
    case at::kBFloat16:
      return body(c10::BFloat16{});
    default:
      TORCH_CHECK(false, "maskln f32: x must be float32, float16 or bfloat16, got ", t);
  }
}

void check(const at::Tensor& x, const at::Tensor& valid, const at::Tensor& scale) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1, "maskln f32: x must be a CPU tensor");
  TORCH_CHECK(valid.scalar_type() == at::kBool &&
                  valid.sizes() == x.sizes().slice(0, x.dim() - 1),
              "maskln f32: valid must be bool of x's leading shape");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == x.size(-1), "maskln f32: scale must be [C]");
  TORCH_CHECK(x.size(-1) > 0 && x.size(-1) < (int64_t{1} << 31), "maskln f32: 0 < C < 2^31");
}

std::vector<int64_t> statistics_shape(const at::Tensor& x) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = 1;
  return shape;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(
    const at::Tensor& x_in, const at::Tensor& valid_in, const at::Tensor& scale_in,
    const std::optional<at::Tensor>& bias_in, double eps, bool centered) {
  check(x_in, valid_in, scale_in);
  TORCH_CHECK(!centered || bias_in.has_value(), "maskln f32: LayerNorm needs a bias");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor valid = valid_in.contiguous();
  const at::Tensor scale = scale_in.to(at::kFloat).contiguous();
  const at::Tensor bias = centered ? bias_in->to(at::kFloat).contiguous() : scale;
  at::Tensor y = at::empty_like(x);
  at::Tensor mean = at::empty(statistics_shape(x), x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty(statistics_shape(x), x.options().dtype(at::kFloat));
  const int64_t rows = valid.numel();
  if (rows == 0) {
    return {y, mean, rstd};
  }
  with_element_type(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const ForwardArgs<T> args{x.const_data_ptr<T>(),      valid.const_data_ptr<bool>(),
                              scale.const_data_ptr<float>(), bias.const_data_ptr<float>(),
                              y.mutable_data_ptr<T>(),    mean.mutable_data_ptr<float>(),
                              rstd.mutable_data_ptr<float>(), x.size(-1)};
    pybind11::gil_scoped_release no_gil;
    if (centered) {
      forward_typed<T, true>(args, rows, eps);
    } else {
      forward_typed<T, false>(args, rows, eps);
    }
  });
  return {y, mean, rstd};
}

std::vector<std::optional<at::Tensor>> backward(
    const at::Tensor& dy_in, const at::Tensor& x_in, const at::Tensor& valid_in,
    const at::Tensor& scale_in, const std::optional<at::Tensor>& mean_in, double eps,
    std::vector<bool> output_mask, bool centered) {
  check(x_in, valid_in, scale_in);
  TORCH_CHECK(dy_in.sizes() == x_in.sizes(), "maskln f32: dy must have x's shape");
  TORCH_CHECK(output_mask.size() == 3, "maskln f32: output_mask has 3 entries");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor dy = dy_in.to(x.scalar_type()).contiguous();
  const at::Tensor valid = valid_in.contiguous();
  const at::Tensor scale = scale_in.to(at::kFloat).contiguous();
  at::Tensor mean;
  if (mean_in.has_value()) {
    mean = mean_in->to(at::kFloat).contiguous();
    TORCH_CHECK(mean.numel() == valid.numel(), "maskln f32: mean must have one value per row");
  }
  const int64_t C = x.size(-1);
  at::Tensor dx, dscale, dbias;
  if (output_mask[0]) {
    dx = at::empty_like(x);
  }
  if (output_mask[1]) {
    dscale = at::zeros({C}, x.options().dtype(at::kFloat));
  }
  if (output_mask[2] && centered) {
    dbias = at::zeros({C}, x.options().dtype(at::kFloat));
  }
  const int64_t rows = valid.numel();
  if (rows > 0 && (dx.defined() || dscale.defined() || dbias.defined())) {
    with_element_type(x.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      const BackwardArgs<T> args{dy.const_data_ptr<T>(),
                                 x.const_data_ptr<T>(),
                                 valid.const_data_ptr<bool>(),
                                 scale.const_data_ptr<float>(),
                                 mean.defined() ? mean.const_data_ptr<float>() : nullptr,
                                 dx.defined() ? dx.mutable_data_ptr<T>() : nullptr,
                                 C};
      float* ds = dscale.defined() ? dscale.mutable_data_ptr<float>() : nullptr;
      float* db = dbias.defined() ? dbias.mutable_data_ptr<float>() : nullptr;
      pybind11::gil_scoped_release no_gil;
      if (centered) {
        backward_typed<T, true>(args, rows, eps, ds, db);
      } else {
        backward_typed<T, false>(args, rows, eps, ds, db);
      }
    });
  }
  std::vector<std::optional<at::Tensor>> out;
  for (at::Tensor* t : {&dx, &dscale, &dbias}) {
    out.push_back(t->defined() ? std::optional<at::Tensor>(*t) : std::nullopt);
  }
  return out;
}

}  // namespace maskln_f32

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "maskln's float32 compensated-arithmetic kernels (prototype, issue 40)";
  m.def("forward", &maskln_f32::forward, py::arg("x"), py::arg("valid"), py::arg("scale"),
        py::arg("bias"), py::arg("eps"), py::arg("centered") = true);
  m.def("backward", &maskln_f32::backward, py::arg("dy"), py::arg("x"), py::arg("valid"),
        py::arg("scale"), py::arg("mean"), py::arg("eps"), py::arg("output_mask"),
        py::arg("centered") = true);
  m.def("isa", &maskln_f32::isa);
  m.def("set_isa", &maskln_f32::set_isa, py::arg("name"));
  m.def("block_rows", &maskln_f32::block_rows);
}
