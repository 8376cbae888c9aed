"""What the layers above see of the engine (engine/client.py): the engine, its AsyncEngine and the replica set
all provide the protocol the server holds them by, and `Engine.stats()` reads the counters /metrics shows."""

from __future__ import annotations

import pytest

from tfserve.engine.client import AsyncEngineClient, EngineClient, EngineStats
from tfserve.sampling_params import Grammar, SamplingParams

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


def _members(protocol) -> set[str]:
    """The names a protocol asks for: its annotated attributes, properties and methods."""
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {name for name, value in vars(protocol).items()
              if not name.startswith("_") and (callable(value) or isinstance(value, property))}
    return names


def test_the_engine_is_an_engine_client(make_engine):
    engine = make_engine()
    assert isinstance(engine, EngineClient)
    missing = [name for name in _members(EngineClient) if not hasattr(engine, name)]
    assert not missing


def test_the_async_engine_and_the_replica_set_stream_for_the_server(make_engine):
    from tfserve.engine.async_engine import AsyncEngine
    from tfserve.serving.replicas import ReplicatedEngine

    engine = make_engine()
    for front in (AsyncEngine(engine), ReplicatedEngine(engine, [])):
        assert isinstance(front, AsyncEngineClient), type(front).__name__
        assert isinstance(front.engine, EngineClient)
        assert {"generate_request", "stop"} <= {name for name in dir(front) if callable(getattr(front, name))}


def test_stats_read_the_pool_the_scheduler_and_the_counters(make_engine):
    engine = make_engine(num_blocks=64)
    before = engine.stats()
    assert before == EngineStats(kv_cache_blocks_total=64)
    assert before.spec_acceptance_rate == 0.0
    engine.add_request(PROMPT, SamplingParams(max_tokens=3, temperature=0))
    engine.add_request(PROMPT, SamplingParams(max_tokens=3, temperature=0))
    assert engine.stats().num_waiting == 2
    engine.step()
    during = engine.stats()
    assert during.num_running == 2 and during.num_waiting == 0 and during.kv_cache_blocks_used > 0
    while engine.has_unfinished:
        engine.step()
    after = engine.stats()
    assert after.num_running == 0 and after.kv_cache_blocks_used == 0 and after.num_steps >= 3
    assert after.prefix_cache_queried_tokens > 0
    counters = after.replica_counters()
    assert counters["kv_cache_blocks_total"] == 64 and counters["num_running"] == 0


def test_grammars_compile_through_the_engine(make_engine):
    from tfserve.engine.structured import GrammarError

    engine = make_engine()
    grammar = Grammar.regex("[ab]{1,3}")
    assert not engine.grammar_compiled(grammar)
    engine.prepare_grammars()
    assert engine.grammars_ready
    engine.compile_grammar(grammar)
    assert engine.grammar_compiled(grammar)
    with pytest.raises(GrammarError):
        engine.compile_grammar(Grammar.json_schema({"type": "no such type"}))


def test_the_model_is_described_without_reaching_into_it(make_engine, llama):
    engine = make_engine()
    assert engine.model_type == "llama"
    assert engine.num_parameters == sum(p.numel() for p in llama.parameters())
    assert engine.input_modalities == ["text"]


def test_the_server_reads_the_engine_only_through_the_protocol():
    """Every `state.engine.<name>` in the server, the chat client and the CLI is a member of EngineClient: the
    layers above never reach into the block pool, scheduler, runner or grammar compiler."""
    import re
    from pathlib import Path

    import tfserve

    root = Path(tfserve.__file__).parent
    used = {match.group(1) for folder in ("server", "chat", "cli") for path in (root / folder).rglob("*.py")
            for match in re.finditer(r"state\.engine\.(\w+)", path.read_text())}
    assert used and used <= _members(EngineClient), used - _members(EngineClient)
