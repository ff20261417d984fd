// The recurrent layer ops (rnn_forward / rnn_backward): what they compute, their sizes, and the
// argument checks shared by the CPU and CUDA kernels.
//
// One layer in one direction of an LSTM or GRU over a zero-padded batch with per-sample lengths.
// The input projection x_t W_ih^T + b_ih of every step is one GEMM before the call (`xproj`), and
// the weight gradients are GEMMs after rnn_backward (vlseq_ext/nn/functional.py); the ops hold
// only the recurrence, the part that is a chain of dependent steps.
//
// Gates, in torch's order: LSTM i, f, g, o (G = 4); GRU r, z, n (G = 3). With gh = W_hh h + b_hh:
//   LSTM  c' = sigmoid(f) * c + sigmoid(i) * tanh(g), h' = sigmoid(o) * tanh(c')
//   GRU   r = sigmoid(x_r + gh_r), z = sigmoid(x_z + gh_z), n = tanh(x_n + r * gh_n),
//         h' = (1 - z) * n + z * h
// Sample b runs its own len_b steps (t = 0 .. len_b-1, or len_b-1 .. 0 with reverse) and then
// stops: its state freezes, its outputs there are zero and its gradients there are zero, so every
// result equals that of the unpadded sample alone.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

#include "vlseq/rnn_types.h"

namespace vlseq::rnn {

Cell parse_cell(const char* op, const std::string& name);
Weights parse_weights(const char* op, const std::string& name);

struct Sizes {
  Cell cell;
  Weights weights;
  int64_t B, T, H;
  int64_t max_blocks;  // the SMs a launch may plan for, 0: the whole GPU (ignored on the CPU)
};

// rnn_forward(cell, xproj (B, T, G*H), w_hh (G*H, H), b_hh (G*H)?, h0 (B, H), c0 (B, H)? [LSTM
// only], lengths (B,) int64, reverse, weights) -> (y (B, T, H), h_n (B, H), c_n (B, H) [empty for
// GRU], saved (B, T, 4H), cs (B, T, H) [empty for GRU]). All float32, contiguous, on one device.
// saved holds what backward needs at every step, each unit's four together (saved[b, t, 4j + f], one
// 16-byte store and load per unit and step): LSTM [i, f, g, o] after their activations, GRU
// [r, z, n, W_hn h + b_hn]; cs the LSTM cell states.
Sizes check_forward(const std::string& cell, const at::Tensor& xproj, const at::Tensor& w_hh,
                    const std::optional<at::Tensor>& b_hh, const at::Tensor& h0, const std::optional<at::Tensor>& c0,
                    const at::Tensor& lengths, const std::string& weights, int64_t max_blocks);

// rnn_backward(cell, w_hh, y, saved, cs, h0, c0?, lengths, dy?, dh_n?, dc_n?, reverse, weights)
//   -> (dgates (B, T, G*H): d loss / d xproj, zero at padded steps;
//       dgates_hn (B, T, H) [GRU only, else empty]: d loss / d (W_hn h + b_hn), so that the
//         recurrent pre-activation gradient is [dgates_r, dgates_z, dgates_hn];
//       dh0 (B, H), dc0 (B, H) [empty for GRU]).
// Missing dy / dh_n / dc_n count as zeros.
Sizes check_backward(const std::string& cell, const at::Tensor& w_hh, const at::Tensor& y, const at::Tensor& saved,
                     const at::Tensor& cs, const at::Tensor& h0, const std::optional<at::Tensor>& c0,
                     const at::Tensor& lengths, const std::optional<at::Tensor>& dy,
                     const std::optional<at::Tensor>& dh_n, const std::optional<at::Tensor>& dc_n,
                     const std::string& weights, int64_t max_blocks);

// rnn_plan(cell, hidden_size, batch, weights, like, max_blocks): its arguments (T = 1).
Sizes check_plan(const std::string& cell, int64_t hidden_size, int64_t batch, const std::string& weights,
                 int64_t max_blocks);

}  // namespace vlseq::rnn
