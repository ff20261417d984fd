// mm_tf32 on CUDA: a @ b (+ bias) in float32 with TF32 products on the tensor cores and float32
// accumulation, through cuBLASLt. vlseq_ext.nn's "tf32" mode runs its GEMMs here because cuDNN's RNNs
// run theirs in TF32 under torch.backends.cudnn.allow_tf32; torch's matmul follows another flag
// (torch.backends.cuda.matmul.allow_tf32), process-wide, so setting it around a call would change
// the GEMMs of every other thread too.
//
// Layouts: each operand as it lies in memory, row-major or column-major (a transposed view) with any
// leading dimension, so `dg[1:].t() @ y[:-1]` copies nothing; anything else is made contiguous first.
// The same bits run to run: one algorithm per shape, layout and alignment, chosen once and cached.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cublasLt.h>
#include <torch/library.h>

#include <array>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

#include "vlseq/arg_checks.h"

namespace vlseq {
namespace {

// 32 MiB: cuBLAS's advice for Hopper; from the caching allocator on the caller's stream, so
// concurrent streams never share it (and a CUDA-graph capture takes it from the graph's pool).
constexpr size_t kWorkspaceBytes = 32u << 20;

void check_cublas(cublasStatus_t status, const char* what) {
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "vlseq_ext::mm_tf32: ", what, " failed: ",
              cublasLtGetStatusString(status));
}

cublasLtHandle_t handle_for(int device) {
  // One handle per device, shared by all threads: cuBLAS allows it (its handles' settings never change
  // here), and cuBLASLt takes the stream and workspace per call (with a workspace of the caller's, its
  // results stay deterministic on concurrent streams: cuBLAS's notes on reproducibility).
  static std::mutex mutex;
  static std::map<int, cublasLtHandle_t> handles;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  cublasLtHandle_t h;
  check_cublas(cublasLtCreate(&h), "cublasLtCreate");
  handles.emplace(device, h);
  return h;
}

// A (rows x cols) tensor as cuBLAS's column-major operand: `transposed` when its memory is the
// column-major matrix itself (a transposed view), else its memory is the column-major transpose.
struct Operand {
  at::Tensor t;  // the tensor read (a contiguous copy when neither layout fits)
  bool transposed;
  int64_t ld;
};

Operand operand(const at::Tensor& t) {
  const int64_t r = t.size(0), c = t.size(1);
  if ((c == 1 || t.stride(1) == 1) && (r == 1 || t.stride(0) >= c))
    return {t, false, r == 1 ? std::max<int64_t>(c, 1) : t.stride(0)};
  if ((r == 1 || t.stride(0) == 1) && (c == 1 || t.stride(1) >= r))
    return {t, true, c == 1 ? std::max<int64_t>(r, 1) : t.stride(1)};
  at::Tensor copy = t.contiguous();
  return {copy, false, std::max<int64_t>(c, 1)};
}

// The largest of 16, 8, 4 bytes dividing both the address and a leading dimension's bytes: what
// cuBLASLt may assume, so part of the cached algorithm's key.
uint32_t alignment(const void* p, int64_t ld) {
  const auto bits = reinterpret_cast<uintptr_t>(p) | static_cast<uintptr_t>(ld * 4);
  for (uint32_t a : {16u, 8u}) if (bits % a == 0) return a;
  return 4;
}

struct Descriptors {
  cublasLtMatmulDesc_t op = nullptr;
  std::array<cublasLtMatrixLayout_t, 3> layouts{};
  cublasLtMatmulPreference_t pref = nullptr;
  ~Descriptors() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    for (auto l : layouts) if (l) cublasLtMatrixLayoutDestroy(l);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

using AlgoKey = std::tuple<int, int64_t, int64_t, int64_t, bool, bool, int64_t, int64_t, bool, uint32_t, uint32_t,
                           uint32_t>;

}  // namespace

at::Tensor mm_tf32_cuda(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias) {
  check_mm(a, b, bias);
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  c10::cuda::CUDAGuard guard(a.device());
  if (m == 0 || n == 0 || k == 0) {  // nothing to multiply: cuBLASLt takes no empty matrices
    at::Tensor out = at::zeros({m, n}, a.options());
    return bias ? out.add_(*bias) : out;
  }
  for (int64_t dim : {m, n, k})
    TORCH_CHECK(dim <= INT32_MAX, "vlseq_ext::mm_tf32: a is ", a.sizes(), " and b is ", b.sizes(),
                ": a dimension past 2^31 - 1");
  // cuBLASLt takes no alignment hint for the bias epilogue: a bias view off 16 bytes goes as a copy.
  at::Tensor bias_c = bias ? bias->contiguous() : at::Tensor();
  if (bias && alignment(bias_c.const_data_ptr(), 0) < 16) bias_c = bias_c.clone();
  // out (m x n, row-major) is column-major out^T (n x m) = b^T a^T: b is cuBLAS's A and a its B.
  Operand ob = operand(b), oa = operand(a);
  at::Tensor out = at::empty({m, n}, a.options());
  // Alignments of cuBLAS's A (b), B (a) and D (out).
  const uint32_t align_a = alignment(ob.t.const_data_ptr(), ob.ld), align_b = alignment(oa.t.const_data_ptr(), oa.ld),
                 align_d = alignment(out.const_data_ptr(), n);

  Descriptors d;
  check_cublas(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F_FAST_TF32, CUDA_R_32F), "cublasLtMatmulDescCreate");
  const cublasOperation_t op_a = ob.transposed ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = oa.transposed ? CUBLAS_OP_T : CUBLAS_OP_N;
  check_cublas(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)), "TRANSA");
  check_cublas(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)), "TRANSB");
  if (bias) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;  // bias[i] added to row i of out^T
    const void* ptr = bias_c.const_data_ptr();
    check_cublas(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)),
                 "EPILOGUE");
    check_cublas(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &ptr, sizeof(ptr)),
                 "BIAS_POINTER");
  }
  // cuBLAS's A: b^T (n x k); its memory is b^T as stored (row-major b) or b itself (transposed view).
  check_cublas(cublasLtMatrixLayoutCreate(&d.layouts[0], CUDA_R_32F, ob.transposed ? k : n, ob.transposed ? n : k,
                                          ob.ld), "layout of b");
  check_cublas(cublasLtMatrixLayoutCreate(&d.layouts[1], CUDA_R_32F, oa.transposed ? m : k, oa.transposed ? k : m,
                                          oa.ld), "layout of a");
  check_cublas(cublasLtMatrixLayoutCreate(&d.layouts[2], CUDA_R_32F, n, m, n), "layout of out");

  const int device = a.get_device();
  cublasLtHandle_t handle = handle_for(device);
  const AlgoKey key{device, m, n, k, ob.transposed, oa.transposed, ob.ld, oa.ld, bool(bias), align_a, align_b,
                    align_d};
  static std::mutex mutex;
  // nullopt: cuBLASLt has none. One entry per shape seen (eager padded batches add one per new length).
  static std::map<AlgoKey, std::optional<cublasLtMatmulAlgo_t>> algos;
  std::optional<cublasLtMatmulAlgo_t> algo;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = algos.find(key);
    if (it != algos.end()) {
      algo = it->second;
    } else {
      check_cublas(cublasLtMatmulPreferenceCreate(&d.pref), "cublasLtMatmulPreferenceCreate");
      const size_t ws = kWorkspaceBytes;
      check_cublas(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                        sizeof(ws)), "MAX_WORKSPACE_BYTES");
      const std::array<std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t>, 4> aligns{{
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a}, {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b},
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_d}, {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d}}};
      for (const auto& [attr, value] : aligns)
        check_cublas(cublasLtMatmulPreferenceSetAttribute(d.pref, attr, &value, sizeof(value)), "MIN_ALIGNMENT");
      cublasLtMatmulHeuristicResult_t result{};
      int found = 0;
      const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
          handle, d.op, d.layouts[0], d.layouts[1], d.layouts[2], d.layouts[2], d.pref, 1, &result, &found);
      if (status != CUBLAS_STATUS_NOT_SUPPORTED) check_cublas(status, "cublasLtMatmulAlgoGetHeuristic");
      if (status == CUBLAS_STATUS_SUCCESS && found > 0) algo = result.algo;
      algos.emplace(key, algo);
    }
  }
  if (!algo)  // no TF32 algorithm for these layouts: torch's GEMM, at least as precise
    return bias ? at::addmm(bias_c, a, b) : at::mm(a, b);
  at::Tensor workspace = at::empty({static_cast<int64_t>(kWorkspaceBytes)}, a.options().dtype(at::kByte));
  const float one = 1.0f, zero = 0.0f;
  check_cublas(cublasLtMatmul(handle, d.op, &one, ob.t.const_data_ptr(), d.layouts[0], oa.t.const_data_ptr(),
                              d.layouts[1], &zero, out.data_ptr(), d.layouts[2], out.data_ptr(), d.layouts[2], &*algo,
                              workspace.data_ptr(), kWorkspaceBytes, c10::cuda::getCurrentCUDAStream(device)),
               "cublasLtMatmul");
  return out;
}

TORCH_LIBRARY_IMPL(vlseq_ext, CUDA, m) { m.impl("mm_tf32", &mm_tf32_cuda); }

}  // namespace vlseq
