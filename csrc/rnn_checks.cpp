#include <ATen/core/Tensor.h>

#include <string>

#include "vlseq/rnn.h"

namespace vlseq::rnn {

namespace {

// Numbers go into messages as strings (arg_checks.cpp says why).
std::string num(int64_t v) { return std::to_string(v); }

std::string shape(const at::Tensor& t) {
  std::string s = "(";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + num(t.size(d));
  return s + (t.dim() == 1 ? ",)" : ")");
}

// A float32, contiguous tensor of exactly `sizes` on `device`.
void check_tensor(const char* op, const char* arg, const at::Tensor& t, at::IntArrayRef sizes,
                  const at::Device& device) {
  TORCH_CHECK(t.defined(), op, ": ", arg, " is undefined");
  TORCH_CHECK(t.device() == device, op, ": ", arg, " is on ", t.device().str(), " but xproj/w_hh are on ",
              device.str());
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", arg, " must be float32, got ",
              c10::toString(t.scalar_type()));
  bool same = t.dim() == static_cast<int64_t>(sizes.size());
  for (size_t d = 0; same && d < sizes.size(); ++d) same = t.size(d) == sizes[d];
  if (!same) {
    std::string want = "(";
    for (size_t d = 0; d < sizes.size(); ++d) want += (d ? ", " : "") + num(sizes[d]);
    TORCH_CHECK(false, op, ": ", arg, " must have shape ", want, sizes.size() == 1 ? ",)" : ")", ", got ", shape(t));
  }
  TORCH_CHECK(t.is_contiguous(), op, ": ", arg, " must be contiguous");
}

void check_optional(const char* op, const char* arg, const std::optional<at::Tensor>& t, at::IntArrayRef sizes,
                    const at::Device& device) {
  if (t.has_value() && t->defined()) check_tensor(op, arg, *t, sizes, device);
}

bool given(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

void check_lengths(const char* op, const at::Tensor& lengths, int64_t B, const at::Device& device) {
  TORCH_CHECK(lengths.defined(), op, ": lengths is undefined");
  TORCH_CHECK(lengths.scalar_type() == at::kLong, op, ": lengths must be int64, got ",
              c10::toString(lengths.scalar_type()));
  TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == B, op, ": lengths must have shape (", num(B), ",), got ",
              shape(lengths));
  TORCH_CHECK(lengths.device() == device, op, ": lengths is on ", lengths.device().str(), " but xproj/w_hh are on ",
              device.str());
  TORCH_CHECK(lengths.is_contiguous(), op, ": lengths must be contiguous");
}

// Index arithmetic inside the kernels is int64 for offsets and int for one dimension; the step
// counters of the cross-block barrier count (T + 2) * blocks in 32 bits.
void check_limits(const char* op, int64_t B, int64_t T, int64_t H) {
  TORCH_CHECK(B >= 1 && T >= 1 && H >= 1, op, ": batch, steps and hidden size must be >= 1, got B=", num(B),
              " T=", num(T), " H=", num(H));
  TORCH_CHECK(B <= (1 << 24) && T <= (1 << 24) && H <= (1 << 16), op,
              ": sizes beyond the kernels' limits (batch and steps <= 2^24, hidden <= 65536): B=", num(B), " T=",
              num(T), " H=", num(H));
}

void check_max_blocks(const char* op, int64_t max_blocks) {
  TORCH_CHECK(max_blocks >= 0, op, ": max_blocks must be >= 0 (0: the whole GPU), got ", num(max_blocks));
}

}  // namespace

Cell parse_cell(const char* op, const std::string& name) {
  if (name == "lstm") return Cell::kLSTM;
  if (name == "gru") return Cell::kGRU;
  TORCH_CHECK(false, op, ": cell must be \"lstm\" or \"gru\", got \"", name, "\"");
}

Weights parse_weights(const char* op, const std::string& name) {
  if (name == "fp32") return Weights::kFP32;
  if (name == "bf16") return Weights::kBF16;
  if (name == "tf32") return Weights::kTF32;
  TORCH_CHECK(false, op, ": weights must be \"fp32\", \"tf32\" or \"bf16\", got \"", name, "\"");
}

