"""`tfserve serve` takes `transformers serve` command lines unchanged: every flag is parsed and mapped to
tfserve's options (checked here up to the point the server would listen: nothing is loaded or bound), and a
bad value is one line, never a traceback."""

from __future__ import annotations

import logging

import pytest
from typer.testing import CliRunner

from tfserve.cli import app
from tfserve.cli import serve as serve_cli
from tfserve.cli.serve_compat import normalize_args
from tfserve.config import EngineConfig

runner = CliRunner()


@pytest.fixture
def served(monkeypatch, tmp_path):
    """Run `tfserve serve ARGS` up to listening; returns what it would have served (or the failed result)."""
    from tfserve.server import app as server_app
    from tfserve.server import run
    from tfserve.server.runtime.state import STATE

    seen: dict = {}
    real_create_app = server_app.create_app

    def create_app(state, **kwargs):
        seen["app_kwargs"] = kwargs
        return real_create_app(state, **kwargs)

    async def fake_run(app, host, port, *, drain_timeout, load, on_ready, autoscale=None):
        seen.update(state=app[STATE], host=host, port=port, drain_timeout=drain_timeout, load=load,
                    autoscale=autoscale)

    def fake_load_engine(spec, load_options, engine_kwargs, show_progress=True, data_parallel_size=1,
                         ray_address=None, scalable=False):
        seen.update(spec=spec, load_options=load_options, engine_kwargs=engine_kwargs,
                    data_parallel_size=data_parallel_size, ray_address=ray_address, scalable=scalable)
        return ("engine", "async_engine", spec, None)

    monkeypatch.setattr(server_app, "create_app", create_app)
    monkeypatch.setattr(run, "serve", fake_run)
    monkeypatch.setattr(serve_cli, "load_engine", fake_load_engine)
    model_dir = tmp_path / "Qwen3-1.7B"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")

    def serve(*args: str):
        args = [str(model_dir) if a == "MODEL_DIR" else a for a in args]
        result = runner.invoke(app, ["serve", *args], env={"COLUMNS": "200", "NO_COLOR": "1"}, prog_name="tfserve")
        seen["result"] = result
        if result.exit_code == 0 and "load" in seen:
            seen["load"]()  # what the server runs on its loading thread
        return seen

    logger = logging.getLogger("tfserve")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield serve
    logger.handlers[:] = saved[0]  # serve pointed it at CliRunner's stream
    logger.setLevel(saved[1])
    logger.propagate = saved[2]
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_warning()


def ok(seen) -> dict:
    result = seen["result"]
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    return seen


# every command line of the transformers serve docs (serving.md, serving_optims.md, the integrations' pages)
DOC_LINES = [
    "",
    "--port 8000",
    "--enable-cors",
    "--model-timeout 400",
    "--continuous-batching --attn-implementation sdpa",
    "--quantization bnb-4bit",
    "--continuous-batching --dtype bfloat16",
    "--compile",
    "MODEL_DIR --reasoning on",
    "MODEL_DIR --chat-template-kwargs {\"enable_thinking\":true}",
    "MODEL_DIR --continuous-batching --dtype bfloat16",
    "--force-model MODEL_DIR --port 8000 --continuous-batching",
    "--continuous_batching --attn_implementation sdpa_paged --log_level warning",
    "--trust_remote_code True --enable_cors true --default_seed 42 --input_validation",
    "MODEL_DIR --json", "--format agent MODEL_DIR", "-q MODEL_DIR", "--quiet --no-truncate", "--default-seed -5",
]


@pytest.mark.parametrize("line", DOC_LINES)
def test_transformers_serve_doc_lines_run_unchanged(served, line):
    seen = ok(served(*line.split()))
    assert seen["port"] == 8000


