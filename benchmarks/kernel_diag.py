"""Kernel time (torch.profiler) beside wall time, and host cost, for flatten / unflatten_ of 256 MB
over 200 tensors, the 256 MB two_shot all-reduce and the seed-model merge, on a 2-GPU machine:

    python3 benchmarks/kernel_diag.py k      # kernel vs wall times, one JSON line
    python3 benchmarks/kernel_diag.py host   # host time per call while the GPU is busy, and a CPU profile

The measurements behind the kernel-design notes in BENCHMARKS.md ("Fused flatten")."""
import sys, time, statistics, json, os, copy, torch
from torch.profiler import profile, ProfilerActivity
from vlseq_ext import ops, SeqModel, GradientMerger
mode = sys.argv[1]
d = "cuda:0"
def timeloop(fn, iters=20, reps=7, devs=(0,)):
    for _ in range(3): fn()
    for i in devs: torch.cuda.synchronize(i)
    r = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(iters): fn()
        for i in devs: torch.cuda.synchronize(i)
        r.append((time.perf_counter() - t) / iters)
    return statistics.median(r)
def host_cost(fn, iters=50):
    torch.cuda.synchronize(); torch.cuda._sleep(int(3e9))
    t = time.perf_counter()
    for _ in range(iters): fn()
    dt = (time.perf_counter() - t) / iters
    torch.cuda.synchronize(); return dt * 1e6
def ktime(fn, n=10, devs=(0,), match="vlseq"):
    for _ in range(3): fn()
    for i in devs: torch.cuda.synchronize(i)
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(n): fn()
        for i in devs: torch.cuda.synchronize(i)
    v = [e.device_time_total for e in p.events() if e.device_type.name == "CUDA" and match in e.name]
    return round(statistics.median(v), 1) if v else None
ts = [torch.randn((64 << 20) // 200, device=d) for _ in range(200)]
tot = sum(t.numel() for t in ts); out = torch.empty(tot, device=d)
numels = [t.numel() for t in ts]
if mode == "host":
    f = torch.ops.vlseq_ext.flatten_.default
    R = {"ops.flatten": host_cost(lambda: ops.flatten(ts, out=out)),
         "flatten_ direct": host_cost(lambda: f(ts, numels, out, 1.0)),
         "unflatten_": host_cost(lambda: ops.unflatten_(out, ts)),
         "cat": host_cost(lambda: torch.cat(ts, out=out))}
    print(json.dumps(R))
    small = [torch.randn(4, device=d) for _ in range(200)]; so = torch.empty(800, device=d)
    print("small 200x4 flatten direct", host_cost(lambda: f(small, [4]*200, so, 1.0)), "unflatten", host_cost(lambda: ops.unflatten_(so, small)))
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(20): f(ts, numels, out, 1.0)
    torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cpu_time_total", row_limit=12))
    sys.exit()
B = 2 * tot * 4
R = {}
src = torch.randn(tot, device=d)
R["copy_k_us"] = ktime(lambda: out.copy_(src), match="Memcpy")
R["flatten_k_us"] = ktime(lambda: ops.flatten(ts, out=out))
R["unflatten_k_us"] = ktime(lambda: ops.unflatten_(out, ts))
R["flatten_wall_us"] = timeloop(lambda: ops.flatten(ts, out=out)) * 1e6
bufs = [torch.randn(64 << 20, device=f"cuda:{i}") for i in range(2)]
R["two_shot_wall_us"] = timeloop(lambda: ops.all_reduce_(bufs, "sum", "two_shot"), 10, devs=(0, 1)) * 1e6
R["two_shot_k_us"] = ktime(lambda: ops.all_reduce_(bufs, "sum", "two_shot"), 5, devs=(0, 1))
R["two_shot_algbw"] = (256 << 20) / R["two_shot_wall_us"] / 1e3
del bufs
m = SeqModel().cuda(0); ps = []
for i in range(2):
    mm = copy.deepcopy(m).to(f"cuda:{i}")
    for p in mm.parameters(): p.grad = torch.randn_like(p)
    ps.append(list(mm.parameters()))
mg = GradientMerger(ps, fused=True)
R["m1_us"] = timeloop(mg.merge, 500, devs=(0, 1)) * 1e6
R["m1_k_us"] = ktime(mg.merge, 20, devs=(0, 1))
g = [p.grad for p in ps[0]]; fo = torch.empty(sum(x.numel() for x in g), device=d)
R["seed_flatten_us"] = timeloop(lambda: ops.flatten(g, out=fo), 500) * 1e6
R["seed_flatten_k_us"] = ktime(lambda: ops.flatten(g, out=fo), 20)
R["flatten_k_frac_of_copy"] = R["copy_k_us"] / R["flatten_k_us"]
print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in R.items()}), flush=True)
