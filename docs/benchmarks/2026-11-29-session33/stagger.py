# in-process, served-like traffic: 32 running, 96 requests of 40-token prompts with output lengths 32..192 (so
# finishes are staggered and new prompts join steps of ~31 decodes); formats loaded in one process, alternating
import sys, time, random, statistics, torch
from tfserve import Engine, SamplingParams
fmts = {"bf16": {"dtype": "bfloat16"}, "int8": {"quantization": "int8"}, "q41": {}}
only = sys.argv[2:] or list(fmts)
engines = {k: Engine.from_pretrained("smollm2-135m-instruct", max_num_seqs=32, **fmts[k]) for k in only}
def run(e, seed, n=96):
    rng = random.Random(seed)
    toks = 0
    for i in range(n):
        mt = rng.randint(32, 192); toks += mt
        e.add_request([rng.randint(100, 49000) for _ in range(40)],
                      SamplingParams(temperature=0, max_tokens=mt, ignore_eos=True))
    t = time.perf_counter(); steps = 0
    while e.has_unfinished:
        e.step(); steps += 1
    return toks / (time.perf_counter() - t), steps
for e in engines.values(): run(e, 0, 4)
res = {k: [] for k in engines}
for r in range(int(sys.argv[1])):
    for k, e in engines.items():
        res[k].append(run(e, r)[0])
    print(r, {k: round(v[-1], 1) for k, v in res.items()}, flush=True)
print({k: round(statistics.median(v), 1) for k, v in res.items()})
