"""GPU time of the torch operations around one recurrent layer at a bench point's size, each against
its alternatives in the same run: the bias gradient (a column sum over B * T rows, or a GEMV), the
input projection with its bias (matmul + add, addmm, linear) and the zero-filled outputs.

    python3 benchmarks/probe/layer_ops.py [B T H]      (default 32 500 256: lstm256x2_b32_var's layer 2)

CUDA events around 20 calls, median of 15 repeats after warm-up; TF32 off.
"""
import statistics
import sys

import torch


def gpu_us(fn, calls: int = 20, repeats: int = 15) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def main() -> None:
    B, T, H = (int(v) for v in sys.argv[1:4]) if len(sys.argv) > 3 else (32, 500, 256)
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    G = 4 * H
    dg = torch.randn(B * T, G, device=dev)
    ones = torch.ones(B * T, device=dev)
    x = torch.randn(B * T, H, device=dev)
    w = torch.randn(G, H, device=dev)
    b = torch.randn(G, device=dev)
    cases = {
        "bias grad: sum(0)": lambda: dg.sum(0),
        "bias grad: mv(dg^T, ones)": lambda: torch.mv(dg.t(), ones),
        "bias grad: ones @ dg": lambda: ones @ dg,
        "projection: x @ w^T + b": lambda: x @ w.t() + b,
        "projection: x @ w^T": lambda: x @ w.t(),
        "projection: addmm(b, x, w^T)": lambda: torch.addmm(b, x, w.t()),
        "projection: linear(x, w, b)": lambda: torch.nn.functional.linear(x, w, b),
        "dx: dg @ w": lambda: dg @ w,
        "dW: dg^T @ x": lambda: dg.t() @ x,
        "dW: dg[1:]^T @ x[:-1]": lambda: dg[1:].t() @ x[:-1],
        "zeros (B*T, 4H)": lambda: torch.zeros(B * T, G, device=dev),
        "empty (B*T, 4H)": lambda: torch.empty(B * T, G, device=dev),
    }
    print(f"B={B} T={T} H={H} ({B * T} rows), {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, fn in cases.items():
        print(f"  {gpu_us(fn):9.1f} us  {name}")
    ref = dg.double().sum(0)
    for name in ("bias grad: sum(0)", "bias grad: mv(dg^T, ones)", "bias grad: ones @ dg"):
        err = (cases[name]().double() - ref).abs().max().item() / ref.abs().max().item()
        print(f"  {name}: max error {err:.2e} of the largest sum against float64")


if __name__ == "__main__":
    main()
