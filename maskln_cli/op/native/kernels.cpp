// The row kernels of masked_layer_norm.h, for both norms (LayerNorm and RMSNorm), compiled for
// three instruction sets and run over threads with at::parallel_for.
//
// Instruction sets: the kernels are compiled three times, for the build's baseline (x86-64:
// SSE2, vectors of 2 float64), for AVX2 (4) and for AVX-512 (8), one translation unit each
// (kernel_variants.h), through GCC's target attribute on thin wrappers that inline (flatten) the
// whole kernel; the widest the CPU supports is picked once, at load (__builtin_cpu_supports),
// or by MASKLN_NATIVE_ISA. No -march flag: the library runs on any x86-64; elsewhere (ARM) only
// the baseline is built. With -ffp-contract=off and sums in a fixed order, all three give the
// same bits.
//
// Threads: a row's results never depend on how rows are split. dscale and dbias are sums of
// per-block sums over fixed blocks of rows (block_rows: from the shape alone), added in block
// order in float64, so their bits never depend on the thread count either.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels.h"
#include "kernel_variants.h"
#include "masked_layer_norm.h"

namespace maskln_native {

// --- which instruction set ------------------------------------------------------------------

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
  for (int i = kBase; i <= kAvx512; ++i) {
    if (name == kIsaNames[i]) {
      return i;
    }
  }
  TORCH_CHECK(false, "maskln native: unknown instruction set '", name,
              "' (expected base, avx2 or avx512)");
}

// The widest supported, or MASKLN_NATIVE_ISA's choice where the CPU supports it.
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

// The kernels of the norm (kCentered: LayerNorm; else RMSNorm) for the current instruction set.
template <typename T, bool kCentered>
Kernels<T> kernels_of_norm() {
#ifdef MASKLN_X86
  switch (current_isa().load(std::memory_order_relaxed)) {
    case kAvx512:
      return kernels_avx512<T, kCentered>();
    case kAvx2:
      return kernels_avx2<T, kCentered>();
    default:
      break;
  }
#endif
  return kernels_base<T, kCentered>();
}

template <typename T>
Kernels<T> kernels(bool centered) {
  return centered ? kernels_of_norm<T, true>() : kernels_of_norm<T, false>();
}

std::string isa() { return kIsaNames[current_isa().load()]; }

bool intra_op_parallel() {
#ifdef INTRA_OP_PARALLEL
  return true;
#else
  return false;
#endif
}

std::string set_isa(const std::string& name) {
  const int wanted = parse_isa(name);
  TORCH_CHECK(wanted <= supported_isa(), "maskln native: this CPU does not support ", name);
  return kIsaNames[current_isa().exchange(wanted)];
}

// --- forward and backward over threads ------------------------------------------------------

constexpr int64_t kGrainElements = 32768;  // below this, a chunk costs more to fork than to run
constexpr int64_t kBlockElements = 16384;  // backward blocks: at least this many elements
constexpr int64_t kMaxBlocks = 64;

// At least kBlockElements elements, at most kMaxBlocks blocks, and block sums (2 C float64 each)
// of at most a quarter of x's bytes.
int64_t block_rows(int64_t rows, int64_t C, int64_t element_size) {
  const int64_t max_blocks =
      std::max<int64_t>(1, std::min<int64_t>(kMaxBlocks, rows * element_size / 64));
  const int64_t by_count = (rows + max_blocks - 1) / max_blocks;
  const int64_t by_size = (kBlockElements + std::max<int64_t>(C, 1) - 1) / std::max<int64_t>(C, 1);
  return std::max<int64_t>(1, std::max(by_count, by_size));
}

int64_t grain_rows(int64_t C) { return std::max<int64_t>(1, kGrainElements / C); }

template <typename T>
void forward_typed(const ForwardCall& c) {
  using P = typename Compute<T>::type;
  const ForwardArgs<T> args{static_cast<const T*>(c.x),     c.valid,
                            static_cast<const P*>(c.scale), static_cast<const P*>(c.bias),
                            static_cast<T*>(c.y),           static_cast<P*>(c.mean),
                            static_cast<P*>(c.rstd),        c.C,
                            c.eps,                          c.offset};
  const auto kernel = kernels<T>(c.centered).forward;
  at::parallel_for(0, c.rows, grain_rows(c.C), [&](int64_t begin, int64_t end) {
    kernel(args, begin, end);
  });
}

