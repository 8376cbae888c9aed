# two builds, one process, alternating: a step over 30 SmolLM2-shaped layers (cold weights: 4 linears each, as in
# the model), 32 decode rows alone and with 1 / 8 / 50 prompt rows
import glob, os, importlib.util, time, statistics, torch, gguf, sys
torch.set_num_threads(2)
def load(d):
    so = sorted(glob.glob(f"{d}/*/*.so"), key=lambda p: -os.path.getmtime(p))[0]
    spec = importlib.util.spec_from_file_location(so.split("/")[-1][:-3], so); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
old, new = load(sys.argv[1]), load(sys.argv[2]); DOT = os.environ.get("DOT", "1") == "1"
T = gguf.GGMLQuantizationType
shapes = eval(os.environ.get("SHAPES", "[(576, 960), (576, 576), (576, 3072), (1536, 576)]"))
for name in (sys.argv[3].split(",") if len(sys.argv) > 3 else ["Q8_0", "Q4_1"]):
    qt = int(T[name])
    layers = []
    for _ in range(int(os.environ.get("LAYERS", "30"))):
        for (k, n) in shapes:
            b = torch.from_numpy(gguf.quants.quantize((torch.randn(n, k) * 0.05).numpy(), T[name]))
            layers.append((k, n, old.repack_blocks(b, qt), new.repack_blocks(b, qt)))
    xs = {k: torch.randn(300, k) for k in {k for k, _ in shapes}}
    def step(mod, idx, m, ff, dot=DOT):
        for (k, n, po, pn) in layers:
            mod.quant_linear(xs[k][:m], (po, pn)[idx], qt, n, None, ff, dot)
    for m, ff in eval(os.environ.get("CASES", "[(32, -1), (33, 32), (40, 32), (82, 32), (50, 0)]")):
        same = all(torch.equal(old.quant_linear(xs[k][:m], po, qt, n, None, ff, DOT), new.quant_linear(xs[k][:m], pn, qt, n, None, ff, DOT)) for (k, n, po, pn) in layers[:4])
        ro, rn = [], []
        for _ in range(7):
            for idx, mod, out in ((0, old, ro), (1, new, rn)):
                t = time.perf_counter(); step(mod, idx, m, ff); out.append(time.perf_counter() - t)
        a, c = statistics.median(ro), statistics.median(rn)
        print(f"{name} {len(layers) // len(shapes)} layers m={m} float_from={ff}: old {a*1e3:.2f} ms new {c*1e3:.2f} ms  new/old {c/a:.3f} same={same}", flush=True)
