// CUDA kernels for flatten_ / unflatten_: one launch for a whole tensor list, with on-the-fly
// dtype conversion, a fused scale, 16-byte vector accesses where both sides are aligned and a
// scalar path otherwise.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <vector>

#include "vlseq/dtypes.h"
#include "vlseq/multi_tensor.cuh"
#include "entry.h"

namespace vlseq {
namespace {

constexpr int kThreads = 256;
constexpr int kInlineSegments = 48;
constexpr int64_t kMinWindow = 2048;  // elements: smaller windows only add scheduling
constexpr int64_t kMaxWindow = 4096;  // swept 2K-64K on the H200: 4K was best (BENCHMARKS.md)

// One tensor of the list. `ptr` is the tensor's data (0 for a missing tensor: zeros),
// `offset` its slice start in the flat buffer, `begin` its start in the launch's work split.
struct Segment {
  int64_t ptr;
  int64_t offset;
  int64_t numel;
  int64_t begin;
  int64_t vec_ok;
};

// dst[0:n] = cvt(src[0:n] * scale). VEC elements per vector access. Each thread keeps about 64
// bytes of loads in flight: enough to cover memory latency at full occupancy, and a fixed
// register budget whatever the dtype pair.
template <int VEC, typename S, typename D, typename Op>
__device__ __forceinline__ void copy_piece(const S* __restrict__ src, D* __restrict__ dst, int64_t n, bool vec_ok,
                                           Op scale) {
  constexpr int kUnroll = std::max(1, std::min(4, int(64 / (VEC * sizeof(S)))));
  int64_t done = 0;
  if (vec_ok) {
    const int64_t nv = n / VEC;
    for (int64_t base = threadIdx.x; base < nv; base += kThreads * kUnroll) {
      Vec<S, VEC> in[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = base + u * kThreads;
        if (v < nv) in[u] = reinterpret_cast<const Vec<S, VEC>*>(src)[v];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = base + u * kThreads;
        if (v < nv) {
          Vec<D, VEC> out;
#pragma unroll
          for (int k = 0; k < VEC; ++k) out.v[k] = cvt<D>(cvt<Op>(in[u].v[k]) * scale);
          reinterpret_cast<Vec<D, VEC>*>(dst)[v] = out;
        }
      }
    }
    done = nv * VEC;
  }
  for (int64_t k = done + threadIdx.x; k < n; k += kThreads) dst[k] = cvt<D>(cvt<Op>(src[k]) * scale);
}

template <int VEC, typename D>
__device__ __forceinline__ void zero_piece(D* __restrict__ dst, int64_t n, bool vec_ok) {
  int64_t done = 0;
  if (vec_ok) {
    const int64_t nv = n / VEC;
    Vec<D, VEC> z;
#pragma unroll
    for (int k = 0; k < VEC; ++k) z.v[k] = D(0);
    for (int64_t v = threadIdx.x; v < nv; v += kThreads) reinterpret_cast<Vec<D, VEC>*>(dst)[v] = z;
    done = nv * VEC;
  }
  for (int64_t k = done + threadIdx.x; k < n; k += kThreads) dst[k] = D(0);
}

// kToFlat: flat[seg.offset + i] = seg[i] * scale (flatten_); otherwise the reverse (unflatten_).
// F is the flat buffer's type and T the tensors' type: one instantiation per pair keeps the
// register budget of the common f32/f32 case small (a run-time dtype switch inside the kernel
// made every instantiation pay for the widest pair and spill).
template <typename F, typename T, bool kToFlat, typename Table>
__global__ void __launch_bounds__(kThreads) flatten_kernel(const __grid_constant__ Table table, int64_t total,
                                                            int64_t window, F* flat, double scale) {
  constexpr int VEC = 16 / sizeof(F);
  using Op = opmath_t<F, T>;
  const Op s = static_cast<Op>(scale);
  for_each_piece(table, 0, total, window, [&](const Segment& seg, int64_t begin, int64_t n) {
    F* f = flat + seg.offset + begin;
    const bool vec_ok = seg.vec_ok != 0;
    T* p = reinterpret_cast<T*>(seg.ptr) + begin;
    if constexpr (kToFlat) {
      if (seg.ptr == 0) {
        zero_piece<VEC>(f, n, vec_ok);
      } else {
        copy_piece<VEC, T, F, Op>(p, f, n, vec_ok, s);
      }
    } else {
      copy_piece<VEC, F, T, Op>(f, p, n, vec_ok, s);
    }
  });
}

// The vector path moves 16 bytes of the flat type per access, i.e. 16/sizeof(F) elements; on
// the tensor side that is (16/sizeof(F)) * sizeof(T) bytes, accessed 16 bytes at a time.
bool segment_vec_ok(const Segment& s, const at::Tensor& flat, at::ScalarType tensor_type) {
  const int64_t fsize = flat.element_size();
  const bool flat_ok = is_aligned(static_cast<const char*>(flat.const_data_ptr()) + s.offset * fsize, 16);
  if (s.ptr == 0) return flat_ok;
  const int64_t bytes = std::min<int64_t>(16, (16 / fsize) * c10::elementSize(tensor_type));
  return flat_ok && is_aligned(reinterpret_cast<const void*>(s.ptr), bytes);
}

// Segments grouped by tensor dtype: one launch per group, so a list of one dtype (a model's
// gradients) is one launch however many tensors it has.
using Groups = std::vector<std::pair<at::ScalarType, std::vector<Segment>>>;

void add_to_group(Groups& groups, at::ScalarType t, const Segment& s) {
  for (auto& g : groups) {
    if (g.first == t) {
      g.second.push_back(s);
      return;
    }
  }
  groups.push_back({t, {s}});
}

template <bool kToFlat>
void launch_flatten(Groups& groups, const at::Tensor& flat, double scale) {
  const int device = flat.get_device();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device);
  for (auto& [tensor_type, segs] : groups) {
    const int64_t total = assign_begins(segs);
    if (total == 0) continue;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, flat.scalar_type(), "vlseq_flatten", [&] {
      using F = scalar_t;
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, tensor_type, "vlseq_flatten_t", [&] {
        using T = scalar_t;
        with_table<kInlineSegments>(segs, device, [&](const auto& table) {
          const auto kernel = flatten_kernel<F, T, kToFlat, std::decay_t<decltype(table)>>;
          static const int per_sm = blocks_per_sm(kernel, kThreads);
          const Split split = split_for(device, per_sm, total, kMinWindow, kMaxWindow);
          kernel<<<split.grid, kThreads, 0, stream>>>(table, total, split.window, flat.data_ptr<F>(), scale);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      });
    });
  }
}

}  // namespace

