import glob, os, importlib.util, time, statistics, torch, gguf, sys
torch.set_num_threads(int(sys.argv[1]))
def load(d):
    so = sorted(glob.glob(f"{d}/*/*.so"), key=lambda p: -os.path.getmtime(p))[0]
    spec = importlib.util.spec_from_file_location(so.split("/")[-1][:-3], so); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
old, new = load(sys.argv[2]), load("/tmp/k-v3-new")
T = gguf.GGMLQuantizationType.Q4_1
w = (torch.randn(1536, 576) * 0.05).numpy(); b = torch.from_numpy(gguf.quants.quantize(w, T))
po = [old.repack_blocks(b, int(T)) for _ in range(64)]; pn = [new.repack_blocks(b, int(T)) for _ in range(64)]
x = torch.randn(1, 576)
def run(mod, ps):
    s = time.perf_counter()
    for _ in range(5):
        for p in ps: mod.quant_linear(x, p, int(T), 1536, None, -1)
    return time.perf_counter() - s
ro, rn = [], []
for _ in range(11): ro.append(run(old, po)); rn.append(run(new, pn))
print(f"cold one row Q4_1 (64 layers 576x1536, {sys.argv[1]} threads): new/old time {statistics.median(rn)/statistics.median(ro):.3f}  (old {statistics.median(ro)*1e3:.1f} ms, new {statistics.median(rn)*1e3:.1f} ms per 320 calls)")
