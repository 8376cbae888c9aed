import glob, importlib.machinery, importlib.util, time, statistics, torch, gguf, numpy as np, sys
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
def load(d):
    so = sorted(glob.glob(f"{d}/*/*.so"), key=lambda p: -__import__('os').path.getmtime(p))[0]
    name = so.split("/")[-1][:-3]
    spec = importlib.util.spec_from_file_location(name, so); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
old, new = load("/tmp/k-avx2-old"), load("/tmp/k-v3-new")
T = gguf.GGMLQuantizationType
def t(f, reps):
    f(); s=time.perf_counter()
    for _ in range(reps): f()
    return (time.perf_counter()-s)/reps
for name in ["Q4_1", "Q8_0"]:
    for (k, n) in [(576, 1536), (1536, 576)]:
        w = (torch.randn(n, k) * 0.05).numpy(); b = torch.from_numpy(gguf.quants.quantize(w, T[name]))
        po, pn = old.repack_blocks(b, int(T[name])), new.repack_blocks(b, int(T[name]))
        for m, ff in [(1, -1), (8, -1), (32, -1), (64, 0)]:
            x = torch.randn(m, k); reps = max(20, 2000 // m)
            ro, rn = [], []
            for _ in range(7):
                ro.append(t(lambda: old.quant_linear(x, po, int(T[name]), n, None, ff), reps))
                rn.append(t(lambda: new.quant_linear(x, pn, int(T[name]), n, None, ff), reps))
            a, c = statistics.median(ro), statistics.median(rn)
            print(f"{name} {k}x{n} m={m} {'prompt' if ff==0 else 'decode'}: old {2*m*k*n/a/1e9:.0f} new {2*m*k*n/c/1e9:.0f} GFLOP/s  new/old time {c/a:.3f}", flush=True)
