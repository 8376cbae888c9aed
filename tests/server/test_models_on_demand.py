"""Models on demand: /v1/models lists the store; a request naming another store model evicts the resident
one (once its requests finish) and loads it; concurrent requests share one load; --force-model pins."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from tiny import LiveServer, build_engine

MESSAGES = [{"role": "user", "content": "hi"}]


class FakeStore:
    """Store entries under a tmp TFSERVE_HOME, and a loader that builds a tiny engine for each."""

    def __init__(self, root, tokenizer, names) -> None:
        self.tokenizer = tokenizer
        self.loaded: list[str] = []
        self.engines: dict[str, weakref.ref] = {}
        self.async_engines: dict[str, object] = {}
        self.gate = threading.Event()  # cleared: loads wait (to look at the server mid-load)
        self.gate.set()
        self.fail = set()
        for name in names:
            path = root / "models" / name
            path.mkdir(parents=True)
            (path / "config.json").write_text("{}")
            (path / "model.safetensors").write_bytes(b"\x02" + bytes(7) + b"{}")  # a safetensors file of no tensors
            (path / "tokenizer.json").write_text("{}")

    def load(self, spec: str):
        """Like the CLI's loader: a store name, or (restoring the previous model) its directory."""
        from tfserve.engine.async_engine import AsyncEngine
        from tfserve.models import store

        self.gate.wait(30)
        spec = Path(spec).name
        self.loaded.append(spec)
        if spec in self.fail:
            raise RuntimeError(f"{spec} is broken")
        engine = build_engine(self.tokenizer, num_blocks=64)
        self.engines[spec] = weakref.ref(engine)
        engine.model_name, engine.model_path = spec, str(store.model_path(spec.split(":")[0]))
        async_engine = AsyncEngine(engine).start()
        self.async_engines[spec] = weakref.ref(async_engine)
        return async_engine


@pytest.fixture
def fake_store(tmp_path, monkeypatch, tokenizer):
    monkeypatch.setenv("TFSERVE_HOME", str(tmp_path))
    return FakeStore(tmp_path, tokenizer, ["model-a", "model-b", "model-c", "model-bad"])


@pytest.fixture
def live(fake_store):
    from tfserve.server.runtime.state import ServerState

    state = ServerState(load=fake_store.load)
    state.set_engine(fake_store.load("model-a"))
    server = LiveServer(state)
    yield server
    server.close()
    state.stop()


def chat(live, model, **kwargs):
    return live.client().chat.completions.create(model=model, messages=MESSAGES, max_tokens=3, **kwargs)


def test_models_lists_the_store(live):
    client = live.client()
    assert [m.id for m in client.models.list()] == ["model-a", "model-b", "model-bad", "model-c"]
    assert client.models.retrieve("model-b").owned_by == "tfserve"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("model-z")
    assert info.value.body["code"] == "model_not_found"


def test_models_not_loaded_say_what_they_take_in_from_their_config(live, fake_store, tmp_path):
    """`input_modalities` of a store model not loaded, from its config: an image-text-to-text model with a vision
    tower takes images, a vision config on a text-only type does not, a Whisper model takes audio; the loaded
    model's comes from its engine."""
    (tmp_path / "models" / "model-b" / "config.json").write_text(
        '{"model_type": "llava", "vision_config": {"model_type": "clip_vision_model"}}')
    (tmp_path / "models" / "model-bad" / "config.json").write_text('{"model_type": "llama", "vision_config": {}}')
    (tmp_path / "models" / "model-c" / "config.json").write_text('{"model_type": "whisper"}')
    listed = {m.id: m.model_extra.get("input_modalities") for m in live.client().models.list()}
    assert listed == {"model-a": ["text"], "model-b": ["text", "image"], "model-bad": ["text"], "model-c": ["audio"]}
    assert live.client().models.retrieve("model-b").model_extra["input_modalities"] == ["text", "image"]
    assert fake_store.loaded == ["model-a"]


