"""Ad-hoc device probe behind the design choices in BENCHMARKS.md: op correctness on 2 GPUs, merge
and flat all-reduce timings by algorithm (crossover), option 1 vs option 2 of the trainer step,
per-device busy time, dispatcher and launch costs. Run on a 2-GPU machine after
`pip install --no-build-isolation -e .`: `OUT=dir python3 benchmarks/probe.py [section ...]`.
The product benchmark is `vlseq-bench`; this is the measurement notebook that came before it."""
import copy, json, os, sys, time, statistics, traceback
import torch
import torch.cuda.comm
import torch.cuda.nccl
from torch import nn
import vlseq_ext
from vlseq_ext import ops, reference, SeqModel, ParallelTrainer, GradientMerger

OUT = os.environ.get("OUT", "/tmp")
R = {"env": {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
             "p2p01": torch.cuda.can_device_access_peer(0, 1) if torch.cuda.device_count() > 1 else None}}
fails = []
def check(name, cond, detail=""):
    if not cond:
        fails.append(f"{name}: {detail}")
        print("FAIL", name, detail, flush=True)

def section(f):
    try:
        t = time.time(); f(); print(f"== {f.__name__} done in {time.time()-t:.1f}s", flush=True)
    except Exception:
        tb = traceback.format_exc(); fails.append(f"{f.__name__}: EXC {tb[-800:]}"); print(tb, flush=True)

def t_flatten():
    d = "cuda:0"
    dts = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
    for fd in dts:
        for td in dts:
            base = torch.randn(5000, device=d, dtype=td)
            ts = [torch.randn(3, 4, device=d, dtype=td), None, base[1:4098], torch.randn(7, device=d, dtype=td),
                  torch.randn(20, 30, device=d, dtype=td).t(), torch.randn(1_000_003, device=d, dtype=td), torch.randn(1, device=d, dtype=td)]
            numels = [12, 5, 4097, 7, 600, 1_000_003, 1]
            out = torch.full((sum(numels) + 3,), float("nan"), device=d, dtype=fd)
            ref = out.clone()
            ops.flatten(ts, out=out, numels=numels, scale=0.37)
            reference.flatten_(ts, numels, ref, 0.37)
            check(f"flatten {td}->{fd}", torch.equal(out[:-3], ref[:-3]) and out[-3:].isnan().all().item(),
                  f"maxdiff {(out[:-3].double()-ref[:-3].double()).abs().max().item()}")
            dst = [torch.full_like(t, float("nan")) if t is not None else torch.full((5,), float("nan"), device=d, dtype=td) for t in ts]
            dst[4] = torch.full((30, 20), float("nan"), device=d, dtype=td).t()
            rdst = [x.clone() for x in dst]
            ops.unflatten_(out, dst, 1.5)
            reference.unflatten_(out, rdst, 1.5)
            check(f"unflatten {fd}->{td}", all(torch.equal(a, b) for a, b in zip(dst, rdst)))
    many = [torch.randn(i % 37 + 1, device=d) for i in range(200)]
    out = ops.flatten(many); check("flatten 200", torch.equal(out, torch.cat([m.view(-1) for m in many])))

