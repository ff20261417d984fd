// The fused backward with a reduce-scatter: W_hh in registers and the cell fused as in
// rnn_fused_kernels.cuh, but each step sends partial sums of dh_{t-1} to the units' owners instead of
// every unit's gate gradients to every block. Per sample and step a block of a 16-block cluster at
// hidden 256 then sends 64 float4s instead of 256 and reads 4 KB of shared memory instead of 32 KB
// (the all-gather's sends, ~1 clock each, and its reads bound it at several samples per block:
// BENCHMARKS.md, eighth session); the price is two __syncthreads per step. rnn.cu picks it, or the
// all-gather kernel, or the generic one, per layout by the cost model; fits_scatter says where it
// applies (fp32, hs a multiple of 4, the block's W_hh rows in 64 registers per thread).
//
// Work split (block `rank` owns units [j0, j0 + hv) of the group's slots, as in the other kernels)
// -----------------------------------------------------------------------------------------------
//   cell thread t < BT * hs: slot b = t / hs, unit j = t % hs. It sums the nc partial dh_t of its
//       (sample, unit) that the blocks delivered (in rank order), runs the cell's backward, writes
//       the step's gate gradients to global memory and, as a float4 (gates), to gsm[b][j].
//   product thread t < (hs / 4) * (Kp / 4): unit group u = t / (Kp / 4) (units 4u .. 4u + 3), chunk
//       c = t % (Kp / 4) (k = 4c .. 4c + 3). It holds W_hh[gate * H + j0 + 4u + i][4c .. 4c + 3] for
//       its 4 units and every gate (64 floats) and writes, per running sample, the float4 of
//       sum over its units and gates of W_hh[row][k] * g[row] to red[b][u][c].
//   then thread t sums chunk c = t % C4 for samples t / C4, t / C4 + kThreads / C4, ...: the sum over u
//       (in order) of red[b][u][c] is this block's partial dh_{t-1} of units 4c .. 4c + 3, sent as one
//       float4 to their owner's recv. Its owner and the cluster addresses there are worked out once, before
//       the steps: with a division by C4 and by hs and two mapa per send, this phase had cost ~4.8 clocks
//       a send, twice what it does now (LSTM 256, 5 samples a block: 1,545 -> 750 clocks a step;
//       BENCHMARKS.md, twenty-second session).
//
// Synchronisation (cluster; a single block replaces the mailbox wait by a __syncthreads)
// -------------------------------------------------------------------------------------
// recv is double-buffered by step parity: step s's partials go to buffer s & 1 of their owner and
// are read by its cell threads at step s - 1, after the wait for that buffer's bytes (every thread
// waits; the acquire makes the stores visible). A block writes buffer s & 1 of a peer again only at
// step s - 2, after its own wait at step s - 1, which needs the peer's step s - 1 sends, which the
// peer makes after its barriers of step s - 1, so after its cell threads' reads of buffer s & 1. The
// mailbox of a buffer is armed (thread 0) at the start of the step whose sends fill it, after the
// wait for its previous fill (step s + 2's, waited at step s + 2). Within the block, barrier A (after
// the cell) orders gsm's writes before the products' reads and the previous step's reads of red
// before its new writes; barrier B (after the products) orders red's writes before the sums and
// gsm's reads before the next step's writes.
#pragma once

#include "rnn_fused_kernels.cuh"

