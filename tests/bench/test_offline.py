"""`tfserve bench offline` through the CLI with the tiny random-weight llama: its JSON result and the settings
saved in it."""

import json
from datetime import datetime
from pathlib import Path

from typer.testing import CliRunner
from tiny import build_llama, build_tokenizer
from tiny import one_torch_thread as _one_torch_thread  # noqa: F401  (an autouse fixture)

from tfserve.cli import app

KEYS = {"completed", "failed", "duration_s", "request_throughput", "output_throughput", "total_token_throughput",
        "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"}


def test_offline_json_says_how_the_run_was_made(tfserve_home, tmp_path, monkeypatch):
    import torch

    from tfserve import __version__
    from tfserve.models import loading

    tokenizer = build_tokenizer()
    monkeypatch.setattr(loading, "load_model", lambda spec, **options: loading.LoadedModel(
        build_llama(tokenizer), tokenizer, "tiny-local", Path("/models/tiny-local"), "cpu", torch.float32))
    monkeypatch.setenv("TFSERVE_CPU_KERNELS", "0")  # no kernel build in a fresh $TFSERVE_HOME
    out = tmp_path / "run.json"
    result = CliRunner().invoke(app, ["bench", "offline", "-m", "tiny-local", "-n", "3", "--input-len", "5",
                                      "--output-len", "4", "--max-num-seqs", "2", "-o", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert set(data) == KEYS | {"settings"} and data["completed"] == 3
    settings = data["settings"]
    assert settings["command"] == "tfserve bench offline" and settings["engine"] == "tfserve"
    assert settings["model"] == "tiny-local" and settings["model_name"] == "tiny-local"
    assert (settings["num_prompts"], settings["input_len"], settings["output_len"], settings["max_num_seqs"]) == \
        (3, 5, 4, 2)
    assert settings["mean_input_len"] == 5
    assert (settings["device"], settings["dtype"], settings["quantization"]) == ("cpu", "float32", "none")
    assert settings["forward_backend"] in ("hf", "lean") and settings["cpu_kernels"] is None  # kernels off
    assert datetime.fromisoformat(settings["date"]).tzinfo is not None
    assert settings["tfserve_version"] == __version__
    host = settings["host"]
    assert host["isa"] in ("AVX-512", "AVX2", "NEON", "scalar") and host["torch"] == torch.__version__
    assert host["num_cpus"] >= 1 and host["arch"] and host["python"]


def test_offline_reads_the_dataset_before_loading_the_model(tfserve_home, tmp_path, monkeypatch):
    from tfserve.engine.engine import Engine
    from tfserve.models import loading

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the dataset was read")

    monkeypatch.setattr(loading, "load_model", never)
    monkeypatch.setattr(Engine, "from_pretrained", never)
    (tmp_path / "empty.jsonl").write_text('{"other": 1}\n')
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00")
    for dataset, message in [(tmp_path / "nope.jsonl", "not found"), (tmp_path / "empty.jsonl", "has no prompts"),
                             (tmp_path / "binary.jsonl", "is not text")]:
        for engine in ("tfserve", "transformers"):
            result = CliRunner().invoke(app, ["bench", "offline", "--engine", engine, "--dataset", str(dataset),
                                              "-n", "1"])
            assert result.exit_code == 1, result.output
            [line] = [line for line in result.output.splitlines() if line.strip()]  # no load steps before it
            assert line.startswith(f"Error: dataset {dataset} {message}"), result.output