Sizes check_forward(const std::string& cell, const at::Tensor& xproj, const at::Tensor& w_hh,
                    const std::optional<at::Tensor>& b_hh, const at::Tensor& h0, const std::optional<at::Tensor>& c0,
                    const at::Tensor& lengths, const std::string& weights, int64_t max_blocks) {
  const char* op = "rnn_forward";
  const Cell c = parse_cell(op, cell);
  const Weights w = parse_weights(op, weights);
  check_max_blocks(op, max_blocks);
  const int64_t G = num_gates(c);
  TORCH_CHECK(xproj.defined() && xproj.dim() == 3, op, ": xproj must have shape (batch, steps, ", num(G),
              " * hidden)", xproj.defined() ? ", got " + shape(xproj) : std::string());
  TORCH_CHECK(xproj.size(2) % G == 0, op, ": xproj's last dimension (", num(xproj.size(2)), ") must be ", num(G),
              " * hidden for ", cell);
  const int64_t B = xproj.size(0), T = xproj.size(1), H = xproj.size(2) / G;
  check_limits(op, B, T, H);
  const at::Device device = xproj.device();
  check_tensor(op, "xproj", xproj, {B, T, G * H}, device);
  check_tensor(op, "w_hh", w_hh, {G * H, H}, device);
  check_optional(op, "b_hh", b_hh, {G * H}, device);
  check_tensor(op, "h0", h0, {B, H}, device);
  if (c == Cell::kLSTM) {
    TORCH_CHECK(given(c0), op, ": an LSTM needs c0");
    check_tensor(op, "c0", *c0, {B, H}, device);
  } else {
    TORCH_CHECK(!given(c0), op, ": a GRU has no cell state; pass c0=None");
  }
  check_lengths(op, lengths, B, device);
  return {c, w, B, T, H, max_blocks};
}

Sizes check_backward(const std::string& cell, const at::Tensor& w_hh, const at::Tensor& y, const at::Tensor& saved,
                     const at::Tensor& cs, const at::Tensor& h0, const std::optional<at::Tensor>& c0,
                     const at::Tensor& lengths, const std::optional<at::Tensor>& dy,
                     const std::optional<at::Tensor>& dh_n, const std::optional<at::Tensor>& dc_n,
                     const std::string& weights, int64_t max_blocks) {
  const char* op = "rnn_backward";
  const Cell c = parse_cell(op, cell);
  const Weights w = parse_weights(op, weights);
  check_max_blocks(op, max_blocks);
  const int64_t G = num_gates(c);
  TORCH_CHECK(y.defined() && y.dim() == 3, op, ": y must have shape (batch, steps, hidden)",
              y.defined() ? ", got " + shape(y) : std::string());
  const int64_t B = y.size(0), T = y.size(1), H = y.size(2);
  check_limits(op, B, T, H);
  const at::Device device = y.device();
  check_tensor(op, "w_hh", w_hh, {G * H, H}, device);
  check_tensor(op, "y", y, {B, T, H}, device);
  check_tensor(op, "saved", saved, {B, T, 4 * H}, device);
  check_tensor(op, "h0", h0, {B, H}, device);
  if (c == Cell::kLSTM) {
    check_tensor(op, "cs", cs, {B, T, H}, device);
    TORCH_CHECK(given(c0), op, ": an LSTM needs c0");
    check_tensor(op, "c0", *c0, {B, H}, device);
    check_optional(op, "dc_n", dc_n, {B, H}, device);
  } else {
    TORCH_CHECK(!given(c0) && !given(dc_n), op, ": a GRU has no cell state; pass c0=None and dc_n=None");
  }
  check_lengths(op, lengths, B, device);
  check_optional(op, "dy", dy, {B, T, H}, device);
  check_optional(op, "dh_n", dh_n, {B, H}, device);
  return {c, w, B, T, H, max_blocks};
}

Sizes check_plan(const std::string& cell, int64_t hidden_size, int64_t batch, const std::string& weights,
                 int64_t max_blocks) {
  const char* op = "rnn_plan";
  const Cell c = parse_cell(op, cell);
  const Weights w = parse_weights(op, weights);
  TORCH_CHECK(hidden_size >= 1 && batch >= 1, op, ": hidden_size and batch must be >= 1");
  check_max_blocks(op, max_blocks);
  return {c, w, batch, 1, hidden_size, max_blocks};
}

}  // namespace vlseq::rnn
