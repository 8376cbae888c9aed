# in-process: decode tok/s at 1 and 32 sequences, and a 1000-token prefill, default model
import sys, time, random, statistics, torch
from tfserve import Engine, SamplingParams
kw = {} if sys.argv[1] == "auto" else {"dtype": sys.argv[1]}
e = Engine.from_pretrained("smollm2-135m-instruct", **kw)
rng = random.Random(0)
def run(n, out):
    prompts = [[rng.randint(100, 49000) for _ in range(16)] for _ in range(n)]
    sp = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
    t = time.perf_counter(); e.generate_batch(prompts, sp); return n * out / (time.perf_counter() - t)
def prefill(n):
    ids = [rng.randint(100, 49000) for _ in range(n)]
    t = time.perf_counter(); e.generate_batch([ids], SamplingParams(temperature=0, max_tokens=1)); return time.perf_counter() - t
run(2, 8)
r = {"c1": statistics.median(run(1, 64) for _ in range(3)), "c32": statistics.median(run(32, 64) for _ in range(2)),
     "prefill1000": statistics.median(prefill(1000) for _ in range(3))}
print(sys.argv[1], " ".join(f"{k}={v:.2f}" for k, v in r.items()), flush=True)
