"""Merge suite (targets M1, M2): gradient merge of the seed model and all-reduce of flat buffers.

Every method has all-reduce semantics: afterwards every device holds the sum (the seed's
stack-sum and reduce_add_coalesced therefore copy the sum back to every device, as the corrected
seed loop must). Buffers are summed in place again and again while timing, so their values
grow (to inf eventually): that does not change the work done.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.cuda.comm  # noqa: F401  (not imported by `import torch`)
from torch import Tensor

from .. import ops, reference
from ..training.replicas import GradientMerger
from ..models import SeqModel
from .results import SIZES, Results, Task
from .timing import Budget, stats, synchronizer, time_loop

Grads = List[List[Tensor]]  # grads[d][p]: tensor p of device d
MergeFn = Callable[[], None]


# ------------------------------------------------------------------------------------------------
# methods: each takes per-device tensor lists and returns a merge() closure
def seed_style(grads: Grads) -> MergeFn:
    """The seed's per-parameter stack-sum, corrected: move parameter p's grads to one device,
    stack, sum, copy the sum back into every device's grad."""
    dev0 = grads[0][0].device

    def merge() -> None:
        for p in range(len(grads[0])):
            s = torch.stack([gs[p].to(dev0, non_blocking=True) for gs in grads]).sum(0)
            for gs in grads:
                gs[p].copy_(s, non_blocking=True)
    return merge


def reduce_add_coalesced(grads: Grads) -> MergeFn:
    """torch.cuda.comm.reduce_add_coalesced to device 0 (what DataParallel's backward uses), then
    the sum copied back to every device."""
    dest = grads[0][0].device.index

    def merge() -> None:
        out = torch.cuda.comm.reduce_add_coalesced(grads, destination=dest)
        for gs in grads:
            for g, o in zip(gs, out):
                g.copy_(o, non_blocking=True)
    return merge


def cat_nccl(grads: Grads) -> MergeFn:
    """torch.cat into one flat buffer per device, torch.cuda.nccl.all_reduce, copy back. For a
    single flat tensor per device (the flat-buffer sizes) the cat and the copy are skipped."""
    if all(len(gs) == 1 for gs in grads):
        return nccl_flat([gs[0] for gs in grads])
    numels = [g.numel() for g in grads[0]]

    def merge() -> None:
        flats = [torch.cat([g.view(-1) for g in gs]) for gs in grads]
        torch.cuda.nccl.all_reduce(flats)
        for gs, f in zip(grads, flats):
            torch._foreach_copy_(gs, [v.view_as(g) for v, g in zip(f.split(numels), gs)])
    return merge


def vlseq_unfused(grads: Grads) -> MergeFn:
    """Our ops, unfused: ops.flatten each device's grads into a flat buffer, ops.all_reduce_ the
    buffers, ops.unflatten_ back (three launches per device where GradientMerger.merge makes one)."""
    flats = [torch.empty(sum(g.numel() for g in gs), dtype=gs[0].dtype, device=gs[0].device) for gs in grads]

    def merge() -> None:
        for gs, f in zip(grads, flats):
            ops.flatten(gs, out=f)
        ops.all_reduce_(flats, "sum")
        for gs, f in zip(grads, flats):
            ops.unflatten_(f, gs)
    return merge


def nccl_flat(bufs: Sequence[Tensor]) -> MergeFn:
    """Bare torch.cuda.nccl.all_reduce of buffers that are already flat (a lower bound for NCCL)."""
    bufs = list(bufs)
    return lambda: torch.cuda.nccl.all_reduce(bufs)


ONE_CPU_ALGO = "the CPU kernel has one algorithm (the algo argument only matters on GPUs)"
CANDIDATE_ALGOS = ("auto", "root", "one_shot", "two_shot", "copy_engine")


def accepted_algos(call: Callable[[List[Tensor], str], None]) -> List[str]:
    """The algo names this build's op accepts, probed on two tiny CPU tensors (the CPU kernels
    validate the name exactly as the CUDA ones do)."""
    ok = []
    for algo in CANDIDATE_ALGOS:
        try:
            call([torch.zeros(4), torch.zeros(4)], algo)
            ok.append(algo)
        except (RuntimeError, ValueError, TypeError):
            pass
    return ok


# ------------------------------------------------------------------------------------------------
def _seed_params(devices: Sequence[torch.device]) -> Grads:
    """One SeqModel per device with random grads (different on every device)."""
    lists = []
    for i, d in enumerate(devices):
        torch.manual_seed(i)
        m = SeqModel().to(d)
        for p in m.parameters():
            p.grad = torch.randn_like(p)
        lists.append(list(m.parameters()))
    return lists