void flatten_run(const c10::List<std::optional<at::Tensor>>& tensors, at::IntArrayRef numels, const at::Tensor& out,
                 double scale) {
  c10::cuda::CUDAGuard guard(out.device());
  std::vector<at::Tensor> keep;  // contiguous copies of strided inputs, alive until launched
  Groups groups;
  int64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::optional<at::Tensor> t = tensors.get(i);
    Segment s{};
    s.offset = offset;
    s.numel = numels[i];
    at::ScalarType type = out.scalar_type();  // a missing tensor (zeros) joins any group
    if (t.has_value() && t->defined() && numels[i] > 0) {
      // Gradients are contiguous in practice; a strided input costs one extra copy here rather
      // than stride tables in the hot kernel.
      keep.push_back(t->contiguous());
      s.ptr = reinterpret_cast<int64_t>(keep.back().const_data_ptr());
      type = t->scalar_type();
    }
    s.vec_ok = segment_vec_ok(s, out, type);
    add_to_group(groups, type, s);
    offset += numels[i];
  }
  launch_flatten<true>(groups, out, scale);
}

void unflatten_run(const at::Tensor& flat, at::TensorList tensors, double scale) {
  c10::cuda::CUDAGuard guard(flat.device());
  std::vector<std::pair<at::Tensor, at::Tensor>> strided;  // (destination, contiguous temporary)
  Groups groups;
  int64_t offset = 0;
  for (const at::Tensor& t : tensors) {
    at::Tensor dst = t;
    if (!t.is_contiguous()) {
      dst = at::empty(t.sizes(), t.options());
      strided.emplace_back(t, dst);
    }
    Segment s{};
    s.ptr = reinterpret_cast<int64_t>(dst.data_ptr());
    s.offset = offset;
    s.numel = t.numel();
    s.vec_ok = segment_vec_ok(s, flat, t.scalar_type());
    add_to_group(groups, t.scalar_type(), s);
    offset += t.numel();
  }
  launch_flatten<false>(groups, flat, scale);
  for (auto& [t, tmp] : strided) t.copy_(tmp);
}

}  // namespace vlseq
