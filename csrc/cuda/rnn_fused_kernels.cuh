// The fused LSTM/GRU kernels: W_hh in registers, and the cell computed by the lanes that sum the
// recurrent products, so that a step is one dependent chain per thread (wait for the exchange,
// products, butterfly, cell, send) with no block-wide barrier in a cluster. Same semantics, args
// and exchange protocol as the generic kernels (rnn_kernels.cuh, which explains the terms); the host
// (rnn.cu) picks these where fits_fused holds: fp32, a block's samples in one batch tile of BT.
//
// Work split
// ----------
// Block `rank` owns hidden units [j0, j0 + hv). Unit j of the block has ks = fused_lanes(hs, workers)
// consecutive lanes (one warp or part of one); lane q of them holds chunks q, q + ks, ... (float4s
// of the contraction index) of the unit's weights and sums that share of the products for all BT
// samples of the tile (padding samples skipped); a butterfly (sample_sums) gives each lane the
// totals of its sample jb = q % BT. Lane q then runs that sample's cell (the ks / BT lanes of a
// sample hold the same state and compute the same bits) and sends the result to blocks q / BT,
// q / BT + ks / BT, ... (all nc blocks between them); lane q = jb also writes the sample's outputs.
// Which samples a group runs: the host sorts the samples by length and Slots deals them out, so that
// the slots of a group are in non-increasing order of length. A sample that has ended (forward:
// s >= L; backward: s >= L, not yet begun) is neither multiplied nor sent: the samples still running
// are a prefix of the slots, and a step costs what its running samples cost.
//   forward:  products W_hh[gates of j] h_{t-1} (G rows, contraction over H); the cell gives h_t(j),
//             sent to every block (all-gather of h, as in the generic kernel);
//   backward: products W_hh[:, j]^T g_{t+1} (one column, contraction over all G*H recurrent gate
//             gradients g of the step after, four per unit: r' = k * 4 + gate, the GRU's fourth
//             zero); the cell gives this step's recurrent gate gradients of unit j, sent as one
//             float4 to every block (an all-gather of g instead of the generic kernel's
//             reduce-scatter of partial dh: each unit's dh is summed where it is used, and the cell
//             needs no second pass; a send costs about a clock whatever its width, hence the float4).
// A single block of one or two samples (fused_few_workers) runs on its first 4 warps with 8 chunks per
// lane and row, and its backward gives each ks lanes two units (FusedThread, U = 2); the other warps
// leave after the set-up. A wide cluster block (kWide, tiles of 1, 2 or 4 samples) also holds 8 chunks per
// lane and row, so that a layer fits in half the blocks (LSTM 256: 8, 32 units a block).
//
// Why no barrier per step is needed (cluster; a single block has one barrier per step, named barrier 1
// over its warps with a unit: every thread that reads or writes the exchange buffers after the set-up)
// -------------------------------------------------------------------------------------------------------
// The buffers are double-buffered by step parity as in the generic kernels, each filled by the
// step's sends of every block (itself included) and waited for by every thread that reads it. A
// block's sends of step s follow, by data dependency through the butterfly, every read of the
// step's buffer by the lanes of its units; a peer overwrites that buffer only at step s + 1 (the
// other parity at s) after it has received all of this block's step-s sends, so after those reads.
// A thread can fall behind only to the wait of the step before: the lanes of a warp with a unit meet
// in every step's shuffles, and every unit has a sending lane (q = 0, slot 0, whose sample is the
// group's longest and so runs every step), so no block gets
// step s + 1's bytes, nor can the mailbox's phase of step s + 2 complete, before every such warp has
// passed the wait of step s. Warps with no unit (tiles past hv) would not be held back, and could
// see the parity of a later phase: in a cluster they leave after the set-up.
#pragma once

#include <type_traits>

#include "rnn_kernels.cuh"

namespace vlseq::rnn {

#if defined(__CUDACC__)

// Sums over the ks lanes of a unit that leave lane q the totals of its own sample q % BT: v holds N
// values of each of the M samples a lane still holds (v[i * M + b]); out[i] gets value i's total.
// The levels below BT halve the samples a lane holds (it keeps those whose bit matches its own lane
// bit and adds the partner's share of them: N * BT / 2 + N * BT / 4 + ... shuffles where a full
// butterfly takes N * BT per level); the levels from BT up sum the N values left. A fixed order: the
// same bits every run, and in every lane of a sample (the last levels add the same two values).
template <int N, int M>
__device__ __forceinline__ void sample_sums(const float (&v)[N * M], float (&out)[N], int ks, int q, int off = 1) {
  if constexpr (M == 1) {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = v[i];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      if (o >= off && o < ks) {
#pragma unroll
        for (int i = 0; i < N; ++i) out[i] += __shfl_xor_sync(0xffffffffu, out[i], o);
      }
    }
  } else {
    const bool upper = (q & off) != 0;
    float kept[N * (M / 2)];
#pragma unroll
    for (int i = 0; i < N; ++i) {
#pragma unroll
      for (int b = 0; b < M / 2; ++b) {
        const float lo = v[i * M + 2 * b], hi = v[i * M + 2 * b + 1];
        kept[i * (M / 2) + b] = (upper ? hi : lo) + __shfl_xor_sync(0xffffffffu, upper ? lo : hi, off);
      }
    }
    sample_sums<N, M / 2>(kept, out, ks, q, off << 1);
  }
}

