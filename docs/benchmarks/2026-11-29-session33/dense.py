# dense bfloat16 dot-product panels over 30 layers of SmolLM2's four shapes, 2 threads: `python dense.py` cold (30
# distinct layers, as a decode step reads them), `python dense.py hot` (one layer's four repeated 30 times)
import sys, time, torch
from tfserve.engine import kernels
ops = kernels.cpu_ops(); torch.set_num_threads(2)
hot = sys.argv[1:] == ["hot"]
shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
one = lambda: [(k, n, ops.pack_linear_weight(torch.randn(n, k) * 0.05, torch.bfloat16, dot=True)) for (k, n) in shapes]
layers = one() * 30 if hot else [layer for _ in range(30) for layer in one()]
xs = {k: torch.randn(64, k) for k in (576, 1536)}
for m in (1, 8, 16, 32, 48):
    def step():
        for (k, n, p) in layers: ops.linear(xs[k][:m], p, n, None)
    step(); ts = []
    for _ in range(20):
        t = time.perf_counter(); step(); ts.append(time.perf_counter() - t)
    t = sorted(ts)[10]; fl = 2 * m * sum(k * n for k, n in shapes) * 30
    print(f"bf16 dense {'hot' if hot else 'cold'} m={m}: {t*1e3:.2f} ms  {fl/t/1e9:.0f} GFLOP/s")
