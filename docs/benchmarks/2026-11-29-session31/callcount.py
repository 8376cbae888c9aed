"""Python function calls per generated token, engine in-process (the default model), 32 prompts x 64 tokens."""
import cProfile, pstats, random, sys, time
import tfserve
from tfserve import Engine, SamplingParams
print("tree", tfserve.__file__)
engine = Engine.from_pretrained(None) if False else Engine.from_pretrained()
rng = random.Random(0)
prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(30, 80))] for _ in range(32)]
params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
engine.generate_batch(prompts[:4], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm
prof = cProfile.Profile()
t0 = time.process_time()
prof.enable()
outs = engine.generate_batch(prompts, params)
prof.disable()
cpu = time.process_time() - t0
tokens = sum(len(o.generated_tokens) for o in outs.values())
st = pstats.Stats(prof)
calls = sum(v[1] for v in st.stats.values())  # total (non-recursive + recursive) calls
prims = st.total_calls
py = {k: v for k, v in st.stats.items() if not k[0].startswith("~") and "tfserve" in k[0]}
py_calls = sum(v[1] for v in py.values())
py_tottime = sum(v[2] for v in py.values())
print(f"tokens {tokens} calls/token {prims/tokens:.1f} tfserve-python calls/token {py_calls/tokens:.1f} "
      f"tfserve-python tottime/token {1e6*py_tottime/tokens:.1f} us  cpu/token {1e3*cpu/tokens:.2f} ms")
top = sorted(py.items(), key=lambda kv: -kv[1][1])[:int(sys.argv[1]) if len(sys.argv) > 1 else 0]
for (f, line, name), v in top:
    print(f"{v[1]/tokens:8.2f}/tok {1e6*v[2]/tokens:7.2f}us {f.split('tfserve/')[-1]}:{line} {name}")