// The float4 of shared memory at p, or, kPredicated, zeros where !in_range: a predicated load, with no
// branch that would keep the loads of a group of chunks from issuing together (a branch per chunk
// measured ~60-90 clocks per chunk). Where every lane's chunks are in range (the common sizes) the
// kernels take the unpredicated form: no compare and no zeroing per chunk.
template <bool kPredicated>
__device__ __forceinline__ float4 chunk(const float* p, bool in_range) {
  if (kPredicated && !in_range) return make_float4(0.f, 0.f, 0.f, 0.f);
  return *reinterpret_cast<const float4*>(p);
}

// Which samples a group runs, in which slots, and their lengths (every fused kernel). The samples,
// longest first (`order`), are dealt to the groups in snake order: the sample of rank r goes to round
// (slot) r / groups, group r % groups in even rounds and groups - 1 - r % groups in odd ones. So every
// group gets one of the longest samples and about the same sum of lengths (a step costs roughly a
// fixed part plus a part per running sample), and a group's slots hold its samples longest first.
template <int BT>
struct Slots {
  int B, groups, group;
  int bv;     // the group's samples (slots 0 .. bv-1)
  int* lens;  // lens[b]: the length of slot b's sample (0 past bv), in non-increasing order
  const int64_t* order;
  // Loads lens (shared memory, g.bs entries): readable after finish().
  __device__ __forceinline__ Slots(const Geometry& g, const Block& blk, const int64_t* lengths, const int64_t* order_,
                                   int* lens_)
      : B(g.B), groups(blk.groups), group(blk.group), bv(0), lens(lens_), order(order_) {
    while (bv < g.bs && rank(bv) < B) ++bv;
    for (int b = threadIdx.x; b < g.bs; b += kThreads)
      lens[b] = b < bv ? static_cast<int>(clamp_length(lengths[sample(b)], g.T)) : 0;
  }
  __device__ __forceinline__ int rank(int b) const { return b * groups + (b % 2 ? groups - 1 - group : group); }
  __device__ __forceinline__ int64_t sample(int b) const {  // b < bv
    const int r = rank(b);
    return order ? order[r] : r;
  }
  // Ends the set-up (finish_setup: lens readable, the group's blocks started) and copies the slots'
  // lengths into registers for running(); returns the group's longest length.
  __device__ __forceinline__ int finish(GroupBarrier& bar, int bs, int (&len)[BT]) const {
    const int smax = finish_setup(bar, lens, bs);
#pragma unroll
    for (int b = 0; b < BT; ++b) len[b] = b < bv ? lens[b] : 0;
    return smax;
  }
  // Slots whose sample runs step s (length > s): a prefix of them, as their lengths do not increase.
  __device__ __forceinline__ static int running(const int (&len)[BT], int s) {
    int n = 0;
#pragma unroll
    for (int b = 0; b < BT; ++b) n += len[b] > s;
    return n;
  }
};

// What the all-gather fused kernels set up first: where this thread sits (the header comment above),
// the group's slots, and the block's shared memory: two exchange buffers of BT rows of `row` floats
// (`buf`, by step parity), the slots' lengths, the mailbox.
// U units to ks lanes (the single block's backward takes U = 2, fused_units): the products' lanes q
// hold chunks of all U units' columns, so that each chunk of the gate gradients read from shared
// memory serves U units; lanes u * ks / U .. (u + 1) * ks / U - 1 then run unit u's cell (qu: the lane
// among them). U = 1: a unit's ks lanes, qu = q, as the header describes.
template <int BT, int U = 1>
struct FusedThread {
  Block blk;  // its units (j0, hv); the group's samples are the slots, not blk.b0 / bv
  Slots<BT> slots;
  int nc, ks, q, j, jb;
  int ku, qu;      // lanes per unit and the lane among its unit's (ks and q where U = 1)
  int jg;          // the lane's group of U units: units jg * U .. jg * U + U - 1 of the block
  bool has_unit;   // the group holds one of the block's units: the lane takes part in the products
  bool mine;       // and slot jb holds a sample: the lane runs its cell and sends
  bool writer;     // and the lane writes that (sample, unit)'s outputs
  bool idle_warp;  // no lane of the warp has a unit
  int workers;     // the threads of the warps with a unit (a single block's step barrier counts them)
  bool cluster;
  int unit;        // j0 + j
  int64_t sample;  // the sample of slot jb
  float* buf;
  Mailbox mbox;
  __device__ __forceinline__ FusedThread(const Geometry& g, const int64_t* lengths, const int64_t* order, int row,
                                         unsigned char* smem, int max_workers)
      : blk(g),
        slots(g, blk, lengths, order, reinterpret_cast<int*>(smem + FusedSmem(g, row, BT).lens)),
        mbox(reinterpret_cast<uint64_t*>(smem + FusedSmem(g, row, BT).bars)) {
    nc = g.nc, ks = fused_lanes(ceil_div(g.hs, U), max_workers);
    q = threadIdx.x % ks, jg = threadIdx.x / ks;
    if constexpr (U == 1) {
      ku = ks, qu = q, j = jg;
    } else {
      ku = ks / U, qu = q % ku, j = jg * U + q / ku;
    }
    jb = qu % BT;
    has_unit = jg * U < blk.hv, mine = j < blk.hv && jb < slots.bv, writer = mine && qu < BT;
    idle_warp = (threadIdx.x / 32 * 32) / ks * U >= blk.hv, workers = round_up(ceil_div(blk.hv, U) * ks, 32);
    cluster = g.sync == Sync::kCluster;
    unit = blk.j0 + j, sample = mine ? slots.sample(jb) : 0;
    buf = reinterpret_cast<float*>(smem + FusedSmem(g, row, BT).v);
  }
  // Sends N values of this lane's (sample, unit) to offset `at` (floats) of the exchange buffer of
  // parity `parity` (rows of `row` floats) in each of its destination blocks; a single block stores
  // them once. Only lanes whose sample runs the step send (the mailbox counts exactly those bytes).
  template <int N>  // 1 or 4
  __device__ __forceinline__ void send(int parity, int row, int at, const float (&v)[N]) const {
    float* to_local = buf + parity * BT * row + at;
    if (!cluster) {
      if (qu < BT)
#pragma unroll
        for (int i = 0; i < N; ++i) to_local[i] = v[i];
      return;
    }
    const uint32_t to = smem_u32(to_local);
    for (int d = qu / BT; d < nc; d += ku / BT) {
      if constexpr (N == 4)
        mbox.send(d, to, parity, make_float4(v[0], v[1], v[2], v[3]));
      else
        mbox.send(d, to, parity, v[0]);
    }
  }
};

