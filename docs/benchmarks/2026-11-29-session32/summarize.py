#!/usr/bin/env python
"""Tables of an issue42.sh results folder: each server's passes in order, as in issue 42's table."""
import glob
import json
import os
import re
import sys

ROWS = [("tfs-bf16", "tfserve `--dtype bfloat16`"), ("vllm-bf16", "vLLM 0.32 CPU `--dtype bfloat16`"),
        ("tfs-q41", "tfserve (default: the GGUF's Q4_1 blocks)"), ("tfs-int8", "tfserve `--quantization int8`"),
        ("tfs-f32", "tfserve `--dtype float32`")]


def cells(values):
    return ", ".join(values) if values else "-"


def main(out):
    sweep_values = None
    print(f"Results: {out}\n")
    table = []
    for name, label in ROWS:
        per = {"tok": {}, "ttft": {}, "itl": {}, "start": [], "failed": []}
        for path in sorted(glob.glob(os.path.join(out, f"{name}-p*.json")), key=lambda p: int(re.findall(r"-p(\d+)\.json$", p)[0])):
            data = json.load(open(path))
            sweep_values = data["values"]
            entry = data["models"][0] if "models" in data else {"runs": data["runs"]}
            if "start_s" in entry:
                per["start"].append(f"{entry['start_s']:.0f}")
            for value, run in zip(data["values"], entry["runs"]):
                per["tok"].setdefault(value, []).append(f"{run['output_throughput']:.1f}")
                per["ttft"].setdefault(value, []).append(f"{run['ttft_ms']['p50']:.0f}")
                per["itl"].setdefault(value, []).append(f"{run['itl_ms']['p50']:.1f}")
                if run.get("failed"):
                    per["failed"].append(f"c={value}: {run['failed']}")
        table.append((label, per))
    if sweep_values:
        head = ([f"c={v} tok/s" for v in sweep_values] + [f"c={v} ITL p50 ms" for v in sweep_values]
                + [f"c={sweep_values[-1]} TTFT p50 ms", "start s", "failed"])
        print("| server (weights) | " + " | ".join(head) + " |")
        print("|---" * (len(head) + 1) + "|")
        for label, per in table:
            row = ([cells(per["tok"].get(v)) for v in sweep_values] + [cells(per["itl"].get(v)) for v in sweep_values]
                   + [cells(per["ttft"].get(sweep_values[-1])), cells(per["start"]), cells(per["failed"]) if per["failed"] else "0"])
            print(f"| {label} | " + " | ".join(row) + " |")
    pre = sorted(glob.glob(os.path.join(out, "prefill-*.json")))
    if pre:
        print("\nPrefill (median of the timed requests; each file's runs in brackets):")
        for name in ("tfs-bf16", "vllm-bf16", "tfs-q41"):
            items = []
            for path in sorted(glob.glob(os.path.join(out, f"prefill-{name}-p*.json"))):
                d = json.load(open(path))
                items.append(f"{d['median_s']:.3f} s [{', '.join(f'{t:.3f}' for t in d['times_s'])}]")
            if items:
                print(f"- {name} ({d['prompt_tokens']} tokens, 1 out): " + "; ".join(items))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
