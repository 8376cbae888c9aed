# in-process: 32 sequences x 128 tokens, three formats loaded in one process, alternating
import sys, time, random, statistics, torch
from tfserve import Engine, SamplingParams
fmts = {"bf16": {"dtype": "bfloat16"}, "int8": {"quantization": "int8"}, "q41": {}}
engines = {k: Engine.from_pretrained("smollm2-135m-instruct", **kw) for k, kw in fmts.items()}
rng = random.Random(0)
def run(e, n, inp, out):
    prompts = [[rng.randint(100, 49000) for _ in range(inp)] for _ in range(n)]
    sp = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
    t = time.perf_counter(); e.generate_batch(prompts, sp); return n * out / (time.perf_counter() - t)
for e in engines.values(): run(e, 2, 8, 8)
res = {k: [] for k in engines}
for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    for k, e in engines.items():
        res[k].append(run(e, 32, 40, 128))
    print(r, {k: round(v[-1], 1) for k, v in res.items()}, flush=True)
print({k: round(statistics.median(v), 1) for k, v in res.items()})
