# two kernel builds in one process, alternating: the bfloat16 prompt road (float_from=0, dot) and a mixed step
import glob, os, importlib.util, time, statistics, torch, gguf, sys
torch.set_num_threads(2)
def load(d):
    so = sorted(glob.glob(f"{d}/*/*.so"), key=lambda p: -os.path.getmtime(p))[0]
    spec = importlib.util.spec_from_file_location(so.split("/")[-1][:-3], so); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
old, new = load(sys.argv[1]), load(sys.argv[2])
T = gguf.GGMLQuantizationType
def t(f, reps):
    f(); s = time.perf_counter()
    for _ in range(reps): f()
    return (time.perf_counter() - s) / reps
cases = [(m, 0) for m in (1, 16, 128)] + [(33, 32), (82, 32)]
for name in (sys.argv[3].split(",") if len(sys.argv) > 3 else ["Q8_0", "Q4_1", "Q4_K", "Q6_K"]):
    for (k, n) in [(576, 1536), (1536, 576)]:
        w = (torch.randn(n, k) * 0.05).numpy(); b = torch.from_numpy(gguf.quants.quantize(w, T[name]))
        po, pn = old.repack_blocks(b, int(T[name])), new.repack_blocks(b, int(T[name]))
        for m, ff in cases:
            x = torch.randn(m, k); reps = max(10, 400 // m)
            yo = old.quant_linear(x, po, int(T[name]), n, None, ff, True); yn = new.quant_linear(x, pn, int(T[name]), n, None, ff, True)
            same = torch.equal(yo, yn)
            ro, rn = [], []
            for _ in range(7):
                ro.append(t(lambda: old.quant_linear(x, po, int(T[name]), n, None, ff, True), reps))
                rn.append(t(lambda: new.quant_linear(x, pn, int(T[name]), n, None, ff, True), reps))
            a, c = statistics.median(ro), statistics.median(rn)
            print(f"{name} {k}x{n} m={m} float_from={ff}: old {a*1e6:.0f} us new {c*1e6:.0f} us  new/old {c/a:.3f}  same={same}", flush=True)