// out[c] = the sum over blocks b, in order, of partial[b * C + c], in out's dtype.
template <typename S>
void reduce_blocks(const std::vector<double>& partial, int64_t blocks, int64_t C, void* out) {
  S* data = static_cast<S*>(out);
  at::parallel_for(0, C, kGrainElements / 8, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      double total = 0.0;
      for (int64_t b = 0; b < blocks; ++b) {
        total += partial[b * C + c];
      }
      data[c] = narrow<S>(total);
    }
  });
}

void reduce_blocks(const std::vector<double>& partial, int64_t blocks, int64_t C, void* out,
                   Dtype dtype) {
  switch (dtype) {
    case Dtype::kFloat:
      return reduce_blocks<float>(partial, blocks, C, out);
    case Dtype::kDouble:
      return reduce_blocks<double>(partial, blocks, C, out);
    case Dtype::kHalf:
      return reduce_blocks<c10::Half>(partial, blocks, C, out);
    case Dtype::kBFloat16:
      return reduce_blocks<c10::BFloat16>(partial, blocks, C, out);
  }
}

template <typename T>
void backward_typed(const BackwardCall& c) {
  using P = typename Compute<T>::type;
  const BackwardArgs<T> args{static_cast<const T*>(c.dy),   static_cast<const T*>(c.x),
                             c.valid,                       static_cast<const P*>(c.scale),
                             static_cast<const P*>(c.mean), static_cast<const P*>(c.rstd),
                             static_cast<T*>(c.dx),         c.C,
                             c.eps,                         c.offset};
  const Kernels<T> k = kernels<T>(c.centered);
  const bool need_dx = c.dx != nullptr;
  const bool need_dscale = c.dscale != nullptr;
  const bool need_dbias = c.dbias != nullptr;
  if (!need_dscale && !need_dbias) {  // dx alone: any split of the rows
    if (need_dx) {
      at::parallel_for(0, c.rows, grain_rows(c.C), [&](int64_t begin, int64_t end) {
        k.backward_dx(args, begin, end, nullptr, nullptr);
      });
    }
    return;
  }
  const int64_t per_block = block_rows(c.rows, c.C, sizeof(T));
  const int64_t blocks = (c.rows + per_block - 1) / per_block;
  const bool need_xhat = need_dx || need_dscale;  // else dbias alone: x is not read
  std::vector<double> partial_dscale(need_xhat ? blocks * c.C : 0);
  // LayerNorm's kernels add to dbias whenever they add to dscale; RMSNorm has none
  std::vector<double> partial_dbias(c.centered ? blocks * c.C : 0);
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const int64_t begin = b * per_block;
      const int64_t end = std::min(c.rows, begin + per_block);
      double* block_dbias = c.centered ? partial_dbias.data() + b * c.C : nullptr;
      if (block_dbias != nullptr) {
        std::fill(block_dbias, block_dbias + c.C, 0.0);
      }
      if (!need_xhat) {
        k.backward_dbias(args, begin, end, block_dbias);
        continue;
      }
      double* block_dscale = partial_dscale.data() + b * c.C;
      std::fill(block_dscale, block_dscale + c.C, 0.0);
      (need_dx ? k.backward : k.backward_sums)(args, begin, end, block_dscale, block_dbias);
    }
  });
  if (need_dscale) {
    reduce_blocks(partial_dscale, blocks, c.C, c.dscale, c.sums_dtype);
  }
  if (need_dbias) {
    reduce_blocks(partial_dbias, blocks, c.C, c.dbias, c.sums_dtype);
  }
}

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls body(TypeTag<T>{}) with the C++ type T of dtype: the one switch over the dtypes.
template <typename Body>
void with_element_type(Dtype dtype, Body&& body) {
  switch (dtype) {
    case Dtype::kFloat:
      return body(TypeTag<float>{});
    case Dtype::kDouble:
      return body(TypeTag<double>{});
    case Dtype::kHalf:
      return body(TypeTag<c10::Half>{});
    case Dtype::kBFloat16:
      return body(TypeTag<c10::BFloat16>{});
  }
}

void run_forward(const ForwardCall& call) {
  with_element_type(call.dtype, [&](auto tag) {
    forward_typed<typename decltype(tag)::type>(call);
  });
}

void run_backward(const BackwardCall& call) {
  with_element_type(call.dtype, [&](auto tag) {
    backward_typed<typename decltype(tag)::type>(call);
  });
}

}  // namespace maskln_native
