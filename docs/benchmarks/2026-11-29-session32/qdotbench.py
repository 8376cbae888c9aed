import time, numpy as np, torch, gguf
from tfserve.engine import kernels
ops = kernels.cpu_ops(); torch.set_num_threads(2)
T = gguf.GGMLQuantizationType
def bench(f, reps=20):
    f(); ts=[]
    for _ in range(reps):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    return sorted(ts)[len(ts)//2]
for name in ["Q4_1", "Q8_0"]:
    for (k, n) in [(576, 1536), (1536, 576)]:
        w = (torch.randn(n, k) * 0.05).numpy()
        packed = ops.repack_blocks(torch.from_numpy(gguf.quants.quantize(w, T[name])), int(T[name]))
        bp = ops.pack_linear_weight(torch.from_numpy(w), torch.bfloat16, dot=True)
        for m in (16, 128, 512):
            x = torch.randn(m, k); fl = 2*m*k*n/1e9
            a = bench(lambda: ops.quant_linear(x, packed, int(T[name]), n, None, 0, False))
            b = bench(lambda: ops.quant_linear(x, packed, int(T[name]), n, None, 0, True))
            i = bench(lambda: ops.quant_linear(x, packed, int(T[name]), n, None, -1, False))
            d = bench(lambda: ops.linear(x, bp, n, None))
            print(f"{name} k={k} n={n} m={m}: float {fl/a:.0f}  bf16road {fl/b:.0f}  int8road {fl/i:.0f}  dense-bf16 {fl/d:.0f} GFLOP/s")