def t_allreduce():
    N = torch.cuda.device_count()
    devs = [f"cuda:{i}" for i in range(N)]
    for n in [1, 3, 4097, 1_000_003, 2**24]:
        for dt in [torch.float32, torch.bfloat16, torch.float16]:
            src = [torch.randn(n, device=dv, dtype=dt) for dv in devs]
            bits = None
            for algo in ["root", "one_shot", "two_shot", "copy_engine", "auto"]:
                for op in ["sum", "mean"]:
                    bufs = [s.clone() for s in src]
                    refb = [s.clone() for s in src]
                    ops.all_reduce_(bufs, op, algo)
                    reference.all_reduce_(refb, op)
                    ok = all(torch.equal(b, refb[0].to(b.device)) for b in bufs)
                    check(f"allreduce n={n} {dt} {algo} {op}", ok,
                          f"maxdiff {max((b.double().cpu()-refb[0].double().cpu()).abs().max().item() for b in bufs)}")
                    f64 = sum(s.double().cpu() for s in src) / (N if op == "mean" else 1)
                    err = ((bufs[0].double().cpu() - f64).norm() / f64.norm()).item()
                    check(f"allreduce-f64 n={n} {dt} {algo} {op}", err < (1e-6 if dt == torch.float32 else 1e-2), f"relerr {err}")
    # determinism
    src = [torch.randn(3_000_001, device=dv) for dv in devs]
    outs = set()
    for i in range(50):
        bufs = [s.clone() for s in src]; ops.all_reduce_(bufs, "sum", ["one_shot", "two_shot", "copy_engine"][i % 3])
        outs.add(hash(bufs[-1].cpu().numpy().tobytes()))
    check("determinism", len(outs) == 1, f"{len(outs)} distinct")
    # race stress
    n = 1 << 16
    bufs = [torch.empty(n, device=dv) for dv in devs]
    errs = [torch.zeros((), device=dv) for dv in devs]
    g = torch.Generator().manual_seed(0)
    for it in range(300):
        for r, dv in enumerate(devs):
            with torch.cuda.device(dv):
                torch.cuda._sleep(int(torch.randint(0, 200000, (1,), generator=g)))
                bufs[r].fill_(float(it % 7 + r))
        ops.all_reduce_(bufs, "sum", ["one_shot", "two_shot", "auto", "copy_engine", "root"][it % 5])
        exp = sum(float(it % 7 + r) for r in range(N))
        for r, dv in enumerate(devs):
            with torch.cuda.device(dv):
                errs[r] += (bufs[r] - exp).abs().sum()
    check("race", all(e.item() == 0 for e in errs), str([e.item() for e in errs]))
    # multi-tensor + broadcast
    m = SeqModel().cuda(0)
    reps = [m] + [copy.deepcopy(m).to(dv) for dv in devs[1:]]
    for r in reps:
        x = torch.randn(int(torch.randint(50, 500, (1,))), 36, device=next(r.parameters()).device)
        r(x).sum().backward()
    grads = [[p.grad for p in r.parameters()] for r in reps]
    rg = [[g.clone() for g in gs] for gs in grads]
    for algo in ["root", "two_shot", "copy_engine"]:
        gg = [[g.clone() for g in gs] for gs in grads]; rr = [[g.clone() for g in gs] for gs in grads]
        ops.all_reduce_tensors_(gg, 0.5, algo); reference.all_reduce_tensors_(rr, 0.5)
        check(f"all_reduce_tensors_ {algo}", all(torch.equal(a, b) for gs, rs in zip(gg, rr) for a, b in zip(gs, rs)))
    gg = [[g.clone() for g in gs] for gs in grads]; rr = [[g.clone() for g in gs] for gs in grads]
    ops.reduce_tensors_(gg, 0.25, True); reference.reduce_tensors_(rr, 0.25, True)
    check("reduce_tensors_", all(torch.equal(a, b) for gs, rs in zip(gg, rr) for a, b in zip(gs, rs)))
    with torch.no_grad():
        for p in reps[1].parameters(): p.normal_()
        ops.broadcast_tensors_([p for p in reps[0].parameters()], [[p for p in r.parameters()] for r in reps[1:]])
    check("broadcast_tensors_", all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(reps[0].parameters(), reps[-1].parameters())))
    R["p2p_status"] = ops.p2p_status([torch.empty(1, device=dv) for dv in devs])

def timeit(fn, iters, reps=7, warm=3):
    for _ in range(warm): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        for i in range(torch.cuda.device_count()): torch.cuda.synchronize(i)
        t = time.perf_counter()
        for _ in range(iters): fn()
        for i in range(torch.cuda.device_count()): torch.cuda.synchronize(i)
        ts.append((time.perf_counter() - t) / iters)
    return statistics.median(ts), min(ts), max(ts)