// A single block's step barrier: named barrier 1 over the warps with a unit (the others have left).
__device__ __forceinline__ void worker_barrier(int threads) {
  asm volatile("bar.sync 1, %0;" ::"r"(threads) : "memory");
}

// kLocal: the single-block layout (Sync::kLocal), whose step's outputs and next loads issue under the
// next step's products (below).
template <Cell C, bool kLocal, int BT, bool kWide = false>
__global__ void __launch_bounds__(kThreads, 1) rnn_forward_fused_kernel(const ForwardArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int G = C == Cell::kLSTM ? 4 : 3;
  constexpr int kChunks = fused_chunks(kLocal, BT, kWide);
  const Geometry& g = a.g;
  const int H = g.H, T = g.T, GH = G * H, Kp = round_up(H, 4), k4n = Kp / 4;
  extern __shared__ __align__(16) unsigned char smem[];
  const FusedThread<BT> ln(g, a.lengths, a.order, Kp, smem, fused_workers(kLocal, BT));
  const Block& blk = ln.blk;
  const int unit = ln.unit;
  const int64_t sample = ln.sample;
  float* h_s = ln.buf;  // [parity][BT][Kp]: h_{t-1} of the group's samples
  const int hbuf = BT * Kp;

  // Buffer 0 = h0; the rest zero (rows past bv and columns past H stay so: nobody sends there).
  for (int e = threadIdx.x; e < 2 * hbuf; e += kThreads) {
    const int b = e % hbuf / Kp, k = e % Kp;
    h_s[e] = e < hbuf && b < ln.slots.bv && k < H ? a.h0[ln.slots.sample(b) * H + k] : 0.0f;
  }
  // Rows q * H + unit of W_hh (gate q), chunks ln.q + m * ks of k, zero past H.
  float4 w[G][kChunks];
#pragma unroll
  for (int m = 0; m < kChunks; ++m) {
    const int k0 = 4 * (ln.q + m * ln.ks);
#pragma unroll
    for (int q = 0; q < G; ++q) {
      float e[4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
        e[i] = ln.has_unit && k0 + i < H ? __ldg(a.w_hh + static_cast<int64_t>(q * H + unit) * H + k0 + i) : 0.0f;
      w[q][m] = make_float4(e[0], e[1], e[2], e[3]);
    }
  }
  // The state of this lane's (sample, unit) and its bias.
  float h = 0.0f, c = 0.0f, bias[G];
#pragma unroll
  for (int q = 0; q < G; ++q) bias[q] = ln.mine && a.b_hh ? a.b_hh[q * H + unit] : 0.0f;
  if (ln.mine) {
    h = a.h0[sample * H + unit];
    if constexpr (C == Cell::kLSTM) c = a.c0[sample * H + unit];
  }
  GroupBarrier bar{g.sync, nullptr, static_cast<unsigned>(g.nc), 0u};
  int slot_len[BT];
  const int smax = ln.slots.finish(bar, g.bs, slot_len);
  const int len = ln.mine ? ln.slots.lens[ln.jb] : 0;
  if ((kLocal || ln.cluster) && ln.idle_warp) return;  // a single block's step barrier counts the others

  // This lane's input projections, loaded a step ahead (their latency hides behind the exchange).
  const float* xrow = a.xproj + (sample * T) * GH + unit;
  float xnext[G];
  auto time_of = [&](int s) -> int64_t { return g.reverse ? len - 1 - s : s; };
  // kLocal: the lane's rows as pointers moved a row a step (`x_at`: the step prefetch loads next;
  // `out_at`: the step whose outputs are pending), where recomputing them from sample * T + t cost
  // ~60 instructions of 64-bit arithmetic a step on every warp.
  const int64_t first = sample * T + (g.reverse && len > 0 ? len - 1 : 0);
  const int x_step = g.reverse ? -GH : GH, out_step = g.reverse ? -H : H;  // ints: a pointer add is one IMAD.WIDE
  const float* x_at = a.xproj + first * GH + unit;
  int64_t out_at = first * H + unit;
  auto prefetch = [&](int s) {
    if (!ln.mine || s >= len) return;
    if constexpr (kLocal) {
#pragma unroll
      for (int q = 0; q < G; ++q) xnext[q] = __ldg(x_at + q * H);
      x_at += x_step;
      // The step after next's lines, a gate per lane of the sample (there are ks / BT of them).
      if (s + 1 < len)
        for (int q = ln.q / BT; q < G; q += ln.ks / BT) prefetch_l2(x_at + q * H);
    } else {
#pragma unroll
      for (int q = 0; q < G; ++q) xnext[q] = __ldg(xrow + time_of(s) * GH + q * H);
      if (ln.writer && s + 1 < len)
#pragma unroll
        for (int q = 0; q < G; ++q) prefetch_l2(xrow + time_of(s + 1) * GH + q * H);
    }
  };
  // Where a step's output stores and the next step's input loads issue. In a cluster: after the sends,
  // while the peers' sends are on their way. In a single block they would hold up the warps' arrival at
  // the __syncthreads, so there they issue under the next step's products (`pending`: the writer's
  // outputs of the step before, not yet stored, at out_at). h64, one block: forward step 1,435 -> 1,333
  // clocks; in a cluster the same placement measured slower (BENCHMARKS.md, fifteenth session).
  bool pending = false;
  float out[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // the cell's gates (saved)
  auto store_outputs = [&](int64_t row) {
    a.y[row] = h;
    reinterpret_cast<float4*>(a.saved)[row] = make_float4(out[0], out[1], out[2], out[3]);
    if constexpr (C == Cell::kLSTM) a.cs[row] = c;
  };
  prefetch(0);
  const bool all_chunks = kChunks * ln.ks <= k4n;  // every lane's chunks are in range
  for (int s = 0; s < smax; ++s) {
    const int cur = s & 1;
    // Samples that run this step: only they are multiplied and sent (slot 0 runs every step: each
    // unit's lane q = 0 sends, which the no-barrier argument needs).
    const int nact = Slots<BT>::running(slot_len, s);
    if (ln.cluster) ln.mbox.expect(cur ^ 1, static_cast<uint32_t>(nact * H * 4));
    float x[G];
#pragma unroll
    for (int q = 0; q < G; ++q) x[q] = xnext[q];
    VLSEQ_MARK(0, 0, s);
    // acc[q * BT + b] = W_hh row (gate q, this unit) . h_{t-1} of sample b.
    float acc[G * BT];
#pragma unroll
    for (int i = 0; i < G * BT; ++i) acc[i] = 0.0f;
    auto products = [&](auto predicated) {
      const float* v = h_s + cur * hbuf + 4 * ln.q;
#pragma unroll
      for (int b = 0; b < BT; ++b) {
        if ((!kLocal || b > 0) && b >= nact) break;  // slot 0 runs every step
        const float* src = v + b * Kp;
        auto multiply = [&](int m, const float4& hv) {
#pragma unroll
          for (int q = 0; q < G; ++q) {
            float& sum = acc[q * BT + b];
            sum = fmaf(w[q][m].x, hv.x, sum);
            sum = fmaf(w[q][m].y, hv.y, sum);
            sum = fmaf(w[q][m].z, hv.z, sum);
            sum = fmaf(w[q][m].w, hv.w, sum);
          }
        };
        if constexpr (kLocal) {  // the sample's chunks loaded, then (b = 0) the work nobody on this step's path waits for
          float4 hv[kChunks];
#pragma unroll
          for (int m = 0; m < kChunks; ++m, src += 4 * ln.ks)
            hv[m] = chunk<decltype(predicated)::value>(src, ln.q + m * ln.ks < k4n);
          if (b == 0) {
            if (pending) store_outputs(out_at), out_at += out_step;
            pending = false;
            prefetch(s + 1);
          }
#pragma unroll
          for (int m = 0; m < kChunks; ++m) multiply(m, hv[m]);
        } else {
#pragma unroll
          for (int m = 0; m < kChunks; ++m, src += 4 * ln.ks)
            multiply(m, chunk<decltype(predicated)::value>(src, ln.q + m * ln.ks < k4n));
        }
      }
    };
    if (ln.has_unit) {
      if (all_chunks)
        products(std::false_type{});
      else
        products(std::true_type{});
    }
    float gh[G];
    sample_sums<G, BT>(acc, gh, ln.ks, ln.q);
    VLSEQ_MARK(0, 1, s);
    const bool live = ln.mine && s < len;
    if (live) {
#pragma unroll
      for (int q = 0; q < G; ++q) gh[q] += bias[q];
      forward_cell<C>(x, gh, h, c, out);
    }
    if (live) ln.template send<1>(cur ^ 1, Kp, ln.jb * Kp + unit, {h});
    VLSEQ_MARK(0, 2, s);
    if constexpr (kLocal) {
      pending = ln.writer && live;
    } else {
      if (ln.writer && live) store_outputs((sample * T + time_of(s)) * H + unit);
      prefetch(s + 1);
    }
    VLSEQ_MARK(0, 3, s);
    if (ln.cluster)
      ln.mbox.wait(cur ^ 1, (s >> 1) & 1);
    else if constexpr (kLocal)
      worker_barrier(ln.workers);
    else
      bar.wait();
  }
  if (pending) store_outputs(out_at);
  if (ln.writer) {
    a.h_n[sample * H + unit] = h;
    if constexpr (C == Cell::kLSTM) a.c_n[sample * H + unit] = c;
  }
#endif
}

// The backward of one (sample, unit) at step s, shared by both fused backward kernels.
// What the step reads, loaded a step ahead (s < len): LSTM i, f, g, o, c_t, c_{t-1}, dy; GRU r, z,
// n, W_hn h + b_hn, h_{t-1}, dy.
// kL2: only asks L2 for those fields (prefetch_l2), for the step after next.
template <Cell C, int F, bool kL2 = false>
__device__ __forceinline__ void load_backward_fields(const BackwardArgs& a, int64_t sample, int unit, int len, int s,
                                                     float (&p)[F]) {
  const Geometry& g = a.g;
  const int H = g.H;
  const int64_t first = sample * g.T, at = first + (g.reverse ? len - 1 - s : s);
  const int64_t prev = first + (g.reverse ? len - s : s - 1);
  auto load = [](float& v, const float* ptr) {
    if constexpr (kL2)
      prefetch_l2(ptr);
    else
      v = __ldg(ptr);
  };
  const float4* sv = reinterpret_cast<const float4*>(a.saved) + at * H + unit;
  if constexpr (kL2) {
    prefetch_l2(sv);
  } else {
    const float4 v = __ldg(sv);
    p[0] = v.x, p[1] = v.y, p[2] = v.z, p[3] = v.w;
  }
  if constexpr (C == Cell::kLSTM) {
    load(p[4], a.cs + at * H + unit);
    load(p[5], s > 0 ? a.cs + prev * H + unit : a.c0 + sample * H + unit);
  } else {
    load(p[4], s > 0 ? a.y + prev * H + unit : a.h0 + sample * H + unit);
  }
  if (a.dy)
    load(p[F - 1], a.dy + at * H + unit);
  else if constexpr (!kL2)
    p[F - 1] = 0.0f;
}
// The cell's backward: from dh_t (without dy) and the fields, the recurrent gate gradients rg (LSTM
// i, f, g, o; GRU r, z, r * dn, the fourth zero), the GRU's input-side n gradient dn, and what enters
// the step before (dc; the GRU's direct path ddir = z * dh).
template <Cell C, int F>
__device__ __forceinline__ void backward_cell(const float (&p)[F], float dh, float& dc, float& ddir, float (&rg)[4],
                                              float& dn) {
  const float dht = dh + p[F - 1];
  if constexpr (C == Cell::kLSTM) {
    const float ig = p[0], fg = p[1], gg = p[2], og = p[3], ct = p[4], cp = p[5];
    const float tc = tanhf(ct);
    const float dct = dc + dht * og * (1.0f - tc * tc);
    rg[0] = dct * gg * ig * (1.0f - ig);
    rg[1] = dct * cp * fg * (1.0f - fg);
    rg[2] = dct * ig * (1.0f - gg * gg);
    rg[3] = dht * tc * og * (1.0f - og);
    dc = dct * fg;
  } else {
    const float r = p[0], z = p[1], n = p[2], ghn = p[3], hp = p[4];
    dn = dht * (1.0f - z) * (1.0f - n * n);
    rg[0] = dn * ghn * r * (1.0f - r);
    rg[1] = dht * (hp - n) * z * (1.0f - z);
    rg[2] = dn * r;
    rg[3] = 0.0f;
    ddir = dht * z;
  }
}
// A step's gate gradients of one (sample, unit) in dgates, from its gate 0 at dg (gates H apart): the
// GRU's input side n gradient is dn; its recurrent one, r * dn (rg[2]), goes to dgates_hn (the caller's).
template <Cell C>
__device__ __forceinline__ void store_gate_grads_at(float* dg, int H, const float (&rg)[4], float dn) {
  if constexpr (C == Cell::kLSTM) {
#pragma unroll
    for (int q = 0; q < 4; ++q) dg[q * H] = rg[q];
  } else {
    dg[0] = rg[0], dg[H] = rg[1], dg[2 * H] = dn;
  }
}
// The same at (sample, time) row `row`, dgates_hn included.
template <Cell C>
__device__ __forceinline__ void store_gate_grads(const BackwardArgs& a, int64_t row, int unit, const float (&rg)[4],
                                                 float dn) {
  const int H = a.g.H, GH = (C == Cell::kLSTM ? 4 : 3) * H;
  store_gate_grads_at<C>(a.dgates + row * GH + unit, H, rg, dn);
  if constexpr (C == Cell::kGRU) a.dgates_hn[row * H + unit] = rg[2];
}

// The single-block backward's rows of one (sample, unit): what its steps read and write, as pointers
// moved a row a step (the steps run down in s, and row t(s - 1) = t(s) - dir), where recomputing them
// from sample * T + t cost ~100 instructions of 64-bit arithmetic a step on every warp. The LSTM's c_t
// of a step is the c_{t-1} loaded for the step after it, so c_t is loaded only at the sample's last step.
template <Cell C, int F>
struct BackwardRows {
  const float4* saved;  // row t(s) of the step load() reads next
  const float* prev;    // LSTM: cs at row t(s); GRU: y at row t(s) - dir
  const float* dy;      // null: no dy
  float* dg;            // dgates (and the GRU's dgates_hn) at the row store() writes next
  float* dg_hn;
  int step, gstep;  // a row: -dir * H, -dir * G * H floats (an int: a pointer add is one IMAD.WIDE)
  int H;
  float first_prev;  // c0 (LSTM) or h0 (GRU): the c_{t-1} or h_{t-1} of step 0
  __device__ __forceinline__ BackwardRows(const BackwardArgs& a, int64_t sample, int unit, int len) {
    const Geometry& g = a.g;
    const int GH = (C == Cell::kLSTM ? 4 : 3) * g.H;
    const int64_t dir = g.reverse ? -1 : 1, row = sample * g.T + (g.reverse || len == 0 ? 0 : len - 1);
    H = g.H, step = g.reverse ? H : -H, gstep = g.reverse ? GH : -GH;
    saved = reinterpret_cast<const float4*>(a.saved) + row * H + unit;
    prev = C == Cell::kLSTM ? a.cs + row * H + unit : a.y + (row - dir) * H + unit;
    dy = a.dy ? a.dy + row * H + unit : nullptr;
    dg = a.dgates + row * GH + unit;
    dg_hn = C == Cell::kGRU ? a.dgates_hn + row * H + unit : nullptr;
    first_prev = len == 0 ? 0.0f : C == Cell::kLSTM ? a.c0[sample * H + unit] : a.h0[sample * H + unit];
  }
  // Step s's fields into p (p holds step s + 1's unless `last`, the sample's first step run), then
  // moves to step s - 1's row.
  __device__ __forceinline__ void load(int s, bool last, float (&p)[F]) {
    const float4 v = __ldg(saved);
    p[0] = v.x, p[1] = v.y, p[2] = v.z, p[3] = v.w;
    if constexpr (C == Cell::kLSTM) {
      p[4] = last ? __ldg(prev) : p[5];
      prev += step;
      p[5] = s > 0 ? __ldg(prev) : first_prev;
    } else {
      p[4] = s > 0 ? __ldg(prev) : first_prev;
      prev += step;
    }
    p[F - 1] = dy ? __ldg(dy) : 0.0f;
    saved += step;
    if (dy) dy += step;
  }
  // Asks L2 for line i (0 .. 2) of the step load() reads next: its saved gates, c_{t-1} / h_{t-1} (not
  // at step 0: c0 / h0, and the row would lie outside the sequence), dy.
  __device__ __forceinline__ void ask_l2(int i, bool not_step0) const {
    if (i == 0) prefetch_l2(saved);
    if (i == 1 && not_step0) prefetch_l2(C == Cell::kLSTM ? prev + step : prev);
    if (i == 2 && dy) prefetch_l2(dy);
  }
  __device__ __forceinline__ void store(const float (&rg)[4], float dn) {
    store_gate_grads_at<C>(dg, H, rg, dn);
    if constexpr (C == Cell::kGRU) *dg_hn = rg[2], dg_hn += step;
    dg += gstep;
  }
};

template <Cell C, bool kLocal, int BT, bool kWide = false>  // kLocal, kWide: as the forward's
__global__ void __launch_bounds__(kThreads, 1) rnn_backward_fused_kernel(const BackwardArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int G = C == Cell::kLSTM ? 4 : 3;
  constexpr int F = backward_fields(C);
  constexpr int U = fused_units(kLocal, BT);                   // units a lane multiplies (FusedThread)
  constexpr int NW = 4 * fused_chunks(kLocal, BT, kWide) / U;  // chunks of each unit's column a lane holds
  const Geometry& g = a.g;
  const int H = g.H, T = g.T, Kb = 4 * H, k4n = H;
  extern __shared__ __align__(16) unsigned char smem[];
  const FusedThread<BT, U> ln(g, a.lengths, a.order, Kb, smem, fused_workers(kLocal, BT));
  const Block& blk = ln.blk;
  const int unit = ln.unit;
  const int64_t sample = ln.sample;
  float* g_s = ln.buf;  // [parity][BT][Kb]: the recurrent gate gradients of every unit of a step, at k * 4 + gate
  const int gbuf = BT * Kb;

  for (int e = threadIdx.x; e < 2 * gbuf; e += kThreads) g_s[e] = 0.0f;
  // Columns of the group's units (u) of W_hh: chunk k (lanes' chunks ln.q + m * ks) holds rows q * H + k
  // of gates q < G, zero past them.
  float4 w[U][NW];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const bool valid = U == 1 ? ln.has_unit : ln.jg * U + u < blk.hv;
    const int col = U == 1 ? unit : blk.j0 + ln.jg * U + u;
#pragma unroll
    for (int m = 0; m < NW; ++m) {
      const int k = ln.q + m * ln.ks;
      float e[4];
#pragma unroll
      for (int q = 0; q < 4; ++q)
        e[q] = valid && k < H && q < G ? __ldg(a.w_hh + static_cast<int64_t>(q * H + k) * H + col) : 0.0f;
      w[u][m] = make_float4(e[0], e[1], e[2], e[3]);
    }
  }
  // dh and dc that enter the last step; ddir: the GRU's direct path z * dh into the step before.
  float dh_last = 0.0f, dc = 0.0f, ddir = 0.0f;
  if (ln.mine) {
    dh_last = a.dh_n ? a.dh_n[sample * H + unit] : 0.0f;
    if constexpr (C == Cell::kLSTM) dc = a.dc_n ? a.dc_n[sample * H + unit] : 0.0f;
  }
  GroupBarrier bar{g.sync, nullptr, static_cast<unsigned>(g.nc), 0u};
  int slot_len[BT];
  const int smax = ln.slots.finish(bar, g.bs, slot_len);
  const int len = ln.mine ? ln.slots.lens[ln.jb] : 0;
  if ((kLocal || ln.cluster) && ln.idle_warp) return;  // a single block's step barrier counts the others

  float pnext[F];
  BackwardRows<C, F> rows(a, sample, unit, len);  // kLocal
  auto prefetch = [&](int s) {
    if constexpr (kLocal) {
      if (!ln.mine || s < 0 || s > len) return;
      if (s < len) rows.load(s, s == len - 1, pnext);
      // Step s - 1's lines, a line per lane of the sample (there are ku / BT of them).
      if (s >= 1)
        for (int i = ln.qu / BT; i < 3; i += ln.ku / BT) rows.ask_l2(i, s > 1);
    } else {
      if (ln.mine && s >= 0 && s < len) load_backward_fields<C>(a, sample, unit, len, s, pnext);
      if (ln.writer && s >= 1 && s - 1 < len) load_backward_fields<C, F, true>(a, sample, unit, len, s - 1, pnext);
    }
  };
  // A step's gate gradients and the next step's loads issue where the forward's do (in a single block,
  // under the step before's products: h64 backward step 1,835 -> 1,721 clocks). `pending`: the writer's
  // of the step after, not yet stored (at rows.dg).
  bool pending = false;
  float pending_rg[4] = {0.0f, 0.0f, 0.0f, 0.0f}, pending_dn = 0.0f;
  prefetch(smax - 1);
  const bool all_chunks = NW * ln.ks <= k4n;  // every lane's chunks are in range
  // Steps smax-1 .. 0, then s = -1: only the products, for dh0.
  for (int s = smax - 1;; --s) {
    const int cur = s & 1;  // the buffer this step fills (s = -1: 1, unused)
    // Samples that run this step (they send; slot 0 runs every step, as in the forward), and those
    // that ran the step after (their gate gradients are the products'; the others' dh is dh_last).
    // A sample's rows in the buffers stay zero until its last step (it sends from there on).
    const int nact = Slots<BT>::running(slot_len, s), nafter = Slots<BT>::running(slot_len, s + 1);
    if (ln.cluster && s >= 0) ln.mbox.expect(cur, static_cast<uint32_t>(nact * Kb * 4));
    float p[F];
#pragma unroll
    for (int f = 0; f < F; ++f) p[f] = pnext[f];
    VLSEQ_MARK(1, 0, s);
    // dh_t of the group's units from the gate gradients of step s + 1 (zeros before the first step): four
    // interleaved partial sums per unit and sample (a quarter of the dependent chain), added in a fixed
    // order: acc[(u * 4 + gate) * BT + b].
    float acc[U * 4 * BT];
#pragma unroll
    for (int i = 0; i < U * 4 * BT; ++i) acc[i] = 0.0f;
    auto products = [&](auto predicated) {
      constexpr bool kPredicated = decltype(predicated)::value;
      const float* v = g_s + (cur ^ 1) * gbuf + 4 * ln.q;
#pragma unroll
      for (int b = 0; b < BT; ++b) {
        // A single block multiplies slot 0 even before its last step (nafter = 0: its rows are still
        // zero, and its dh is then dh_last), so that the first sample's products hold the step's other work.
        if ((!kLocal || b > 0) && b >= nafter) break;
        const float* src = v + b * Kb;
#pragma unroll
        for (int m0 = 0; m0 < NW; m0 += kFusedChunks) {
          if (kPredicated && m0 * ln.ks >= k4n) break;  // no lane has a chunk from here on
          auto multiply = [&](int m, const float4& gv) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
              float* au = acc + u * 4 * BT;
              au[b] = fmaf(w[u][m].x, gv.x, au[b]);
              au[BT + b] = fmaf(w[u][m].y, gv.y, au[BT + b]);
              au[2 * BT + b] = fmaf(w[u][m].z, gv.z, au[2 * BT + b]);
              au[3 * BT + b] = fmaf(w[u][m].w, gv.w, au[3 * BT + b]);
            }
          };
          if constexpr (kLocal) {  // as the forward's
            float4 gv[kFusedChunks];
#pragma unroll
            for (int m = 0; m < kFusedChunks; ++m, src += 4 * ln.ks)
              gv[m] = chunk<kPredicated>(src, ln.q + (m0 + m) * ln.ks < k4n);
            if (b == 0 && m0 == 0) {
              if (pending) rows.store(pending_rg, pending_dn);
              pending = false;
              prefetch(s - 1);
            }
#pragma unroll
            for (int m = 0; m < kFusedChunks; ++m) multiply(m0 + m, gv[m]);
          } else {
#pragma unroll
            for (int m = m0; m < m0 + kFusedChunks; ++m, src += 4 * ln.ks)
              multiply(m, chunk<kPredicated>(src, ln.q + m * ln.ks < k4n));
          }
        }
      }
    };
    if (ln.has_unit) {
      if (all_chunks)
        products(std::false_type{});
      else
        products(std::true_type{});
    }
    float dot[U][BT], sum[1];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int b = 0; b < BT; ++b) {
        const float* au = acc + u * 4 * BT;
        dot[u][b] = (au[b] + au[BT + b]) + (au[2 * BT + b] + au[3 * BT + b]);
      }
    if constexpr (U == 1) {
      sample_sums<1, BT>(dot[0], sum, ln.ks, ln.q);
    } else {  // U = 2: the unit level first (lanes keep their own unit's sums), then the unit's lanes
      static_assert(U == 2, "two units a lane at most");
      const bool upper = ln.q >= ln.ku;
      float kept[BT];
#pragma unroll
      for (int b = 0; b < BT; ++b)
        kept[b] = (upper ? dot[1][b] : dot[0][b]) + __shfl_xor_sync(0xffffffffu, upper ? dot[0][b] : dot[1][b], ln.ku);
      sample_sums<1, BT>(kept, sum, ln.ku, ln.qu);
    }
    VLSEQ_MARK(1, 1, s);
    // dh_t: from the step after when this sample ran it, else what entered the sequence's end.
    const float dh = s + 1 < len ? sum[0] + ddir : dh_last;
    if (s < 0) {
      if (ln.writer) {
        a.dh0[sample * H + unit] = dh;
        if constexpr (C == Cell::kLSTM) a.dc0[sample * H + unit] = dc;
      }
      break;
    }
    const bool live = ln.mine && s < len;
    float rg[4];  // this step's recurrent gate gradients (zero where the sample has not started; GRU: 3)
    float dn = 0.0f;