def test_a_request_for_another_model_loads_it_and_evicts_the_idle_one(live, fake_store):
    assert chat(live, "model-a").model == "model-a"
    assert chat(live, "model-b").model == "model-b"
    assert fake_store.loaded == ["model-a", "model-b"]
    gc.collect()
    assert fake_store.engines["model-a"]() is None, "the evicted engine is still referenced"
    assert fake_store.async_engines["model-a"]() is None
    assert chat(live, None).model == "model-b"  # no `model`: the resident one
    status, _, body = live.request("GET", "/health")
    assert status == 200 and body["model"] == "model-b"
    assert [m.id for m in live.client().models.list()][0] == "model-b"


def test_concurrent_requests_for_the_model_being_loaded_wait_for_it(live, fake_store):
    fake_store.gate.clear()
    with ThreadPoolExecutor(3) as pool:
        replies = [pool.submit(chat, live, "model-c") for _ in range(2)]
        for _ in range(200):
            if live.state.models.loading == "model-c":
                break
            time.sleep(0.01)
        status, _, body = live.request("GET", "/health")
        assert status == 200 and body["loading"] == "model-c"
        default = pool.submit(chat, live, None)  # waits for the swap too, then uses model-c
        fake_store.gate.set()
        assert [r.result(60).model for r in replies] == ["model-c", "model-c"]
        assert default.result(60).model == "model-c"
    assert fake_store.loaded == ["model-a", "model-c"]


def test_eviction_waits_for_in_flight_requests(live, fake_store):
    stream = live.client().chat.completions.create(model="model-a", messages=MESSAGES, max_tokens=40, stream=True,
                                                   stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(chat, live, "model-b")
        rest = list(chunks)
        assert other.result(60).model == "model-b"
    assert first.model == "model-a" and rest[-1].usage.completion_tokens == 40
    assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "length"


def test_unknown_models_and_paths_are_404_and_load_nothing(live, fake_store):
    for name in ["model-z", "../model-a", "/etc", "org/not-cached"]:
        with pytest.raises(openai.NotFoundError) as info:
            chat(live, name)
        assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    assert fake_store.loaded == ["model-a"]


def test_a_gguf_file_of_a_store_model_loads_by_name_but_no_folder_of_the_servers(live, fake_store, tmp_path,
                                                                                  monkeypatch):
    """transformers' `NAME:FILE.gguf`: the file inside a store model (or a cached hub repo) loads on demand; the
    same form naming a folder in the server's working directory is a path, and a 404."""
    (tmp_path / "models" / "model-b" / "model.gguf").write_bytes(b"GGUF")
    assert chat(live, "model-b:model.gguf").model == "model-b:model.gguf"
    assert chat(live, "model-b:model.gguf").model == "model-b:model.gguf"  # resident now: not loaded again
    assert fake_store.loaded == ["model-a", "model-b:model.gguf"]
    (tmp_path / "work" / "here").mkdir(parents=True)
    (tmp_path / "work" / "here" / "x.gguf").write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path / "work")
    for name in ["here:x.gguf", "model-b:nope.gguf", "org/not-cached:x.gguf", "model-b:../x.gguf"]:
        with pytest.raises(openai.NotFoundError) as info:
            chat(live, name)
        assert info.value.body["code"] == "model_not_found", name
    assert fake_store.loaded == ["model-a", "model-b:model.gguf"]


