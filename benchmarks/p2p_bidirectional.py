"""Copy-engine P2P bandwidth between cuda:0 and cuda:1, one direction and both at once (independent
streams): the ceiling for a 2-GPU all-reduce, which moves the buffer both ways simultaneously.
`OUT=dir python3 benchmarks/p2p_bidirectional.py`."""
import torch, time, statistics, json, os
n = 64 << 20
a0 = torch.randn(n, device="cuda:0"); b1 = torch.empty(n, device="cuda:1")
a1 = torch.randn(n, device="cuda:1"); b0 = torch.empty(n, device="cuda:0")
s = {k: torch.cuda.Stream(d) for k, d in [("0a", 0), ("1a", 1), ("0b", 0), ("1b", 1)]}
def uni():
    with torch.cuda.stream(s["0a"]), torch.cuda.stream(s["1a"]):
        b1.copy_(a0, non_blocking=True)
def bi():
    with torch.cuda.stream(s["0a"]), torch.cuda.stream(s["1a"]):
        b1.copy_(a0, non_blocking=True)
    with torch.cuda.stream(s["0b"]), torch.cuda.stream(s["1b"]):
        b0.copy_(a1, non_blocking=True)
def t(fn, it=10):
    for _ in range(3): fn()
    torch.cuda.synchronize(0); torch.cuda.synchronize(1)
    r = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(it): fn()
        torch.cuda.synchronize(0); torch.cuda.synchronize(1)
        r.append((time.perf_counter() - t0) / it)
    return statistics.median(r)
u = t(uni); b = t(bi)
res = {"uni_gbps": n * 4 / u / 1e9, "bidir_per_direction_gbps": n * 4 / b / 1e9}
print(json.dumps(res))
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "bidir.json"), "w"))