def test_flags_map_to_tfserve_options(served):
    seen = ok(served(
        "MODEL_DIR", "--cb-block-size", "32", "--cb-num-blocks", "100", "--cb-max-batch-tokens", "256",
        "--cb-max-memory-percent", "0.5", "--enable-cors", "--model-timeout", "30", "--reasoning", "off",
        "--chat-template-kwargs", '{"custom": 1, "enable_thinking": true}', "--generation-config", "none",
        "--host", "0.0.0.0", "--port", "9001", "--device", "cpu", "--dtype", "float32", "--trust-remote-code"))
    assert seen["engine_kwargs"] == EngineConfig(max_batch_tokens=256, max_num_seqs=64, block_size=32, num_blocks=100,
                                                 kv_cache_memory=0.5, enable_prefix_caching=True,
                                                 generation_config="none")
    assert seen["load_options"] == {"dtype": "float32", "device": "cpu", "quantization": "none",
                                    "attn_implementation": None, "trust_remote_code": True}
    state = seen["state"]
    assert state.force_model and seen["spec"].endswith("Qwen3-1.7B")  # the positional MODEL is pinned
    assert state.chat_template_kwargs == {"custom": 1, "enable_thinking": False}  # --reasoning wins, as there
    assert state.models.idle_timeout_s == 30
    assert list(seen["app_kwargs"]["cors_allow_origins"]) == ["*"]
    assert (seen["host"], seen["port"]) == ("0.0.0.0", 9001)
    assert "--model-timeout has no effect with a pinned model" in seen["result"].output


def test_a_chat_template_is_a_file_or_the_template_itself(served, tmp_path):
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    assert ok(served("--chat-template", str(tmp_path / "t.jinja")))["engine_kwargs"].chat_template == template
    assert ok(served("--chat-template", template))["engine_kwargs"].chat_template == template
    assert ok(served())["engine_kwargs"].chat_template is None


def test_model_timeout_unloads_on_demand_models_only_when_asked(served):
    assert ok(served("--model-timeout", "30"))["state"].models.idle_timeout_s == 30
    assert ok(served())["state"].models.idle_timeout_s is None  # -1: never (transformers' default is 300)


def test_reasoning_on_and_auto(served):
    assert ok(served("--reasoning", "on"))["state"].chat_template_kwargs == {"enable_thinking": True}
    assert ok(served())["state"].chat_template_kwargs == {}


def test_continuous_batching_is_accepted_with_one_note(served):
    output = ok(served("--continuous-batching"))["result"].output
    assert output.count("continuous batching is always on") == 1
    assert "has no effect" in ok(served("--no-continuous-batching"))["result"].output


@pytest.mark.parametrize("flag,note", [
    ("--input-validation", "validates"),
    ("--non-blocking", "foreground"), ("--use-bnb-nested-quant", "bitsandbytes"),
])
def test_flags_without_effect_say_so_in_one_line(served, flag, note):
    output = ok(served(flag))["result"].output
    assert [line for line in output.splitlines() if note in line][0].startswith("Note: ")


def test_compile_reaches_the_engine(served):
    assert ok(served("--compile"))["engine_kwargs"].compile is True
    assert ok(served())["engine_kwargs"].compile is False
    assert "torch.compile" not in ok(served("--compile"))["result"].output  # no note: it is not ignored


def test_cuda_graph_flags_reach_the_engine(served):
    assert ok(served())["engine_kwargs"].cuda_graph is None  # on where the model is on a CUDA device
    assert ok(served("--no-cuda-graph"))["engine_kwargs"].cuda_graph is False
    assert ok(served("--cb-use-cuda-graph"))["engine_kwargs"].cuda_graph is True  # transformers' spelling
    assert ok(served("--cuda-graph", "--cb-use-cuda-graph"))["engine_kwargs"].cuda_graph is True
    result = served("--cuda-graph", "--no-cb-use-cuda-graph")["result"]
    assert result.exit_code != 0
    assert "--cuda-graph and --no-cb-use-cuda-graph disagree" in result.output
    assert "Traceback" not in result.output


def test_decision_config_is_accepted(served):
    assert "systemone" in ok(served("--decision-config", "decisions.json"))["result"].output


@pytest.mark.parametrize("args,quantization", [
    (["--load-in-4bit"], "bnb-4bit"), (["--load_in_8bit"], "bnb-8bit"), (["-q", "bnb-8bit"], "bnb-8bit"),
    (["--quantization", "bnb-4bit", "--load-in-4bit"], "bnb-4bit"),
])
def test_legacy_quantization_flags(served, args, quantization):
    assert ok(served(*args))["load_options"]["quantization"] == quantization


