"""`tfserve bench serve` against a scripted OpenAI-compatible server: streaming records, failures counted
(never a crash), JSON schema, --launch lifecycle, sweeps."""

import asyncio
import io
import json
import socket
import sys
import threading
import time

import pytest
from aiohttp import web
from typer.testing import CliRunner

from tfserve.bench.online import OnlineConfig, run_online
from tfserve.cli import app

KEYS = {"completed", "failed", "duration_s", "request_throughput", "output_throughput", "total_token_throughput",
        "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"}


SEEN_MODELS = web.AppKey("seen_models", list)  # the model names a fake server was sent
SEEN_BODIES = web.AppKey("seen_bodies", list)  # every chat body a fake server was sent

def _chunk(content=None, finish=None, usage=None):
    choices = [] if usage else [{"index": 0, "delta": {"content": content} if content else {},
                                 "finish_reason": finish}]
    body = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": choices}
    if usage:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n".encode()


def _fake_app(fail_every: int = 0, api_key: str | None = None) -> web.Application:
    count = {"n": 0}
    seen_models, seen_bodies = [], []

    @web.middleware
    async def key_check(request, handler):  # as tfserve serve --api-key: every /v1 route wants the key
        if api_key and request.path.startswith("/v1") and \
                request.headers.get("Authorization") != f"Bearer {api_key}":
            return web.json_response({"error": {"message": "invalid or missing API key", "type": "auth_error"}},
                                     status=401)
        return await handler(request)

    async def chat(request):
        body = await request.json()
        seen_models.append(body["model"])
        seen_bodies.append(body)
        count["n"] += 1
        if fail_every and count["n"] % fail_every == 0:
            return web.json_response({"error": {"message": "boom", "type": "server_error", "param": None,
                                                "code": None}}, status=500)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for word in ("Hello", " there", " friend"):
            await asyncio.sleep(0.01)
            await response.write(_chunk(word))
        await response.write(_chunk(finish="stop"))
        assert body["stream_options"]["include_usage"]
        await response.write(_chunk(usage={"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}))
        await response.write(b"data: [DONE]\n\n")
        return response

    async def health(request):
        return web.json_response({"status": "ok"})

    async def models(request):  # as vLLM names a model: by its path; then those the tests name
        return web.json_response({"object": "list", "data": [{"id": name, "object": "model"}
                                                             for name in ("/models/served-one", "m", "whisper-1")]})

    async def transcription(request):
        await request.post()
        return web.json_response({"text": "Hello there."})

    app_ = web.Application(middlewares=[key_check])
    app_.router.add_post("/v1/chat/completions", chat)
    app_.router.add_get("/health", health)
    app_.router.add_get("/v1/models", models)
    app_.router.add_post("/v1/audio/transcriptions", transcription)
    app_[SEEN_MODELS] = seen_models
    app_[SEEN_BODIES] = seen_bodies
    return app_


@pytest.fixture
def fake_server():
    servers = []

    def start(fail_every: int = 0, api_key: str | None = None) -> str:
        loop = asyncio.new_event_loop()
        app_ = _fake_app(fail_every, api_key)
        start.apps.append(app_)
        runner = web.AppRunner(app_)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        port = site._server.sockets[0].getsockname()[1]
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        servers.append((loop, runner, thread))
        return f"http://127.0.0.1:{port}/v1"

    start.apps = []
    yield start
    for loop, runner, thread in servers:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def test_records_from_a_streaming_server(fake_server):
    base_url = fake_server()
    records, duration = asyncio.run(run_online(OnlineConfig(base_url=base_url, model="m", concurrency=2),
                                               ["hi"] * 4))
    assert duration > 0
    assert all(r.ok for r in records)
    assert [r.output_tokens for r in records] == [3] * 4  # from usage
    assert all(r.prompt_tokens == 7 and len(r.token_times_s) == 3 for r in records)
    assert all(0 < r.ttft_s <= r.e2e_s for r in records)


def test_cli_image_goes_with_the_requests_it_is_spread_over(fake_server, tmp_path):
    from PIL import Image

    base_url = fake_server()
    Image.new("RGB", (4, 4), "red").save(tmp_path / "red.png")
    result = CliRunner().invoke(app, ["bench", "serve", "--url", base_url, "-n", "8", "-c", "2", "--image",
                                      str(tmp_path / "red.png"), "--image-fraction", "0.5"])
    assert result.exit_code == 0, result.output
    contents = [body["messages"][0]["content"] for body in fake_server.apps[0][SEEN_BODIES]]
    with_image = [c for c in contents if isinstance(c, list)]
    assert len(with_image) == 4 and len(contents) == 8
    part = with_image[0][0]
    assert part["type"] == "image_url" and part["image_url"]["url"].startswith("data:image/png;base64,")
    assert [OnlineConfig(base_url="x", model="m", image_url="u", image_fraction=0.25).with_image(i)
            for i in range(8)] == [False, False, False, True] * 2


@pytest.mark.parametrize("args, message", [
    (["--image", "{png}", "--endpoint", "completions"], "--image needs --endpoint chat"),
    (["--image", "{txt}"], "not a PNG, JPEG, WebP or GIF"),
])
def test_cli_image_mistakes_are_one_line(tmp_path, args, message):
    (tmp_path / "a.txt").write_text("x")
    args = [a.format(png=tmp_path / "a.png", txt=tmp_path / "a.txt") for a in args]
    result = CliRunner().invoke(app, ["bench", "serve", "--url", "127.0.0.1:9", *args])
    assert result.exit_code != 0 and message in result.output and "Traceback" not in result.output


def test_failures_are_counted_not_raised(fake_server):
    base_url = fake_server(fail_every=2)
    records, _ = asyncio.run(run_online(OnlineConfig(base_url=base_url, model="m", concurrency=1), ["hi"] * 6))
    assert sum(r.ok for r in records) == 3
    failed = [r for r in records if not r.ok]
    assert len(failed) == 3 and all("500" in r.error and "boom" in r.error for r in failed)


def test_cli_serve_writes_the_json_schema(fake_server, tmp_path):
    base_url = fake_server(fail_every=5)
    out = tmp_path / "run.json"
    result = CliRunner().invoke(app, ["bench", "serve", "--url", base_url, "--model", "m", "-n", "10", "-c", "3",
                                      "--max-tokens", "8", "-o", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert set(data) == KEYS | {"settings"}
    assert data["completed"] == 8 and data["failed"] == 2
    assert "boom" in result.output  # the first errors are shown


def test_cli_serve_json_says_how_the_run_was_made(fake_server, tmp_path, monkeypatch):
    from datetime import datetime

    from tfserve import __version__

    monkeypatch.setenv("TFSERVE_API_KEY", "sekrit")
    base_url = fake_server()
    out = tmp_path / "run.json"
    result = CliRunner().invoke(app, ["bench", "serve", "--url", base_url.removesuffix("/v1"), "-n", "4", "-c", "2",
                                      "--max-tokens", "8", "--input-len", "16", "--ignore-eos", "-o", str(out)])
    assert result.exit_code == 0, result.output
    settings = json.loads(out.read_text())["settings"]
    assert settings["command"] == "tfserve bench serve"
    assert settings["url"] == base_url and settings["model"] == "/models/served-one"  # as the server named it
    assert (settings["num_prompts"], settings["concurrency"], settings["max_tokens"], settings["input_len"]) == \
        (4, 2, 8, 16)
    assert settings["ignore_eos"] is True and settings["endpoint"] == "chat" and settings["launch"] is None
    assert datetime.fromisoformat(settings["date"]).tzinfo is not None
    assert settings["tfserve_version"] == __version__
    assert settings["host"]["isa"] in ("AVX-512", "AVX2", "NEON", "scalar") and settings["host"]["num_cpus"] >= 1
    assert "sekrit" not in out.read_text() and "api_key" not in settings  # a key is never written down


def test_cli_transcribe_json_says_how_the_runs_were_made(fake_server, tmp_path):
    from pathlib import Path

    audio = Path(__file__).parents[1] / "audio" / "data" / "fox.opus"
    base_url = fake_server()
    out = tmp_path / "runs.json"
    result = CliRunner().invoke(app, ["bench", "transcribe", str(audio), "--url", base_url, "-m", "whisper-1",
                                      "-n", "2", "-c", "1,2", "--clip-seconds", "1", "-o", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert set(data) == {"runs", "settings"} and [run["concurrency"] for run in data["runs"]] == [1, 2]
    settings = data["settings"]
    assert settings["command"] == "tfserve bench transcribe" and settings["files"] == [str(audio)]
    assert (settings["url"], settings["model"], settings["num_requests"], settings["concurrency"],
            settings["clip_seconds"]) == (base_url, "whisper-1", 2, [1, 2], 1.0)
    assert settings["tfserve_version"] and settings["date"] and settings["host"]["isa"]


def test_cli_serve_asks_the_server_which_model_it_serves(fake_server):
    base_url = fake_server()
    seen = fake_server.apps[-1][SEEN_MODELS]
    result = CliRunner().invoke(app, ["bench", "serve", "--url", base_url, "-n", "4", "-c", "2", "--max-tokens", "4"])
    assert result.exit_code == 0, result.output
    assert seen == ["/models/served-one"] * 4


def test_cli_sweep_and_request_rate(fake_server, tmp_path):
    base_url = fake_server()
    out = tmp_path / "sweep.json"
    result = CliRunner().invoke(app, ["bench", "serve", "--url", base_url.removesuffix("/v1"), "--model", "m", "-n", "4",
                                      "--sweep", "concurrency=1,4", "--request-rate", "50", "-o", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert set(data) == {"sweep", "values", "runs", "settings"}
    assert data["sweep"] == "concurrency" and data["values"] == [1, 4]
    assert data["settings"]["sweep"] == "concurrency=1,4" and data["settings"]["request_rate"] == 50
    assert all(set(run) == KEYS and run["completed"] == 4 for run in data["runs"])
    compared = CliRunner().invoke(app, ["bench", "compare", str(out)])
    assert compared.exit_code == 0 and "c=4" in compared.output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_launch_starts_waits_and_stops_the_server(tmp_path):
    port = _free_port()
    script = tmp_path / "server.py"
    script.write_text(
        "import sys\nsys.path.insert(0, %r)\n" % str(tmp_path.parent)
        + "from aiohttp import web\n"
        + f"from test_online_helper import build\nweb.run_app(build(), host='127.0.0.1', port={port})\n")
    helper = tmp_path.parent / "test_online_helper.py"
    helper.write_text(
        "import asyncio, json\nfrom aiohttp import web\n"
        "def build():\n"
        "    from importlib import import_module\n"
        f"    import sys; sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})\n"
        "    return import_module('test_online')._fake_app()\n")
    out = tmp_path / "run.json"
    result = CliRunner().invoke(app, ["bench", "serve", "--url", f"127.0.0.1:{port}", "--model", "m", "-n", "2",
                                      "--launch", f"{sys.executable} {script}", "--launch-timeout", "60",
                                      "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["completed"] == 2
    deadline = time.monotonic() + 10
    while _listening(port) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _listening(port)  # the launched server is gone


def test_models_launch_the_server_once_per_model_with_its_start_and_memory(tmp_path):
    port = _free_port()
    script = tmp_path / "server.py"
    script.write_text(
        "import sys\nsys.path.insert(0, %r)\n" % str(__import__('pathlib').Path(__file__).parent)
        + "open(%r, 'a').write(sys.argv[1] + '\\n')\n" % str(tmp_path / "launched.txt")
        + "from aiohttp import web\nfrom test_online import _fake_app\n"
        + f"web.run_app(_fake_app(), host='127.0.0.1', port={port})\n")
    out = tmp_path / "models.json"
    result = CliRunner().invoke(app, ["bench", "serve", "--url", f"127.0.0.1:{port}", "-n", "2",
                                      "--launch", f"{sys.executable} {script} {{model}}", "--launch-timeout", "60",
                                      "--models", "a model.gguf,b.gguf", "--sweep", "concurrency=1,2", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "launched.txt").read_text().splitlines() == ["a model.gguf", "b.gguf"]  # quoted, in turn
    data = json.loads(out.read_text())
    assert [entry["model"] for entry in data["models"]] == ["a model.gguf", "b.gguf"]
    for entry in data["models"]:
        assert entry["start_s"] > 0 and entry["rss_mb_ready"] > 10 and entry["rss_mb_after"] > 10
        assert [run["completed"] for run in entry["runs"]] == [2, 2]
    assert result.output.count("ready in") == 2  # each model's start and memory, as it finishes


@pytest.mark.parametrize("args, fragment", [
    (["--models", "a.gguf"], "--models needs --launch with {model}"),
    (["--models", "a.gguf", "--launch", "tfserve serve"], "--models needs --launch with {model}"),
    (["--models", ",", "--launch", "x {model}"], "--models names no model"),
])
def test_models_without_a_launch_to_put_them_in_are_one_line(args, fragment):
    result = CliRunner().invoke(app, ["bench", "serve", "--url", f"127.0.0.1:{_free_port()}", *args])
    assert result.exit_code == 2 and fragment in result.output and "Traceback" not in result.output, result.output


def test_launch_that_dies_is_one_readable_line(tmp_path):
    result = CliRunner().invoke(app, ["bench", "serve", "--url", f"127.0.0.1:{_free_port()}", "-n", "1",
                                      "--launch", f"{sys.executable} -c 'raise SystemExit(3)'"])
    assert result.exit_code == 1
    assert "exited with code 3" in result.output
    assert "Traceback" not in result.output


def test_a_launched_server_that_dies_shows_its_last_lines(tmp_path):
    """It said only "the launched server exited with code 1 before it was ready": its output went nowhere, and
    the reason (a misspelt model name) with it."""
    script = tmp_path / "dies.py"
    script.write_text("import sys\nfor i in range(30):\n    print('line', i)\n"
                      "print(\"Error: unknown model 'smollm2-135m-instrct'\", file=sys.stderr)\nsys.exit(1)\n")
    result = CliRunner().invoke(app, ["bench", "serve", "--url", f"127.0.0.1:{_free_port()}", "-n", "1",
                                      "--launch", f"{sys.executable} {script}"])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[0] == "The launched server's last output:"
    assert lines[1:-1] == [f"    line {i}" for i in range(11, 30)] + ["    Error: unknown model 'smollm2-135m-instrct'"]
    assert lines[-1] == "Error: the launched server exited with code 1 before it was ready (its last output is above)"


def test_launched_output_goes_to_the_log_path_when_given(tmp_path):
    from tfserve.bench.launch import launched
    from tfserve.errors import TfserveError

    log = tmp_path / "server.log"
    with pytest.raises(TfserveError, match="exited with code 2"):
        with launched(f"{sys.executable} -c \"print('kept'); raise SystemExit(2)\"",
                      f"http://127.0.0.1:{_free_port()}/v1", 30, log_path=str(log)):
            pass
    assert log.read_text() == "kept\n"


def test_unreachable_server_is_one_readable_line():
    result = CliRunner().invoke(app, ["bench", "serve", "--url", f"127.0.0.1:{_free_port()}", "-n", "1"])
    assert result.exit_code == 1
    assert "cannot reach" in result.output and "Traceback" not in result.output


def test_transcribe_an_unreachable_server_is_one_readable_line():
    from pathlib import Path

    audio = Path(__file__).parents[1] / "audio" / "data" / "fox.opus"
    port = _free_port()
    result = CliRunner().invoke(app, ["bench", "transcribe", str(audio), "--url", f"127.0.0.1:{port}", "-n", "1"])
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]  # not a table of failed runs
    assert lines == [f"Error: cannot reach http://127.0.0.1:{port} — is the server running?"], result.output


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_cli_all_requests_failing_is_an_error_and_the_json_stays_strict(fake_server, tmp_path):
    base_url = fake_server(fail_every=1)
    out = tmp_path / "run.json"
    result = CliRunner().invoke(app, ["bench", "serve", "--url", base_url, "--model", "m", "-n", "2", "-c", "1",
                                      "--max-tokens", "4", "-o", str(out)])
    assert result.exit_code == 1 and "every request failed" in result.output, result.output
    json.loads(out.read_text(), parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))  # NaN -> null


@pytest.mark.parametrize("flag", ["-o", "--plot"])
def test_cli_an_output_path_that_cannot_be_written_is_one_line_before_the_run(tmp_path, flag):
    for path in (tmp_path / "missing" / "x", tmp_path):
        result = CliRunner().invoke(app, ["bench", "serve", "--url", "127.0.0.1:9", flag, str(path)])
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output  # a bad value
        assert ("no folder" in result.output or "is a folder" in result.output) and "reach" not in result.output


def test_cli_launch_refuses_when_something_already_answers(fake_server):
    base_url = fake_server()
    result = CliRunner().invoke(app, ["bench", "serve", "--url", base_url, "-n", "1", "--launch", "sleep 30"])
    assert result.exit_code == 1 and "already answers" in result.output, result.output


@pytest.mark.parametrize("url", ["8000", "localhost:8000", "http://localhost:8000/", "http://localhost:8000/v1",
                                 "http://localhost:8000/v1/models", "localhost:8000/v1/chat/completions"])
def test_url_is_read_as_chat_reads_it(url):
    from tfserve.chat.client import openai_base_url

    assert openai_base_url(url) == "http://localhost:8000/v1"


def _one_line(result) -> str:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in result.output, result.output
    return lines[0]


@pytest.mark.parametrize("args, fragments", [
    (["-m", "nosuch"], ["does not serve 'nosuch'", "its chat models: /models/served-one, m"]),
    (["--sweep", "concurrency=1,2", "-m", "nosuch"], ["does not serve 'nosuch'"]),
    (["-m", "whisper-1"], ["'whisper-1' is a speech-to-text model"]),
    (["--api-key", "wrong"], ["refused the API key given with --api-key (401)"]),
])
def test_cli_serve_checks_the_server_before_sending_load(fake_server, args, fragments):
    base_url = fake_server(api_key="sekrit" if "--api-key" in args else None)
    result = CliRunner().invoke(app, ["bench", "serve", "--url", base_url, "-n", "4", "--max-tokens", "4", *args])
    assert result.exit_code == 1
    line = _one_line(result)  # not a table of zeros after every request failed
    assert all(fragment in line for fragment in fragments), line
    assert fake_server.apps[0][SEEN_MODELS] == []  # no request was sent


def test_cli_serve_with_the_servers_key_runs(fake_server):
    base_url = fake_server(api_key="sekrit")
    result = CliRunner().invoke(app, ["bench", "serve", "--url", base_url, "-n", "2", "--max-tokens", "4",
                                      "--api-key", "sekrit"])
    assert result.exit_code == 0, result.output
    assert fake_server.apps[0][SEEN_MODELS] == ["/models/served-one"] * 2


def test_cli_serve_against_a_plain_plain_web_server_is_one_line(plain_web_server):
    result = CliRunner().invoke(app, ["bench", "serve", "--url", plain_web_server, "-n", "2"])
    assert result.exit_code == 1
    assert _one_line(result) == (f"Error: http://{plain_web_server} does not answer /v1/models as an OpenAI-compatible "
                                 "server (404)")


def test_transcribe_checks_the_server_and_shows_the_url_it_reads(fake_server, tmp_path):
    from pathlib import Path

    audio = Path(__file__).parents[1] / "audio" / "data" / "fox.opus"
    base_url = fake_server(api_key="sekrit")
    address = base_url.removeprefix("http://").removesuffix("/v1")  # 127.0.0.1:PORT
    args = ["bench", "transcribe", str(audio), "--url", address, "-m", "whisper-1", "-n", "1", "-c", "1"]
    refused = CliRunner().invoke(app, args)
    assert refused.exit_code == 1
    assert "refused the API key (401" in _one_line(refused) and "nan" not in refused.output
    missing = CliRunner().invoke(app, [*args, "--api-key", "sekrit", "-m", "nosuch"])
    assert missing.exit_code == 1 and "does not serve 'nosuch'; its models: " in _one_line(missing)
    out = tmp_path / "run.json"
    result = CliRunner().invoke(app, [*args, "--api-key", "sekrit", "-o", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    title = " ".join(result.output.split())
    assert f"{base_url} whisper-1 concurrency=1" in title  # the URL as read: http://127.0.0.1:PORT/v1
    assert json.loads(out.read_text())["settings"]["url"] == base_url


@pytest.mark.parametrize("command", [["serve", "-n", "1"], ["transcribe", "x.wav"]])
@pytest.mark.parametrize("url, message", [
    ("nonsense::::", "invalid URL 'nonsense::::': use host:port or http(s)://host:port[/v1]"),
    ("ftp://x", "invalid URL 'ftp://x': use host:port or http(s)://host:port[/v1]"),
    ("127.0.0.1:99999", "invalid URL '127.0.0.1:99999': the port must be 1-65535"),
    ("http://", "invalid URL 'http://': no host"),
])
def test_cli_a_url_that_is_no_url_is_a_usage_error(command, url, message):
    result = CliRunner().invoke(app, ["bench", *command, "--url", url])
    assert result.exit_code == 2
    assert message in _one_line(result) and "reach" not in result.output


def test_cli_plot_needs_a_sweep_before_anything_runs(tmp_path):
    result = CliRunner().invoke(app, ["bench", "serve", "--url", "127.0.0.1:9", "--plot", str(tmp_path / "p.png")])
    assert result.exit_code == 2
    assert "--plot needs --sweep" in _one_line(result) and not (tmp_path / "p.png").exists()


def test_cli_launch_timeout_must_be_positive():
    result = CliRunner().invoke(app, ["bench", "serve", "--launch", "true", "--launch-timeout", "-1"])
    assert result.exit_code == 2 and "--launch-timeout" in result.output, result.output


def _write_results(tmp_path) -> tuple:
    from tfserve.bench.metrics import RequestRecord, summarize

    def run(tokens_per_s: float) -> dict:
        return summarize([RequestRecord(ok=True, output_tokens=100, ttft_s=0.1, e2e_s=100 / tokens_per_s,
                                        token_times_s=[0.1, 100 / tokens_per_s])], 100 / tokens_per_s)

    single, sweep = tmp_path / "bs.json", tmp_path / "sw.json"
    single.write_text(json.dumps({**run(100), "settings": {"concurrency": 8}}))
    sweep.write_text(json.dumps({"sweep": "concurrency", "values": [1, 8], "runs": [run(50), run(200)],
                                 "settings": {"sweep": "concurrency=1,8"}}))
    return single, sweep


def test_cli_compare_plot_of_single_runs_fails_before_the_table(tmp_path):
    single, _ = _write_results(tmp_path)
    result = CliRunner().invoke(app, ["bench", "compare", str(single), str(single), "--plot",
                                      str(tmp_path / "cmp.png")])
    assert result.exit_code == 2
    assert "--plot needs sweep results" in _one_line(result)  # no table printed first


def test_cli_compare_a_single_run_with_a_sweep(tmp_path):
    from rich.console import Console

    from tfserve.bench.report import compare_table, load_runs

    single, sweep = _write_results(tmp_path)
    result = CliRunner().invoke(app, ["bench", "compare", str(single), str(sweep)])
    assert result.exit_code == 0, result.output
    assert "2.00x" in result.output  # the sweep's c=8 against the single run, made at c=8
    console = Console(file=io.StringIO(), width=200, force_terminal=False)
    console.print(compare_table(load_runs(single) + load_runs(sweep)))
    rows = {line.split("│")[1].strip(): line for line in console.file.getvalue().splitlines() if "│" in line}
    assert "200.0 2.00x" in rows["sw c=8"] and "0.44x" in rows["sw c=8"]  # its TPOT too
    assert "x" not in rows["sw c=1"].replace("sw c=1", "")  # no run at c=1 before it: no ratio...
    assert "no ratio: no run before it at the same sweep point" in console.file.getvalue()  # ...and why


def test_a_server_still_loading_its_model_is_waited_for(monkeypatch):
    """/health 503 (the model loads): every request sent now would fail, so the run waits for it, up to a bound."""
    from tfserve.bench import launch
    from tfserve.errors import TfserveError

    answers = iter([503, 503, 200])
    monkeypatch.setattr(launch, "_status", lambda url: next(answers))
    monkeypatch.setattr(launch.time, "sleep", lambda s: None)
    launch.check_reachable("http://127.0.0.1:9/v1")  # returns once /health says 200
    monkeypatch.setattr(launch, "_status", lambda url: 503)
    with pytest.raises(TfserveError, match="still loading its model after 0 s"):
        launch.check_reachable("http://127.0.0.1:9/v1", loading_timeout_s=0.01)