namespace vlseq::rnn {

#if defined(__CUDACC__)

template <Cell C, int BT>
__global__ void __launch_bounds__(kThreads, 1) rnn_backward_scatter_kernel(const BackwardArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int G = C == Cell::kLSTM ? 4 : 3;
  constexpr int F = backward_fields(C);
  const Geometry& g = a.g;
  const int H = g.H, T = g.T, hs = g.hs, nc = g.nc, C4 = round_up(H, 4) / 4, U = hs / 4;
  const int tid = threadIdx.x;
  extern __shared__ __align__(16) unsigned char smem[];
  const ScatterSmem lay(g, BT);
  const Block blk(g);
  const Slots<BT> slots(g, blk, a.lengths, a.order, reinterpret_cast<int*>(smem + lay.lens));
  const Mailbox mbox(reinterpret_cast<uint64_t*>(smem + lay.bars));
  const bool cluster = g.sync == Sync::kCluster;
  float* recv = reinterpret_cast<float*>(smem + lay.recv);  // [parity][source block][BT][hs]: partial dh
  float4* gsm = reinterpret_cast<float4*>(smem + lay.g);    // [BT][hs]: the step's gate gradients
  float4* red = reinterpret_cast<float4*>(smem + lay.red);  // [BT][U][C4]: partials per unit group

  for (int e = tid; e < BT * hs; e += kThreads) gsm[e] = make_float4(0.f, 0.f, 0.f, 0.f);  // units past hv stay so
  // The cell thread's (slot, unit) and state: dh and dc that enter the last step, the GRU's direct
  // path z * dh into the step before.
  const int cb = tid / hs, cj = tid - cb * hs;
  const bool cell = cb < slots.bv && cj < blk.hv;
  const int unit = blk.j0 + cj;
  const int64_t sample = cell ? slots.sample(cb) : 0;
  float dh_last = 0.0f, dc = 0.0f, ddir = 0.0f;
  if (cell) {
    dh_last = a.dh_n ? a.dh_n[sample * H + unit] : 0.0f;
    if constexpr (C == Cell::kLSTM) dc = a.dc_n ? a.dc_n[sample * H + unit] : 0.0f;
  }
  // The product thread's rows of W_hh (zero past the block's units and past H).
  const int pu = tid / C4, pc = tid - pu * C4;
  const bool prod = pu < U;
  float4 w[G][4];
#pragma unroll
  for (int q = 0; q < G; ++q) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int j = 4 * pu + i;
      float e[4];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const int k = 4 * pc + kk;
        e[kk] = prod && j < blk.hv && k < H ? __ldg(a.w_hh + static_cast<int64_t>(q * H + blk.j0 + j) * H + k) : 0.0f;
      }
      w[q][i] = make_float4(e[0], e[1], e[2], e[3]);
    }
  }
  GroupBarrier bar{g.sync, nullptr, static_cast<unsigned>(nc), 0u};
  int slot_len[BT];
  const int smax = slots.finish(bar, g.bs, slot_len);
  const int len = cell ? slots.lens[cb] : 0;
  // Each source block sends, per running sample, the float4 chunks that hold this block's units.
  const uint32_t chunk_bytes = static_cast<uint32_t>(nc * ceil_div(blk.hv, 4) * 16);
  // The sums' pairs of this thread, fixed for the kernel: chunk sc of samples sb0, sb0 + sstride, ...
  // (C4 <= kThreads), its owner and where it lands there (buffer 0, sample 0), mapped to the owner's
  // shared memory once (a send then costs no division and no mapa).
  const int sstride = kThreads / C4, sb0 = tid / C4, sc = tid - sb0 * C4;
  const bool sums = sb0 < sstride;
  const int sowner = sums ? 4 * sc / hs : 0;
  float* const sto = recv + blk.rank * BT * hs + (4 * sc - sowner * hs);
  const bool mapped = cluster && sums;
  const uint32_t sto_peer = mapped ? Mailbox::peer(smem_u32(sto), sowner) : 0u;
  const uint32_t sbar0 = mapped ? Mailbox::peer(mbox.bar(0), sowner) : 0u;
  const uint32_t sbar1 = mapped ? Mailbox::peer(mbox.bar(1), sowner) : 0u;

  float pnext[F];
  auto prefetch = [&](int s) {
    if (cell && s >= 0 && s < len) load_backward_fields<C>(a, sample, unit, len, s, pnext);
  };
  // The step after next's fields into L2, issued where the thread waits anyway (before barrier A they
  // measured ~190 clocks a step when the fields were in L2 already).
  auto ask_l2 = [&](int s) {
    if (cell && s >= 0 && s < len) load_backward_fields<C, F, true>(a, sample, unit, len, s, pnext);
  };
  prefetch(smax - 1);
  ask_l2(smax - 2);
  // Steps smax-1 .. 0, then s = -1: only the sums, for dh0.
  for (int s = smax - 1;; --s) {
    const int cur = s & 1;  // the buffer this step's partials fill
    const int nact = Slots<BT>::running(slot_len, s);
    if (cluster && s >= 0) mbox.expect(cur, nact * chunk_bytes);
    float p[F];
#pragma unroll
    for (int f = 0; f < F; ++f) p[f] = pnext[f];
    VLSEQ_MARK(1, 0, s);
    if (cell) {
      // dh_t: the blocks' partials from the step after when this sample ran it, else what entered
      // the sequence's end.
      float dh = dh_last;
      if (s + 1 < len) {
        const float* src = recv + ((cur ^ 1) * nc * BT + cb) * hs + cj;
        float sum = 0.0f;
        for (int q = 0; q < nc; ++q) sum += src[q * BT * hs];
        dh = sum + ddir;
      }
      if (s < 0) {
        a.dh0[sample * H + unit] = dh;
        if constexpr (C == Cell::kLSTM) a.dc0[sample * H + unit] = dc;
      } else if (s < len) {
        float rg[4], dn = 0.0f;
        backward_cell<C>(p, dh, dc, ddir, rg, dn);
        gsm[cb * hs + cj] = make_float4(rg[0], rg[1], rg[2], rg[3]);
        store_gate_grads<C>(a, sample * T + (g.reverse ? len - 1 - s : s), unit, rg, dn);
      }
    }
    if (s < 0) break;
    prefetch(s - 1);
    __syncthreads();  // A
    VLSEQ_MARK(1, 1, s);
    if (prod) {
#pragma unroll
      for (int b = 0; b < BT; ++b) {
        if (b >= nact) break;
        const float4* gb = gsm + b * hs + 4 * pu;
        float4 part = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float4 gi = gb[i];
          const float gq[4] = {gi.x, gi.y, gi.z, gi.w};
#pragma unroll
          for (int q = 0; q < G; ++q) {
            part.x = fmaf(w[q][i].x, gq[q], part.x);
            part.y = fmaf(w[q][i].y, gq[q], part.y);
            part.z = fmaf(w[q][i].z, gq[q], part.z);
            part.w = fmaf(w[q][i].w, gq[q], part.w);
          }
        }
        red[(b * U + pu) * C4 + pc] = part;
      }
    }
    __syncthreads();  // B
    VLSEQ_MARK(1, 2, s);
    for (int b = sums ? sb0 : nact; b < nact; b += sstride) {
      const float4* src = red + b * U * C4 + sc;
      float4 tot = src[0];
      int u = 1;
      for (; u + 2 < U; u += 3) {  // three loads in flight, added in order (the same bits)
        const float4 v0 = src[u * C4], v1 = src[(u + 1) * C4], v2 = src[(u + 2) * C4];
        tot.x += v0.x, tot.y += v0.y, tot.z += v0.z, tot.w += v0.w;
        tot.x += v1.x, tot.y += v1.y, tot.z += v1.z, tot.w += v1.w;
        tot.x += v2.x, tot.y += v2.y, tot.z += v2.z, tot.w += v2.w;
      }
      for (; u < U; ++u) {
        const float4 v = src[u * C4];
        tot.x += v.x, tot.y += v.y, tot.z += v.z, tot.w += v.w;
      }
      const int off = (cur * nc * BT + b) * hs;  // floats from (buffer 0, sample 0)
      if (cluster)
        Mailbox::send_mapped(sto_peer + 4u * off, cur ? sbar1 : sbar0, tot);
      else
        *reinterpret_cast<float4*>(sto + off) = tot;
    }
    ask_l2(s - 2);
    VLSEQ_MARK(1, 3, s);
    if (cluster)
      mbox.wait(cur, ((smax - 1 - s) >> 1) & 1);
    else
      __syncthreads();
  }
#endif
}

// Its kernel table (rnn_kernels.cuh declares backward_scatter_kernel; rnn_backward_scatter.cu
// instantiates it).
#define VLSEQ_RNN_SCATTER_TABLE(NAME)                                                  \
  const void* NAME(Cell c, int bt) {                                                   \
    if (c == Cell::kLSTM) VLSEQ_RNN_BT_SWITCH(rnn_backward_scatter_kernel, Cell::kLSTM) \
    VLSEQ_RNN_BT_SWITCH(rnn_backward_scatter_kernel, Cell::kGRU)                       \
  }

#endif  // __CUDACC__

}  // namespace vlseq::rnn