def test_torch_dtype_and_numeric_device(served):
    seen = ok(served("--torch_dtype", "bfloat16", "--device", "0"))
    assert seen["load_options"]["dtype"] == "bfloat16" and seen["load_options"]["device"] == "cuda:0"


@pytest.mark.parametrize("name", ["sdpa", "eager", "paged|sdpa", "paged|eager", "sdpa_paged", "paged_attention"])
def test_transformers_attention_names_map_to_paged_attention(served, name):
    seen = ok(served("--attn-implementation", name))
    assert seen["load_options"]["attn_implementation"] is None  # tfserve's paged attention
    assert "paged attention" in seen["result"].output


def test_flash_attention_without_flash_attn_says_what_works(served, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else real(name, *a))
    result = served("--attn-implementation", "flash_attention_2")["result"]
    assert result.exit_code == 2 and "flash-attn" in result.output and "sdpa" in result.output
    assert "Traceback" not in result.output


def test_flash_attention_needs_cuda(served, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else real(name, *a))
    result = served("--attn-implementation", "flash_attention_2", "--device", "cpu")["result"]
    assert_one_line(result, "needs a CUDA GPU")


@pytest.mark.parametrize("level", ["warning", "INFO", "Debug", "error", "critical", "detail"])
def test_log_levels_are_case_insensitive(served, level):
    ok(served("--log-level", level))
    expected = logging.DEBUG if level == "detail" else getattr(logging, level.upper())
    assert logging.getLogger("tfserve").level == expected
    if expected != logging.INFO:
        from transformers.utils import logging as hf_logging

        assert hf_logging.get_verbosity() == expected


def test_default_seed_seeds_torch_after_loading(served):
    import torch

    ok(served("--default-seed", "1234"))
    first = torch.rand(3)
    torch.manual_seed(1234)
    assert torch.equal(first, torch.rand(3))


@pytest.mark.parametrize("seed", [-5, -2**63])
def test_a_negative_default_seed_is_what_torch_makes_of_it(served, seed):
    """transformers passes --default-seed to torch.manual_seed as it is, which takes -5 as 2**64 - 5; tfserve
    refused it ("must be ... 0 to 2**64 - 1")."""
    import torch

    ok(served("--default-seed", str(seed)))
    assert torch.initial_seed() == 2**64 + seed
    first = torch.rand(3)
    torch.manual_seed(seed)
    assert torch.equal(first, torch.rand(3))


@pytest.mark.parametrize("args", [["--quiet"], ["-q"], ["--format", "quiet"], ["-q", "MODEL_DIR"],
                                  ["MODEL_DIR", "-q"], ["--quiet", "--format", "quiet"]])
def test_quiet_logs_fewer_lines(served, args):
    """transformers' -q/--quiet (huggingface_hub's formatting flag): --log-level warning here, so no access line
    per request; a --log-level given beside it wins."""
    seen = ok(served(*args))
    assert logging.getLogger("tfserve").level == logging.WARNING
    assert seen["load_options"]["quantization"] == "none" and "Note:" not in seen["result"].output
    ok(served("-q", "--log-level", "debug"))
    assert logging.getLogger("tfserve").level == logging.DEBUG


@pytest.mark.parametrize("value", ["int8", "bnb-4bit", "none"])
def test_q_before_a_quantization_is_still_quantization(served, value):
    seen = ok(served("-q", value, "MODEL_DIR"))
    assert seen["load_options"]["quantization"] == value
    assert logging.getLogger("tfserve").level == logging.INFO  # not quiet
    assert seen["spec"].endswith("Qwen3-1.7B")


def test_q_before_a_word_that_is_neither_says_both_meanings(served):
    result = served("-q", "bnb-2bit")["result"]
    assert result.exit_code == 2, result.output
    assert_one_line(result, "-q/--quiet takes no value, and -q VALUE is --quantization VALUE (none, int8, "
                            "bnb-4bit, bnb-8bit): got 'bnb-2bit'")


@pytest.mark.parametrize("args,flag", [(["--json"], "--json"), (["--format", "json"], "--format json"),
                                       (["--format", "agent"], "--format agent"),
                                       (["--format=human"], "--format human"), (["--no-truncate"], "--no-truncate"),
                                       (["--no_truncate"], "--no-truncate")])