def test_a_speech_model_named_for_text_is_a_400_and_evicts_nothing(live, fake_store, tmp_path):
    (tmp_path / "models" / "model-c" / "config.json").write_text('{"model_type": "whisper"}')
    for path, body in [("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "hi"}),
                       ("/v1/responses", {"input": "hi"})]:
        status, _, error = live.request("POST", path, {"model": "model-c", **body})
        assert status == 400 and error["error"]["param"] == "model", error
        assert "/v1/audio/transcriptions" in error["error"]["message"]
    assert fake_store.loaded == ["model-a"]
    assert live.client().models.retrieve("model-c").model_extra["input_modalities"] == ["audio"]


def test_a_store_folder_that_cannot_load_is_not_listed_and_evicts_nothing(live, fake_store, tmp_path):
    """A folder `models list` marks (no tokenizer, weights cut short) is left out of /v1/models, and a request
    naming it is a 404 saying why, before the resident model is unloaded for it."""
    (tmp_path / "models" / "model-b" / "tokenizer.json").unlink()
    (tmp_path / "models" / "model-c" / "model.safetensors").write_bytes(b"\x40" + bytes(7) + b"{}")
    assert [m.id for m in live.client().models.list()] == ["model-a", "model-bad"]
    for name, why in (("model-b", "no tokenizer"), ("model-c", "broken weights: model.safetensors is cut short")):
        status, _, error = live.request("POST", "/v1/chat/completions", {"model": name, "messages": MESSAGES})
        assert status == 404 and error["error"]["param"] == "model" and why in error["error"]["message"], error
    assert fake_store.loaded == ["model-a"]


def test_a_failed_load_is_500_and_the_previous_model_comes_back(live, fake_store):
    fake_store.fail.add("model-bad")
    with pytest.raises(openai.InternalServerError) as info:
        chat(live, "model-bad")
    assert info.value.body["code"] == "model_load_failed" and "model-bad is broken" in info.value.body["message"]
    assert fake_store.loaded == ["model-a", "model-bad", "model-a"]
    assert chat(live, None).model == "model-a"
    assert live.request("GET", "/health")[0] == 200


def test_force_model_ignores_hints_and_loads_nothing(fake_store):
    from tfserve.server.runtime.state import ServerState

    state = ServerState(load=fake_store.load, force_model=True)
    state.set_engine(fake_store.load("model-a"))
    live = LiveServer(state)
    try:
        assert chat(live, "model-b").model == "model-a"
        assert [m.id for m in live.client().models.list()] == ["model-a"]
        assert fake_store.loaded == ["model-a"]
    finally:
        live.close()
        state.stop()


def test_names_that_are_not_models_get_one_message_whatever_is_on_disk(live, fake_store, tmp_path, monkeypatch):
    """A file, a folder without config.json and nothing at all, relative to the server's working directory (and a
    hub id not cached): the same 404, so a client cannot probe the server's disk (issue 43)."""
    (tmp_path / "work" / "secret").mkdir(parents=True)
    (tmp_path / "work" / "secret" / "file.txt").write_text("x")
    (tmp_path / "work" / "home" / "models").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work")
    messages = set()
    for name in ["secret/file.txt", "home/models", "secret/nothing", "../etc"]:
        with pytest.raises(openai.NotFoundError) as info:
            chat(live, name)
        assert info.value.body["code"] == "model_not_found"
        messages.add(info.value.body["message"].replace(repr(name), "NAME"))
    assert messages == {"The model NAME does not exist or is not served here; see GET /v1/models"}
    assert fake_store.loaded == ["model-a"]


def test_model_swaps_are_rate_limited(live, fake_store):
    """Alternating two model names kept the server reloading (40 s a swap, issue 43): within
    --model-swap-interval of the last load, a request for another model is a 429 with Retry-After and evicts
    nothing; the resident model still answers."""
    live.state.limits.model_swap_interval_s = 30
    assert chat(live, "model-b").model == "model-b"
    with pytest.raises(openai.RateLimitError) as info:
        chat(live, "model-a")
    assert info.value.body["code"] == "model_swap_rate_limited" and "--model-swap-interval" in info.value.body["message"]
    assert 1 <= int(info.value.response.headers["Retry-After"]) <= 30
    assert chat(live, "model-b").model == "model-b"
    assert fake_store.loaded == ["model-a", "model-b"]
    live.state.models._last_load_end -= 30  # the interval is over
    assert chat(live, "model-a").model == "model-a"


def test_a_pinned_model_is_never_swapped(fake_store):
    """--pin-model: the server gets no loader; another store model's name is a 404 and loads nothing."""
    from tfserve.server.runtime.state import ServerState

    state = ServerState(load=None)
    state.set_engine(fake_store.load("model-a"))
    live = LiveServer(state)
    try:
        with pytest.raises(openai.NotFoundError):
            chat(live, "model-b")
        assert chat(live, "model-a").model == "model-a" and fake_store.loaded == ["model-a"]
    finally:
        live.close()
        state.stop()
