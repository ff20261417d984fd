// CPU kernels of rnn_forward / rnn_backward (semantics: vlseq/rnn.h). Plain loops, one sample per
// task: they define on every machine what the GPU kernels must compute, so CI tests the op surface
// and the autograd around it (vlseq_ext/nn) without a GPU. The modules themselves run torch's own
// CPU RNN, which is faster.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "vlseq/rnn.h"

namespace vlseq::rnn {
namespace {

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// W_hh as the products read it: bf16 mode rounds every weight once, as the GPU kernels hold them (tf32
// mode computes in fp32 here).
std::vector<float> recurrent_weights(const at::Tensor& w_hh, Weights weights) {
  const float* w = w_hh.const_data_ptr<float>();
  std::vector<float> out(w, w + w_hh.numel());
  if (weights == Weights::kBF16)
    for (float& v : out) v = static_cast<float>(c10::BFloat16(v));
  return out;
}

// Step s of a sample of length L runs at time index t(s).
int64_t time_index(int64_t s, int64_t L, bool reverse) { return reverse ? L - 1 - s : s; }

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> rnn_forward_cpu(
    c10::string_view cell, const at::Tensor& xproj, const at::Tensor& w_hh, const std::optional<at::Tensor>& b_hh,
    const at::Tensor& h0, const std::optional<at::Tensor>& c0, const at::Tensor& lengths, bool reverse,
    c10::string_view weights, int64_t max_blocks) {
  const Sizes z =
      check_forward(std::string(cell), xproj, w_hh, b_hh, h0, c0, lengths, std::string(weights), max_blocks);
  const bool lstm = z.cell == Cell::kLSTM;
  const int64_t B = z.B, T = z.T, H = z.H, G = num_gates(z.cell), GH = G * H;
  auto opts = xproj.options();
  at::Tensor y = at::zeros({B, T, H}, opts), h_n = at::empty({B, H}, opts);
  at::Tensor c_n = lstm ? at::empty({B, H}, opts) : at::empty({0}, opts);
  at::Tensor saved = at::zeros({B, T, 4 * H}, opts);
  at::Tensor cs = lstm ? at::zeros({B, T, H}, opts) : at::empty({0}, opts);
  const std::vector<float> W = recurrent_weights(w_hh, z.weights);
  const float* bias = b_hh.has_value() && b_hh->defined() ? b_hh->const_data_ptr<float>() : nullptr;
  const float* xp = xproj.const_data_ptr<float>();
  const int64_t* len = lengths.const_data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> h(H), c(H), gh(GH);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t L = clamp_length(len[b], T);
      for (int64_t j = 0; j < H; ++j) {
        h[j] = h0.const_data_ptr<float>()[b * H + j];
        c[j] = lstm ? c0->const_data_ptr<float>()[b * H + j] : 0.0f;
      }
      for (int64_t s = 0; s < L; ++s) {
        const int64_t t = time_index(s, L, reverse);
        for (int64_t r = 0; r < GH; ++r) {
          float acc = 0.0f;
          for (int64_t k = 0; k < H; ++k) acc += W[r * H + k] * h[k];
          gh[r] = acc + (bias ? bias[r] : 0.0f);
        }
        const float* x = xp + (b * T + t) * GH;
        float* sv = saved.data_ptr<float>() + (b * T + t) * 4 * H;
        float* yt = y.data_ptr<float>() + (b * T + t) * H;
        for (int64_t j = 0; j < H; ++j) {
          if (lstm) {
            const float i = sigmoid(x[j] + gh[j]), f = sigmoid(x[H + j] + gh[H + j]);
            const float g = std::tanh(x[2 * H + j] + gh[2 * H + j]), o = sigmoid(x[3 * H + j] + gh[3 * H + j]);
            c[j] = f * c[j] + i * g;
            yt[j] = o * std::tanh(c[j]);
            sv[4 * j] = i, sv[4 * j + 1] = f, sv[4 * j + 2] = g, sv[4 * j + 3] = o;
            cs.data_ptr<float>()[(b * T + t) * H + j] = c[j];
          } else {
            const float r = sigmoid(x[j] + gh[j]), u = sigmoid(x[H + j] + gh[H + j]);
            const float n = std::tanh(x[2 * H + j] + r * gh[2 * H + j]);
            yt[j] = (1.0f - u) * n + u * h[j];
            sv[4 * j] = r, sv[4 * j + 1] = u, sv[4 * j + 2] = n, sv[4 * j + 3] = gh[2 * H + j];
          }
        }
        for (int64_t j = 0; j < H; ++j) h[j] = yt[j];
      }
      for (int64_t j = 0; j < H; ++j) {
        h_n.data_ptr<float>()[b * H + j] = h[j];
        if (lstm) c_n.data_ptr<float>()[b * H + j] = c[j];
      }
    }
  });
  return {y, h_n, c_n, saved, cs};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> rnn_backward_cpu(
    c10::string_view cell, const at::Tensor& w_hh, const at::Tensor& y, const at::Tensor& saved, const at::Tensor& cs,
    const at::Tensor& h0, const std::optional<at::Tensor>& c0, const at::Tensor& lengths,
    const std::optional<at::Tensor>& dy, const std::optional<at::Tensor>& dh_n, const std::optional<at::Tensor>& dc_n,
    bool reverse, c10::string_view weights, int64_t max_blocks) {
  const Sizes z = check_backward(std::string(cell), w_hh, y, saved, cs, h0, c0, lengths, dy, dh_n, dc_n,
                                 std::string(weights), max_blocks);
  const bool lstm = z.cell == Cell::kLSTM;
  const int64_t B = z.B, T = z.T, H = z.H, G = num_gates(z.cell), GH = G * H;
  auto opts = y.options();
  at::Tensor dgates = at::zeros({B, T, GH}, opts);
  at::Tensor dgates_hn = lstm ? at::empty({0}, opts) : at::zeros({B, T, H}, opts);
  at::Tensor dh0 = at::empty({B, H}, opts);
  at::Tensor dc0 = lstm ? at::empty({B, H}, opts) : at::empty({0}, opts);
  const std::vector<float> W = recurrent_weights(w_hh, z.weights);
  auto ptr = [](const std::optional<at::Tensor>& t) {
    return t.has_value() && t->defined() ? t->const_data_ptr<float>() : nullptr;
  };
  const float *dyp = ptr(dy), *dhn = ptr(dh_n), *dcn = ptr(dc_n);
  const int64_t* len = lengths.const_data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> dh(H), dc(H), dgh(GH), dprev(H);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t L = clamp_length(len[b], T);
      for (int64_t j = 0; j < H; ++j) {
        dh[j] = dhn ? dhn[b * H + j] : 0.0f;
        dc[j] = dcn ? dcn[b * H + j] : 0.0f;
      }
      for (int64_t s = L - 1; s >= 0; --s) {
        const int64_t t = time_index(s, L, reverse);
        const int64_t tp = s > 0 ? time_index(s - 1, L, reverse) : -1;  // the step before, if any
        const float* sv = saved.const_data_ptr<float>() + (b * T + t) * 4 * H;
        float* dg = dgates.data_ptr<float>() + (b * T + t) * GH;
        for (int64_t j = 0; j < H; ++j) {
          const float dht = dh[j] + (dyp ? dyp[(b * T + t) * H + j] : 0.0f);
          if (lstm) {
            const float i = sv[4 * j], f = sv[4 * j + 1], g = sv[4 * j + 2], o = sv[4 * j + 3];
            const float ct = cs.const_data_ptr<float>()[(b * T + t) * H + j];
            const float cp = tp >= 0 ? cs.const_data_ptr<float>()[(b * T + tp) * H + j]
                                     : c0->const_data_ptr<float>()[b * H + j];
            const float tc = std::tanh(ct);
            const float dct = dc[j] + dht * o * (1.0f - tc * tc);
            dg[j] = dct * g * i * (1.0f - i);
            dg[H + j] = dct * cp * f * (1.0f - f);
            dg[2 * H + j] = dct * i * (1.0f - g * g);
            dg[3 * H + j] = dht * tc * o * (1.0f - o);
            dc[j] = dct * f;
            for (int64_t q = 0; q < G; ++q) dgh[q * H + j] = dg[q * H + j];
            dprev[j] = 0.0f;
          } else {
            const float r = sv[4 * j], u = sv[4 * j + 1], n = sv[4 * j + 2], ghn = sv[4 * j + 3];
            const float hp = tp >= 0 ? y.const_data_ptr<float>()[(b * T + tp) * H + j]
                                     : h0.const_data_ptr<float>()[b * H + j];
            const float dn = dht * (1.0f - u) * (1.0f - n * n);
            dg[j] = dn * ghn * r * (1.0f - r);
            dg[H + j] = dht * (hp - n) * u * (1.0f - u);
            dg[2 * H + j] = dn;
            dgates_hn.data_ptr<float>()[(b * T + t) * H + j] = dn * r;
            dgh[j] = dg[j], dgh[H + j] = dg[H + j], dgh[2 * H + j] = dn * r;
            dprev[j] = dht * u;
          }
        }
        for (int64_t k = 0; k < H; ++k) {
          float acc = 0.0f;
          for (int64_t r = 0; r < GH; ++r) acc += W[r * H + k] * dgh[r];
          dh[k] = acc + dprev[k];
        }
      }
      for (int64_t j = 0; j < H; ++j) {
        dh0.data_ptr<float>()[b * H + j] = dh[j];
        if (lstm) dc0.data_ptr<float>()[b * H + j] = dc[j];
      }
    }
  });
  return {dgates, dgates_hn, dh0, dc0};
}

std::string rnn_plan_cpu(c10::string_view cell, int64_t hidden_size, int64_t batch, c10::string_view weights,
                         const at::Tensor&, int64_t max_blocks) {
  check_plan(std::string(cell), hidden_size, batch, std::string(weights), max_blocks);
  return "cpu";
}

}  // namespace
}  // namespace vlseq::rnn

TORCH_LIBRARY_IMPL(vlseq_ext, CPU, m) {
  m.impl("rnn_forward", &vlseq::rnn::rnn_forward_cpu);
  m.impl("rnn_backward", &vlseq::rnn::rnn_backward_cpu);
  m.impl("rnn_plan", &vlseq::rnn::rnn_plan_cpu);
}