def test_output_format_flags_are_accepted_with_a_note(served, args, flag):
    output = ok(served(*args))["result"].output
    notes = [line for line in output.splitlines() if line.startswith("Note: ")]
    assert len(notes) == 1 and notes[0].startswith(f"Note: {flag} has no effect"), output
    assert logging.getLogger("tfserve").level == logging.INFO


def test_format_auto_is_the_default_and_says_nothing(served):
    assert "Note:" not in ok(served("--format", "auto"))["result"].output


def assert_one_line(result, fragment: str) -> None:
    """Exit non-zero with one `Error:` line (after click's two usage lines at most) and no traceback."""
    assert result.exit_code != 0, result.output
    assert "Traceback" not in result.output
    lines = [line.strip("│ ") for line in result.output.splitlines() if line.strip("│╭╮╰╯─ ")]
    lines = [line for line in lines if not line.startswith(("Usage:", "Try '", "Error ─"))]
    assert fragment in " ".join(lines), result.output
    assert len(lines) <= 3, result.output  # click may wrap its one message over a few lines


@pytest.mark.parametrize("args,fragment", [
    (["--port", "99999"], "65535"), (["--port", "-5"], "--port"), (["-p", "0"], "--port"),
    (["--max-num-seqs", "-3"], "--max-num-seqs"), (["--max_num_seqs", "0"], "--max-num-seqs"),
    (["--max-batch-tokens", "0"], "--max-batch-tokens"), (["--cb-max-batch-tokens", "-1"], "--cb-max-batch-tokens"),
    (["--block-size", "24"], "power of two"), (["--cb_block_size", "3"], "power of two"),
    (["--num-blocks", "0"], "--num-blocks"), (["--cb-num-blocks", "-4"], "--cb-num-blocks"),
    (["--kv-cache-memory", "lots"], "not a size"), (["--kv-cache-memory", "1.5"], "fraction"),
    (["--kv-cache-memory", "0"], "--kv-cache-memory"), (["--cb-max-memory-percent", "1.5"], "fraction"),
    (["--cb-max-memory-percent", "0"], "fraction"), (["--max-body-size", "0"], "--max-body-size"),
    (["--max-queued", "-1"], "--max-queued"), (["--drain-timeout", "-2"], "--drain-timeout"),
    (["--model-timeout", "-7"], "--model-timeout"), (["--default-seed", str(-2**63 - 1)], "--default-seed"),
    (["--default-seed", str(2**64)], "--default-seed"), (["--chat-template-kwargs", "{bad"], "not JSON"),
    (["--chat-template-kwargs", "[1]"], "JSON object"), (["--reasoning", "maybe"], "--reasoning"),
    (["--chat-template", "/no/such/template.jinja"], "No such file"),
    (["--chat-template", "{% for m in messages %}{{ m.content }}"], "not a Jinja template"),
    (["--log-level", "loud"], "--log-level"), (["--generation-config", "x"], "--generation-config"),
    (["--attn-implementation", "flash_attention_3"], "flash_attention_2"), (["--dtype", "float8"], "--dtype"),
    (["--torch-dtype", "float8"], "--torch-dtype"), (["--quantization", "bnb-2bit"], "--quantization"),
    (["--load-in-4bit", "--load-in-8bit"], "conflicting quantizations"),
    (["--block-size", "32", "--cb-block-size", "64"], "disagree"),
    (["--max-batch-tokens", "512", "--cb_max_batch_tokens", "64"], "disagree"),
    (["--kv-cache-memory", "1GiB", "--cb-max-memory-percent", "0.5"], "give one"),
    (["a", "--force-model", "b"], "disagree"), (["--enable-cors=maybe"], "does not take a value"),
    (["MODEL_DIR", "-m", "NONEXISTENT"], "and --model 'NONEXISTENT' disagree: give one"),
    (["--torch-dtype", "float16", "--dtype", "float32"], "--dtype float32 and --torch-dtype float16 disagree"),
    (["--speech-model", "NONEXISTENT"], "--speech-model NONEXISTENT: unknown model 'NONEXISTENT'"),
    (["--model", "/no/such/dir"], "no such file or directory"),
    (["--json", "--format", "human"], "--format human and --json disagree"),
    (["-q", "--json"], "--json and --quiet disagree"), (["--format", "table"], "--format"),
])
def test_bad_values_are_one_line(served, args, fragment):
    assert_one_line(served(*args)["result"], fragment)