def t_merge_bench():
    N = torch.cuda.device_count(); devs = [f"cuda:{i}" for i in range(N)]
    m = SeqModel().cuda(0)
    reps = [m] + [copy.deepcopy(m).to(dv) for dv in devs[1:]]
    for r in reps:
        for p in r.parameters(): p.grad = torch.randn_like(p)
    params = [list(r.parameters()) for r in reps]
    res = {}
    def seed_style():
        for pi in range(len(params[0])):
            s = torch.stack([params[d][pi].grad.to(devs[0]) for d in range(N)]).sum(0)
            for d in range(N): params[d][pi].grad.copy_(s)
    res["seed_style"] = timeit(seed_style, 500)
    def rac():
        outs = torch.cuda.comm.reduce_add_coalesced([[p.grad for p in ps] for ps in params], destination=0)
    res["reduce_add_coalesced"] = timeit(rac, 500)
    def cat_nccl():
        flats = [torch.cat([p.grad.view(-1) for p in ps]) for ps in params]
        torch.cuda.nccl.all_reduce(flats)
        for ps, f in zip(params, flats):
            o = 0
            for p in ps: n = p.numel(); p.grad.copy_(f[o:o+n].view_as(p)); o += n
    res["cat_nccl"] = timeit(cat_nccl, 500)
    flats = [torch.cat([p.grad.view(-1) for p in ps]) for ps in params]
    res["bare_nccl"] = timeit(lambda: torch.cuda.nccl.all_reduce(flats), 500)
    mf = GradientMerger(params, fused=True); mu = GradientMerger(params, fused=False)
    res["vlseq_fused"] = timeit(lambda: mf.merge(1.0), 500)
    res["vlseq_unfused"] = timeit(lambda: mu.merge(1.0), 500)
    gl = mf.grads()
    res["tensors_root"] = timeit(lambda: ops.all_reduce_tensors_(gl, 1.0, "root"), 500)
    res["tensors_two_shot"] = timeit(lambda: ops.all_reduce_tensors_(gl, 1.0, "two_shot"), 500)
    res["reduce_tensors"] = timeit(lambda: ops.reduce_tensors_(gl, 1.0, True), 500)
    res["raw_op_fused"] = timeit(lambda: torch.ops.vlseq_ext.all_reduce_tensors_(gl.flat, N, 1.0, "root"), 500)
    res["raw_op_scale_1dev"] = timeit(lambda: torch.ops.vlseq_ext.all_reduce_tensors_(gl.lists[0], 1, 0.5, "auto"), 500)
    res["flat_root"] = timeit(lambda: ops.all_reduce_(mu.flat_buffers, "sum", "root"), 500)
    res["sleep0_launch"] = timeit(lambda: torch.cuda._sleep(0), 500)
    # option 1 (master steps, broadcast) vs option 2 (every replica steps) for merge+optimizer+sync
    opts = [torch.optim.Adam(ps, lr=1e-9, fused=True) for ps in params]
    def option1():
        ops.reduce_tensors_(gl, 1.0, True); opts[0].step(); ops.broadcast_tensors_(params[0], params[1:])
    def option2():
        ops.all_reduce_tensors_(gl, 1.0); [o.step() for o in opts]
    with torch.no_grad():
        res["option1_master_step_broadcast"] = timeit(option1, 300)
        res["option2_replicated_step"] = timeit(option2, 300)
        res["fused_adam_step_only"] = timeit(lambda: opts[0].step(), 300)
        res["broadcast_params"] = timeit(lambda: ops.broadcast_tensors_(params[0], params[1:]), 300)
    res["flat_one_shot"] = timeit(lambda: ops.all_reduce_(mu.flat_buffers, "sum", "one_shot"), 500)
    res["flat_two_shot"] = timeit(lambda: ops.all_reduce_(mu.flat_buffers, "sum", "two_shot"), 500)
    g0 = [p.grad for p in params[0]]
    res["flatten_only"] = timeit(lambda: ops.flatten(g0, out=mu.flat_buffers[0]), 500)
    res["cat_only"] = timeit(lambda: torch.cat([g.view(-1) for g in g0]), 500)
    res["flatten_dense"] = timeit(lambda: torch._utils._flatten_dense_tensors(g0), 500)
    res["empty_loop"] = timeit(lambda: None, 500)
    one = [mu.flat_buffers[0]]
    res["dispatch_allreduce_1buf"] = timeit(lambda: torch.ops.vlseq_ext.all_reduce_(one, "sum", "auto"), 500)
    res["dispatch_p2p_status"] = timeit(lambda: torch.ops.vlseq_ext.p2p_status(mu.flat_buffers), 500)
    res["dispatch_tensors_N1"] = timeit(lambda: torch.ops.vlseq_ext.all_reduce_tensors_(gl.lists[0], 1, 1.0), 500)
    # multi-device CUDA graph of the fused merge
    try:
        g = torch.cuda.CUDAGraph()
        ss = [torch.cuda.Stream(dv) for dv in devs]
        for s_, dv in zip(ss, devs): s_.wait_stream(torch.cuda.current_stream(dv))
        torch.cuda.synchronize()
        with torch.cuda.device(0):
            import contextlib
            with contextlib.ExitStack() as st:
                for s_ in reversed(ss): st.enter_context(torch.cuda.stream(s_))
                st.enter_context(torch.cuda.device(0))
                g.capture_begin()
                for s_ in ss[1:]: s_.wait_stream(ss[0])
                torch.ops.vlseq_ext.all_reduce_tensors_(flat_args, N, 1.0)
                for s_ in ss[1:]: ss[0].wait_stream(s_)
                g.capture_end()
        torch.cuda.synchronize()
        evs = [torch.cuda.Event() for _ in devs]
        cur = [torch.cuda.current_stream(dv) for dv in devs]
        def replay():
            for i in range(1, N): evs[i].record(cur[i]); cur[0].wait_event(evs[i])
            g.replay()
            evs[0].record(cur[0])
            for i in range(1, N): cur[i].wait_event(evs[0])
        # correctness of the graph replay
        for gs in gl.lists:
            for t in gs: t.normal_()
        ref = [[t.clone() for t in gs] for gs in gl.lists]
        reference.all_reduce_tensors_(ref, 1.0)
        replay(); torch.cuda.synchronize()
        check("graph merge correct", all(torch.equal(a, b) for gs, rs in zip(gl.lists, ref) for a, b in zip(gs, rs)))
        res["graph_merge_replay"] = timeit(replay, 500)
        res["graph_replay_only"] = timeit(lambda: g.replay(), 500)
    except Exception as e:
        fails.append(f"graph merge: {e!r}"); print("graph merge failed", repr(e))
    R["m1_us"] = {k: [round(x * 1e6, 2) for x in v] for k, v in res.items()}
    print(json.dumps(R["m1_us"], indent=1), flush=True)