def tasks(devices: List[torch.device], budget: Budget, res: Results) -> Tuple[List[Task], List[tuple]]:
    """The merge suite's tasks, plus its DDP jobs [(job, on_result)] to run in spawned processes."""
    if len(devices) < 2:
        res.skip("merge", f"needs >= 2 devices, got {len(devices)} (try --devices cpu:2)")
        return [], []
    cuda = devices[0].type == "cuda"
    have_kernels = not cuda or ops.has_cuda_kernels()
    sync = synchronizer(devices)
    ddp_name = "ddp_nccl" if cuda else "ddp_gloo"
    out: List[Task] = []
    ddp: List[tuple] = []
    res.set("merge.devices", [str(d) for d in devices])

    def add(key: str, fn: Callable[[], None], needs_cuda: bool = False, ours: bool = False) -> None:
        if needs_cuda and not cuda:
            res.skip(key, "needs CUDA devices (this run is on CPU)")
        elif ours and not have_kernels:
            res.skip(key, "the extension was built without CUDA kernels")
        else:
            out.append(Task("merge", key, fn))

    # -- copy-engine P2P bandwidth (the ceiling for M2) and which path our ops take ---------------
    def p2p_copy() -> None:
        src = torch.ones(SIZES["256MB"], dtype=torch.uint8, device=devices[0])
        dst = torch.empty(SIZES["256MB"], dtype=torch.uint8, device=devices[1])
        ts = time_loop(lambda: dst.copy_(src, non_blocking=True), sync, repeats=budget.merge_repeats, warmup=2,
                       target_s=budget.flat_target_s, min_iters=3)
        st = stats([SIZES["256MB"] / t / 1e9 for t in ts])
        res.set("merge.p2p_copy_gbps", st["median"])
        res.set("merge.p2p_copy_gbps_spread", st)
        res.set("merge.p2p_copy_direction", f"{devices[0]}->{devices[1]}")
    add("merge.p2p_copy_gbps", p2p_copy, needs_cuda=True)

    def p2p_copy_bidir() -> None:
        """Both directions at once: 256 MB device 0 -> 1 and 256 MB 1 -> 0, each copy on its own
        pair of streams (a peer copy runs on the source's current stream and waits for the
        destination's), so the two run concurrently. GB/s per direction: the ceiling of a 2-GPU
        all-reduce, which must move the buffer both ways at the same time."""
        nbytes = SIZES["256MB"]
        d0, d1 = devices[0], devices[1]
        a0, b0 = torch.ones(nbytes, dtype=torch.uint8, device=d0), torch.empty(nbytes, dtype=torch.uint8, device=d0)
        a1, b1 = torch.ones(nbytes, dtype=torch.uint8, device=d1), torch.empty(nbytes, dtype=torch.uint8, device=d1)
        fwd = (torch.cuda.Stream(d0), torch.cuda.Stream(d1))
        back = (torch.cuda.Stream(d0), torch.cuda.Stream(d1))

        def both() -> None:
            with torch.cuda.stream(fwd[0]), torch.cuda.stream(fwd[1]):
                b1.copy_(a0, non_blocking=True)
            with torch.cuda.stream(back[0]), torch.cuda.stream(back[1]):
                b0.copy_(a1, non_blocking=True)
        ts = time_loop(both, sync, repeats=budget.merge_repeats, warmup=2, target_s=budget.flat_target_s, min_iters=3)
        st = stats([nbytes / t / 1e9 for t in ts])
        res.set("merge.p2p_copy_bidir_gbps", st["median"])
        res.set("merge.p2p_copy_bidir_gbps_spread", st)
    add("merge.p2p_copy_bidir_gbps", p2p_copy_bidir, needs_cuda=True)

    def p2p_status() -> None:
        res.set("merge.p2p_status", ops.p2p_status([torch.empty(16, device=d) for d in devices]))
    add("merge.p2p_status", p2p_status)

    # -- seed model's gradients --------------------------------------------------------------
    P = list(SeqModel().parameters())
    res.set("merge.seed_model", {"numel": sum(p.numel() for p in P), "tensors": len(P),
                                 "bytes": 4 * sum(p.numel() for p in P), "min_merges_per_repeat": budget.seed_merges})
    def grads(ps: Grads) -> Grads:
        return [[p.grad for p in l] for l in ps]

    seed_methods: Dict[str, Tuple[Callable[[Grads], MergeFn], bool, bool]] = {  # name: (factory on params, cuda, ours)
        "seed_style": (lambda ps: seed_style(grads(ps)), False, False),
        "reference": (lambda ps: partial(reference.all_reduce_tensors_, grads(ps), 1.0), False, False),
        "reduce_add_coalesced": (lambda ps: reduce_add_coalesced(grads(ps)), True, False),
        "cat_nccl": (lambda ps: cat_nccl(grads(ps)), True, False),
        "nccl_flat": (lambda ps: nccl_flat([torch.cat([g.view(-1) for g in gs]) for gs in grads(ps)]), True, False),
        "vlseq": (lambda ps: GradientMerger(ps).merge, False, True),
        "vlseq_unfused": (lambda ps: vlseq_unfused(grads(ps)), False, True),
    }
    # ops.all_reduce_tensors_ (what the fused merger calls) with each algorithm this build has
    for algo in accepted_algos(lambda b, a: ops.all_reduce_tensors_([[t] for t in b], 1.0, a)):
        if algo != "auto":
            seed_methods[f"vlseq_{algo}"] = (lambda ps, a=algo: partial(ops.all_reduce_tensors_, grads(ps), 1.0, a),
                                             True, True)
    for name, (factory, needs_cuda, ours) in seed_methods.items():
        if cuda and name == "reference":
            continue  # the reference is the CPU stand-in; on GPUs the built-ins are the baselines
        if not cuda and name.startswith("vlseq_") and name != "vlseq_unfused":
            res.skip(f"merge.seed_model.{name}", ONE_CPU_ALGO)
            continue

        def run(factory=factory, name=name) -> None:
            fn = factory(_seed_params(devices))
            ts = time_loop(fn, sync, repeats=budget.merge_repeats, warmup=3, target_s=budget.seed_target_s,
                           min_iters=budget.seed_merges)
            res.record("merge.seed_model.us_per_merge", name, [t * 1e6 for t in ts])
        add(f"merge.seed_model.{name}", run, needs_cuda, ours)
    ddp.append(({"key": f"merge.seed_model.{ddp_name}", "kind": "merge_seed",
                 "timing": {"repeats": budget.merge_repeats, "target_s": budget.seed_target_s,
                            "min_iters": budget.seed_merges}},
                lambda r: res.record("merge.seed_model.us_per_merge", ddp_name, [t * 1e6 for t in r["times"]])))

    # -- flat buffers ------------------------------------------------------------------------
    # CPU: smaller sizes only (a 256 MB bf16 sum on one core takes seconds per call)
    sizes = SIZES if cuda else {k: SIZES[k] for k in (("1MB",) if budget.quick else ("1MB", "16MB", "64MB"))}
    flat_methods: Dict[str, Tuple[Callable[[List[Tensor]], MergeFn], bool, bool]] = {
        "seed_style": (lambda b: seed_style([[t] for t in b]), False, False),
        "reference": (lambda b: partial(reference.all_reduce_, b, "sum"), False, False),
        "reduce_add_coalesced": (lambda b: reduce_add_coalesced([[t] for t in b]), True, False),
        "cat_nccl": (nccl_flat, True, False),
    }
    for algo in accepted_algos(lambda b, a: ops.all_reduce_(b, "sum", a)):
        flat_methods["vlseq" if algo == "auto" else f"vlseq_{algo}"] = (
            lambda b, a=algo: partial(ops.all_reduce_, b, "sum", a), algo != "auto", True)
    for dt_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for size, nbytes in sizes.items():
            path = f"merge.flat_{dt_name}.{size}"
            numel = nbytes // dtype.itemsize
            res.set(path + ".bytes", nbytes)
            res.set(path + ".numel", numel)

            def record(ts: List[float], name: str, path: str = path, nbytes: int = nbytes) -> None:
                res.record(path + ".us", name, [t * 1e6 for t in ts])
                res.record(path + ".algbw_gbps", name, [nbytes / t / 1e9 for t in ts])

            for name, (factory, needs_cuda, ours) in flat_methods.items():
                if cuda and name == "reference":
                    continue
                if not cuda and name.startswith("vlseq_"):
                    res.skip(f"{path}.{name}", ONE_CPU_ALGO)
                    continue

                def run(factory=factory, name=name, numel=numel, dtype=dtype, record=record) -> None:
                    bufs = [torch.ones(numel, dtype=dtype, device=d) for d in devices]
                    ts = time_loop(factory(bufs), sync, repeats=budget.merge_repeats, warmup=2,
                                   target_s=budget.flat_target_s, min_iters=3)
                    record(ts, name)
                add(f"{path}.{name}", run, needs_cuda, ours)
            ddp.append(({"key": f"{path}.{ddp_name}", "kind": "merge_flat", "numel": numel,
                         "dtype": str(dtype).split(".")[-1],
                         "timing": {"repeats": budget.merge_repeats, "target_s": budget.flat_target_s, "min_iters": 3}},
                        lambda r, record=record: record(r["times"], ddp_name)))

    return out, ddp