def test_normalize_args_touches_names_never_values():
    from typer.main import get_command

    command = get_command(app).commands["serve"]
    params = command.get_params(command.make_context("serve", [], resilient_parsing=True))
    args = ["--max_num_seqs", "8", "--api-key", "--not_an_option", "--chat_template_kwargs={\"a_b\": 1}",
            "my_model", "--enable_cors", "false", "--trust_remote_code", "TRUE", "--no_compile=no", "--unknown_flag",
            "-m", "--weird_name", "--", "--max_num_seqs"]
    assert normalize_args(params, args) == [
        "--max-num-seqs", "8", "--api-key", "--not_an_option", "--chat-template-kwargs={\"a_b\": 1}", "my_model",
        "--no-enable-cors", "--trust-remote-code", "--compile", "--unknown_flag", "-m", "--weird_name", "--",
        "--max_num_seqs"]
    assert normalize_args(params, ["-q", "bnb-8bit", "-q", "my_model", "--api-key", "-q", "-q"]) == [
        "-q", "bnb-8bit", "--quiet", "my_model", "--api-key", "-q", "--quiet"]  # a value stays a value


def test_distributed_flags_reach_the_engine_and_its_loader(served):
    seen = ok(served("MODEL_DIR", "-dp", "2"))
    assert seen["data_parallel_size"] == 2 and seen["ray_address"] is None
    seen = ok(served("MODEL_DIR", "-tp", "2", "--distributed-timeout", "9"))
    assert seen["engine_kwargs"].tensor_parallel_size == 2 and seen["engine_kwargs"].distributed_timeout_s == 9
    assert seen["data_parallel_size"] == 1
    seen = ok(served("MODEL_DIR", "-dp", "2", "-tp", "2"))  # each replica split over two ranks
    assert seen["data_parallel_size"] == 2 and seen["engine_kwargs"].tensor_parallel_size == 2
    result = served("MODEL_DIR", "-dp", "2", "-tp", "2", "--nnodes", "2",
                    "--distributed-init-method", "tcp://h:1")["result"]
    assert result.exit_code != 0 and "each replica's ranks on its own machine" in result.output
    result = served("MODEL_DIR", "--ray", "auto")["result"]
    assert result.exit_code != 0 and "--ray places engine replicas" in result.output


def test_replica_scaling_flags_make_a_policy(served):
    from tfserve.serving.autoscale import AutoscalePolicy

    seen = ok(served("MODEL_DIR", "--max-replicas", "4", "--target-requests-per-replica", "8"))
    assert seen["autoscale"] == AutoscalePolicy(1, 4, 8)
    assert seen["data_parallel_size"] == 1 and seen["scalable"]  # replicas from one, scaled
    seen = ok(served("MODEL_DIR", "--min-replicas", "2", "--max-replicas", "3"))
    assert seen["autoscale"] == AutoscalePolicy(2, 3, 16) and seen["data_parallel_size"] == 2
    seen = ok(served("MODEL_DIR"))
    assert seen["autoscale"] is None and not seen["scalable"]
    for args, fragment in [(["--min-replicas", "2"], "give --max-replicas too"),
                           (["--min-replicas", "3", "--max-replicas", "2"], "must not be above --max-replicas"),
                           (["-dp", "3", "--max-replicas", "2"], "must not be above --max-replicas"),
                           (["--max-replicas", "2", "-tp", "2", "--distributed-init-method", "tcp://h:1"],
                            "each replica's ranks on its own machine")]:
        assert_one_line(served("MODEL_DIR", *args)["result"], fragment)