#pragma unroll
    for (int q = 0; q < 4; ++q) rg[q] = 0.0f;
    if (live) {
      backward_cell<C>(p, dh, dc, ddir, rg, dn);
      ln.template send<4>(cur, Kb, ln.jb * Kb + unit * 4, rg);
    }
    VLSEQ_MARK(1, 2, s);
    if constexpr (kLocal) {  // stored under the next step's products (s = -1's too)
      pending = ln.writer && live, pending_dn = dn;
#pragma unroll
      for (int q = 0; q < 4; ++q) pending_rg[q] = rg[q];
    } else {
      if (ln.writer && live) store_gate_grads<C>(a, sample * T + (g.reverse ? len - 1 - s : s), unit, rg, dn);
      prefetch(s - 1);
    }
    VLSEQ_MARK(1, 3, s);
    if (ln.cluster)
      ln.mbox.wait(cur, ((smax - 1 - s) >> 1) & 1);
    else if constexpr (kLocal)
      worker_barrier(ln.workers);
    else
      bar.wait();
  }
#endif
}

// The kernel tables (rnn_kernels.cuh declares them): the fused kernels for fp32 where asked, the
// generic ones otherwise.
#define VLSEQ_RNN_BT_SWITCH(KERNEL, ...)                  \
  switch (bt) {                                           \
    case 1: return (const void*)KERNEL<__VA_ARGS__, 1>;   \
    case 2: return (const void*)KERNEL<__VA_ARGS__, 2>;   \
    case 4: return (const void*)KERNEL<__VA_ARGS__, 4>;   \
    default: return (const void*)KERNEL<__VA_ARGS__, 8>;  \
  }
