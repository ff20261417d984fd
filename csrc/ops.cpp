// The whole op surface of vlseq_ext. Kernels live in csrc/cpu (CPU) and csrc/cuda (CUDA);
// fake (meta) implementations and thin wrappers are in vlseq_ext/ops.py.
#include <Python.h>
#include <torch/library.h>

extern "C" {
// Importing vlseq_ext._C loads this shared object, which runs the registrations below.
// No pybind11: the module is empty and built against the limited API.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(vlseq_ext, m) {
  // out[sum(numels[:i]) : sum(numels[:i+1])] = tensors[i].flatten() * scale; None -> zeros.
  // One kernel launch for the whole list on CUDA.
  m.def("flatten_(Tensor?[] tensors, int[] numels, Tensor(a!) out, float scale) -> ()");
  // Inverse of flatten_: tensors[i] = flat[slice i].view_as(tensors[i]) * scale. One launch.
  m.def("unflatten_(Tensor flat, Tensor(a!)[] tensors, float scale) -> ()");
  // One flat buffer per device (distinct devices, same numel/dtype). Afterwards every buffer
  // holds the sum (or mean) over buffers 0..N-1 in that fixed order, bit-identical everywhere.
  // algo: auto | root | one_shot | two_shot | copy_engine (see csrc/cuda/all_reduce.cu).
  m.def("all_reduce_(Tensor(a!)[] buffers, str op, str algo=\"auto\") -> ()");
  // dsts[i] = src for every destination (on other devices), over the peer path.
  m.def("broadcast_(Tensor src, Tensor(a!)[] dsts) -> ()");
  // Fused flatten + all-reduce + unflatten of per-device tensor lists. `tensors` is
  // device-major: num_devices lists of P tensors each. Afterwards tensors[d*P + p] =
  // scale * sum_{e=0..N-1} tensors[e*P + p] for every d, bit-identical on every device.
  // algo: auto | root | two_shot | copy_engine.
  m.def("all_reduce_tensors_(Tensor(a!)[] tensors, int num_devices, float scale, str algo=\"auto\") -> ()");
  // Same layout; the result goes to device list 0 only (one kernel on that device), and with
  // zero_others every other list is zeroed. The trainer's merge before the master's step. Unlike
  // the all-reduces, several lists may be on one device (no tensor may overlap another).
  m.def("reduce_tensors_(Tensor(a!)[] tensors, int num_devices, float scale, bool zero_others) -> ()");
  // Multi-tensor broadcast: dsts is device-major, len(dsts) = k * len(srcs);
  // dsts[d*P + p] = srcs[p]. One kernel on the source device stores into every destination.
  m.def("broadcast_tensors_(Tensor[] srcs, Tensor(a!)[] dsts) -> ()");
  // Which transfer path all_reduce_ would take for these buffers: "p2p", "copy_engine: <why>",
  // "single" (one buffer) or "cpu".
  m.def("p2p_status(Tensor[] buffers) -> str");

  // One LSTM/GRU layer in one direction over a zero-padded batch with per-sample lengths: the
  // recurrence only (input projection before, weight gradients after). Semantics, shapes and
  // outputs: csrc/include/vlseq/rnn.h. On CUDA one persistent launch keeps W_hh on chip for all
  // steps (csrc/cuda/rnn.cu). cell: lstm | gru; weights: fp32 | tf32 | bf16 (the
  // recurrent products' precision: vlseq/rnn_types.h).
  // max_blocks: the SMs the launch may plan for (0: the whole GPU; half of it lets a bidirectional
  // layer's two directions run side by side). Forward and backward of a layer must pass the same.
  m.def("rnn_forward(str cell, Tensor xproj, Tensor w_hh, Tensor? b_hh, Tensor h0, Tensor? c0, Tensor lengths, "
        "bool reverse, str weights, int max_blocks=0) -> (Tensor y, Tensor h_n, Tensor c_n, Tensor saved, Tensor cs)");
  m.def("rnn_backward(str cell, Tensor w_hh, Tensor y, Tensor saved, Tensor cs, Tensor h0, Tensor? c0, "
        "Tensor lengths, Tensor? dy, Tensor? dh_n, Tensor? dc_n, bool reverse, str weights, int max_blocks=0) "
        "-> (Tensor dgates, Tensor dgates_hn, Tensor dh0, Tensor dc0)");
  // How the kernels would run a layer of this size on `like`'s device: on CUDA the layout ("cluster
  // 16 x 2 groups, ..."), or "" when W_hh does not fit on chip (vlseq_ext.nn then falls back to
  // torch's RNN); "cpu" on the CPU.
  m.def("rnn_plan(str cell, int hidden_size, int batch, str weights, Tensor like, int max_blocks=0) -> str");
  // a @ b (+ bias) of float32 matrices, a new (m, n) tensor: on CUDA with TF32 products on the tensor
  // cores whatever torch's matmul flag says (the GEMMs of vlseq_ext.nn's "tf32" mode, as cuDNN's RNNs
  // run theirs under torch.backends.cudnn.allow_tf32; csrc/cuda/mm_tf32.cpp), exact on the CPU.
  m.def("mm_tf32(Tensor a, Tensor b, Tensor? bias=None) -> Tensor");
}
