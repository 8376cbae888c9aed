# in-process, bfloat16 weights: the bfloat16 KV cache against a float32 one (the runner's choice patched), one
# process, alternating; 32 sequences of 40-token prompts decoding N tokens each (argv: rounds, N)
import sys, time, random, statistics, torch
from tfserve import Engine, SamplingParams
from tfserve.engine import runner
rounds, out = int(sys.argv[1]), int(sys.argv[2])
engines = {"kv-bf16": Engine.from_pretrained("smollm2-135m-instruct", dtype="bfloat16")}
choose = runner.kv_cache_dtype
runner.kv_cache_dtype = lambda *a: torch.float32
engines["kv-f32"] = Engine.from_pretrained("smollm2-135m-instruct", dtype="bfloat16")
runner.kv_cache_dtype = choose
assert [e.runner.kv_dtype for e in engines.values()] == [torch.bfloat16, torch.float32]
rng = random.Random(0)
def run(e):
    prompts = [[rng.randint(100, 49000) for _ in range(40)] for _ in range(32)]
    sp = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
    t = time.perf_counter(); e.generate_batch(prompts, sp); return 32 * out / (time.perf_counter() - t)
for e in engines.values(): run(e)
res = {k: [] for k in engines}
for r in range(rounds):
    for k, e in engines.items(): res[k].append(run(e))
    print(r, {k: round(v[-1], 1) for k, v in res.items()}, flush=True)
print("median", {k: round(statistics.median(v), 1) for k, v in res.items()})