#define VLSEQ_RNN_WIDE_SWITCH(KERNEL, C)                   \
  switch (bt) {                                            \
    case 1: return (const void*)KERNEL<C, false, 1, true>; \
    case 2: return (const void*)KERNEL<C, false, 2, true>; \
    default: return (const void*)KERNEL<C, false, 4, true>; \
  }
static_assert(kWideMaxTile == 4, "VLSEQ_RNN_WIDE_SWITCH builds tiles 1, 2 and 4");
#define VLSEQ_RNN_KERNEL_TABLE(NAME, GENERIC, FUSED)                                  \
  const void* NAME(Cell c, Weights w, int bt, bool fused, bool local, bool wide) {    \
    const bool lstm = c == Cell::kLSTM;                                               \
    if (fused && wide && lstm) VLSEQ_RNN_WIDE_SWITCH(FUSED, Cell::kLSTM)              \
    if (fused && wide) VLSEQ_RNN_WIDE_SWITCH(FUSED, Cell::kGRU)                       \
    if (fused && lstm && local) VLSEQ_RNN_BT_SWITCH(FUSED, Cell::kLSTM, true)         \
    if (fused && lstm) VLSEQ_RNN_BT_SWITCH(FUSED, Cell::kLSTM, false)                 \
    if (fused && local) VLSEQ_RNN_BT_SWITCH(FUSED, Cell::kGRU, true)                  \
    if (fused) VLSEQ_RNN_BT_SWITCH(FUSED, Cell::kGRU, false)                          \
    if (w == Weights::kFP32 && lstm) VLSEQ_RNN_BT_SWITCH(GENERIC, Cell::kLSTM, float) \
    if (w == Weights::kFP32) VLSEQ_RNN_BT_SWITCH(GENERIC, Cell::kGRU, float)          \
    if (lstm) VLSEQ_RNN_BT_SWITCH(GENERIC, Cell::kLSTM, __nv_bfloat16)                \
    VLSEQ_RNN_BT_SWITCH(GENERIC, Cell::kGRU, __nv_bfloat16)                           \
  }

#endif  // __CUDACC__

}  // namespace vlseq::rnn