def t_flat_bench():
    N = torch.cuda.device_count(); devs = [f"cuda:{i}" for i in range(N)]
    res = {}
    src = torch.randn(64 << 20, device="cuda:0"); dst = torch.empty(64 << 20, device="cuda:1")
    t = timeit(lambda: dst.copy_(src, non_blocking=True), 10, reps=5)
    res["p2p_copy_gbps_256MB"] = 256e6 * 1.048576 / t[0] / 1e9
    src1 = torch.randn(64 << 20, device="cuda:1"); dst0 = torch.empty(64 << 20, device="cuda:0")
    def bidir():
        with torch.cuda.device(0): dst.copy_(src, non_blocking=True)
        with torch.cuda.device(1): dst0.copy_(src1, non_blocking=True)
    t = timeit(bidir, 10, reps=5)
    res["p2p_copy_bidir_gbps_per_dir"] = 256e6 * 1.048576 / t[0] / 1e9
    dd = torch.empty_like(src)
    t = timeit(lambda: dd.copy_(src), 20, reps=5)
    res["d2d_copy_gbps_rw"] = 2 * 256e6 * 1.048576 / t[0] / 1e9
    for nbytes in [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]:
        n = nbytes // 4
        bufs = [torch.randn(n, device=dv) for dv in devs]
        iters = 200 if nbytes <= (1 << 20) else (50 if nbytes <= (16 << 20) else 10)
        row = {}
        for algo in ["root", "one_shot", "two_shot", "copy_engine"]:
            row[algo] = nbytes / timeit(lambda: ops.all_reduce_(bufs, "sum", algo), iters, reps=5)[0] / 1e9
        row["nccl"] = nbytes / timeit(lambda: torch.cuda.nccl.all_reduce(bufs), iters, reps=5)[0] / 1e9
        res[f"algbw_{nbytes>>10}KB"] = {k: round(v, 1) for k, v in row.items()}
    # flatten bandwidth: 256MB over 200 tensors
    ts = [torch.randn((64 << 20) // 200, device="cuda:0") for _ in range(200)]
    tot = sum(t.numel() for t in ts); out = torch.empty(tot, device="cuda:0")
    t = timeit(lambda: ops.flatten(ts, out=out), 20, reps=5)
    res["flatten_256MB_200_gbps_rw"] = 2 * tot * 4 / t[0] / 1e9
    t = timeit(lambda: torch.cat(ts, out=out), 20, reps=5)
    res["cat_256MB_200_gbps_rw"] = 2 * tot * 4 / t[0] / 1e9
    R["flat"] = res
    print(json.dumps(res, indent=1), flush=True)

def make_data(n, seed=0, D=36):
    g = torch.Generator().manual_seed(seed)
    L = torch.randint(50, 501, (n,), generator=g)
    xs = [torch.randn(int(l), D, generator=g).pin_memory() for l in L]
    ys = [torch.randn(1, generator=g).pin_memory() for _ in L]
    return xs, ys

def t_trainer_correct():
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    N = torch.cuda.device_count()
    torch.manual_seed(1)
    xs, ys = make_data(7)
    for graphs in [False, True]:
        for k in [1, 3]:
            for red in ["sum", "mean"]:
                m = SeqModel().cuda(0); ref = copy.deepcopy(m).double().cpu()
                tr = ParallelTrainer(m, torch.optim.SGD(m.parameters(), lr=0.1), nn.MSELoss(), samples_per_device=k,
                                     reduction=red, cuda_graphs=graphs)
                nstep = N * k
                for rep in range(2):  # twice: second time replays graphs
                    tr.compute_gradients(xs[:nstep], ys[:nstep])
                ref.zero_grad()
                for x, y in zip(xs[:nstep], ys[:nstep]):
                    l = nn.MSELoss()(ref(x.double()), y.double().view(1, 1)); (l / (nstep if red == "mean" else 1)).backward()
                errs = [((p.grad.double().cpu() - q.grad).norm() / q.grad.norm()).item() for p, q in zip(m.parameters(), ref.parameters())]
                check(f"trainer grad graphs={graphs} k={k} {red}", max(errs) < 1e-5, f"{errs}")
    # graphs == eager exactly?
    m = SeqModel().cuda(0); m2 = copy.deepcopy(m)
    t1 = ParallelTrainer(m, torch.optim.Adam(m.parameters(), 1e-3), nn.MSELoss(), cuda_graphs=True)
    t2 = ParallelTrainer(m2, torch.optim.Adam(m2.parameters(), 1e-3), nn.MSELoss(), cuda_graphs=False)
    xs, ys = make_data(40, seed=3)
    xs = [x[:60 + (i % 3)] for i, x in enumerate(xs)]  # few lengths -> replays
    for s in range(0, 40, N):
        t1.step(xs[s:s+N], ys[s:s+N]); t2.step(xs[s:s+N], ys[s:s+N])
    d = max((a - b).abs().max().item() for a, b in zip(m.parameters(), m2.parameters()))
    check("graphs==eager trajectory", d < 1e-5, f"maxdiff {d}")
    torch.backends.cudnn.allow_tf32 = True
    R["graph_eq_maxdiff"] = d
    R["graph_stats"] = t1.graph_stats()

def t_train_bench():
    N = torch.cuda.device_count()
    xs, ys = make_data(640, seed=5)
    res = {}
    m = SeqModel().cuda(0); opt = torch.optim.Adam(m.parameters(), 1e-3); lf = nn.MSELoss()
    def plain(n=200):
        for x, y in zip(xs[:n], ys[:n]):
            opt.zero_grad(); l = lf(m(x.cuda(0, non_blocking=True)), y.cuda(0, non_blocking=True).view(1, 1)); l.backward(); opt.step()
    plain(20); torch.cuda.synchronize(); t = time.perf_counter(); plain(); torch.cuda.synchronize()
    res["plain_1gpu_k1"] = 200 / (time.perf_counter() - t)
    def make(devices=None, k=1, fused=True, **kw):
        m = SeqModel().cuda(0)
        tr = ParallelTrainer(m, torch.optim.Adam(m.parameters(), 1e-3, fused=fused), nn.MSELoss(), devices=devices,
                             samples_per_device=k, **kw)
        return tr
    def ours(tr, k, nsteps):
        S = len(tr.devices) * k
        for s in range(nsteps):
            i = (s * S) % (640 - S)
            tr.step(xs[i:i+S], ys[i:i+S])
    def rate(tr, k, nsteps, warm=10):
        ours(tr, k, warm); torch.cuda.synchronize(); t = time.perf_counter(); ours(tr, k, nsteps); torch.cuda.synchronize()
        return nsteps * k * len(tr.devices) / (time.perf_counter() - t)
    tr = make()
    t = time.perf_counter(); tr.warmup(range(50, 501)); torch.cuda.synchronize()
    res["warmup_all_lengths_s"] = time.perf_counter() - t
    res["vlseq_2gpu_k1"] = [rate(tr, 1, 300) for _ in range(3)]
    res["graph_stats"] = tr.graph_stats()
    tr = make(fused=False); tr.warmup(range(50, 501))
    res["vlseq_2gpu_k1_foreach_adam_sync_guard"] = rate(tr, 1, 200)
    tr = make(nonfinite="ignore"); tr.warmup(range(50, 501))
    res["vlseq_2gpu_k1_noguard"] = rate(tr, 1, 200)
    tr = make(devices=["cuda:0"]); tr.warmup(range(50, 501))
    res["vlseq_1gpu_k1"] = rate(tr, 1, 300)
    tr = make(cuda_graphs=False)
    res["vlseq_2gpu_k1_eager"] = rate(tr, 1, 100)
    tr = make(k=32); tr.warmup(range(50, 501))
    res["vlseq_2gpu_k32"] = [rate(tr, 32, 10, warm=2) for _ in range(3)]
    tr = make(devices=["cuda:0"], k=32); tr.warmup(range(50, 501))
    res["vlseq_1gpu_k32"] = rate(tr, 32, 10, warm=2)
    from torch.profiler import profile, ProfilerActivity
    tr = make(k=32); tr.warmup(range(50, 501)); ours(tr, 32, 2); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ours(tr, 32, 2); torch.cuda.synchronize()
    busy = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            busy[e.device_index] = busy.get(e.device_index, 0) + e.device_time
    res["k32_2steps_gpu_busy_us"] = busy
    tr = make(k=1); tr.warmup(range(50, 501)); ours(tr, 1, 5); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter(); ours(tr, 1, 50); torch.cuda.synchronize(); wall = time.perf_counter() - t
    busy = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            busy[e.device_index] = busy.get(e.device_index, 0) + e.device_time
    res["k1_50steps_wall_us"] = wall * 1e6
    res["k1_50steps_gpu_busy_us"] = busy
    res["k1_profile_table"] = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
    R["train"] = res
    print(json.dumps({k: v for k, v in res.items() if k != "k1_profile_table"}, indent=1, default=str), flush=True)
    print(res["k1_profile_table"])

which = sys.argv[1:] or ["t_flatten", "t_allreduce", "t_merge_bench", "t_flat_bench", "t_trainer_correct", "t_train_bench"]
for name in which:
    section(globals()[name])
R["fails"] = fails
json.dump(R, open(os.path.join(OUT, "probe.json"), "w"), indent=1, default=str)
print("FAILS:", len(fails))
for f in fails[:30]: print(" ", f[:300])