def test_speculative_flags_reach_the_engine(served):
    config = ok(served("MODEL_DIR", "--speculative-model", "smollm2-135m-instruct", "--num-speculative-tokens", "3"))[
        "engine_kwargs"]
    assert (config.speculative, config.speculative_model, config.num_speculative_tokens) == (
        "draft", "smollm2-135m-instruct", 3)
    assert ok(served("MODEL_DIR", "--speculative", "ngram"))["engine_kwargs"].speculative == "ngram"
    for flags, message in ((["--speculative", "draft"], "--speculative draft needs --speculative-model"),
                           (["--speculative", "ngram", "--speculative-model", "x"], "--speculative-model is the draft"),
                           (["--speculative", "medusa"], "--speculative must be ngram or draft")):
        result = served("MODEL_DIR", *flags)["result"]
        assert result.exit_code != 0 and message in result.output and "Traceback" not in result.output


def test_the_same_model_or_dtype_given_twice_is_fine(served):
    """MODEL with --model, --dtype with --torch-dtype: refused where they disagree (one was silently ignored),
    taken where they agree."""
    seen = ok(served("MODEL_DIR", "-m", "MODEL_DIR"))
    assert seen["spec"].endswith("Qwen3-1.7B") and seen["state"].force_model
    assert ok(served("--torch-dtype", "float16", "--dtype", "float16"))["load_options"]["dtype"] == "float16"
    assert ok(served("--torch_dtype", "bfloat16"))["load_options"]["dtype"] == "bfloat16"


@pytest.mark.parametrize("args", [["--enable_cors", "maybe"], ["--enable-cors", "maybe"],
                                  ["--trust_remote_code", "yes-please"]])
def test_a_flag_given_a_word_that_is_no_boolean_is_a_usage_error(served, args):
    """`--enable_cors maybe` said "unknown model 'maybe'": the word after a flag that takes no value is MODEL to
    click, as it must be for `--enable-cors Qwen/Qwen3-1.7B`; where it names no model, it was meant for the flag."""
    result = served(*args)["result"]
    assert result.exit_code == 2, result.output
    flag = args[0].replace("_", "-")
    assert_one_line(result, f"{flag} takes true or false, or no value (got {args[1]!r}")


def test_gguf_and_revision_names_serve(served, tmp_path, monkeypatch):
    """transformers serve's `<repo-or-dir>:<file>.gguf` and `org/model@rev` (from the local HF cache here)."""
    import huggingface_hub.constants

    (tmp_path / "ggufs").mkdir()
    (tmp_path / "ggufs" / "tiny.gguf").write_bytes(b"GGUF")
    seen = ok(served(f"{tmp_path / 'ggufs'}:tiny.gguf"))
    assert seen["spec"] == f"{tmp_path / 'ggufs'}:tiny.gguf" and seen["state"].force_model
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "snapshots" / "c0ffee").mkdir(parents=True)
    (repo / "snapshots" / "c0ffee" / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("c0ffee")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert ok(served("org/tiny@main"))["spec"] == "org/tiny@main"
    assert_one_line(served("org/tiny@v2")["result"], "(`hf download org/tiny --revision v2`)")


def test_a_flag_before_the_model_still_serves_it(served):
    seen = ok(served("--enable-cors", "MODEL_DIR"))
    assert seen["spec"].endswith("Qwen3-1.7B") and list(seen["app_kwargs"]["cors_allow_origins"]) == ["*"]


def test_the_speech_model_is_checked_at_start(served, tmp_path, make_fake_model):
    """--speech-model NONEXISTENT started without a word: the first transcription found out."""
    assert ok(served("--speech-model", "whisper-base"))  # the catalog's: pulled on first use
    whisper = make_fake_model(tmp_path / "my-whisper")
    (whisper / "config.json").write_text('{"model_type": "whisper"}')
    assert ok(served("--speech-model", str(whisper)))["state"].speech.options.default_model == str(whisper)
    chat = make_fake_model(tmp_path / "a-chat-model")
    assert_one_line(served("--speech-model", str(chat))["result"], "is not a speech-to-text (Whisper) model")
    assert_one_line(served("--speech-model", "smollm2-135m-instruct")["result"], "is a chat model")


def test_pin_model_gives_the_server_no_loader(served):
    """--pin-model: the served model is the only one, whatever a request names (no on-demand swap); without it
    the server can load another store model on demand."""
    assert ok(served("MODEL_DIR"))["state"].models.load is not None
    assert ok(served("MODEL_DIR", "--pin-model"))["state"].models.load is None
