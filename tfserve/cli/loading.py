"""Loading a model for `serve` and the in-process `chat`: the engine from `Engine.from_pretrained`, its stages
shown as progress, started on its background thread."""

from __future__ import annotations


def engine_config_from_flags(engine_kwargs: dict):
    """The one EngineConfig the flags describe (a draft model named alone implies speculative draft); a bad
    value is one line naming the flag."""
    from tfserve.config import EngineConfig
    from tfserve.errors import UsageError

    if engine_kwargs.get("speculative_model") and not engine_kwargs.get("speculative"):
        engine_kwargs = {**engine_kwargs, "speculative": "draft"}
    try:
        config = EngineConfig(**engine_kwargs)
    except ValueError as exc:
        raise UsageError(f"--{str(exc).replace('_', '-')}") from None
    if config.speculative == "draft" and config.speculative_model is None:
        raise UsageError("--speculative draft needs --speculative-model: the draft model")
    return config


def refuse_speech_model(name: str | None, use: str) -> None:
    """One line, before anything loads, for a speech-to-text model named where a chat model is needed (it would
    load as a text model: a 30-line load report, then empty replies)."""
    from tfserve.errors import TfserveError
    from tfserve.models import store

    if name and store.is_speech_model(name):
        raise TfserveError(f"{name!r} is a speech-to-text model: {use}")


def check_speech_model(name: str) -> None:
    """--speech-model, checked at start as --model is (it loads on the first audio request, where a typo would be
    a 404 to a client): a catalog speech model (pulled on first use), or a store name, directory or cached hub id
    that holds a Whisper model."""
    from tfserve.errors import ModelNotFoundError, TfserveError
    from tfserve.models import catalog, store
    from tfserve.models.loading import resolve_model

    known = catalog.get_known(name)
    if known is not None and known.task == "speech":
        return
    if known is not None and not store.is_pulled(name):
        raise TfserveError(f"--speech-model {name}: {name!r} is a chat model, not a speech-to-text one; give a "
                           "Whisper model (e.g. whisper-tiny.en)")
    try:
        resolved = resolve_model(name)
    except ModelNotFoundError as exc:
        raise ModelNotFoundError(f"--speech-model {name}: {exc}") from None
    if resolved.kind == "gguf" or not store.is_speech_dir(resolved.path):
        raise TfserveError(f"--speech-model {name}: {resolved.path} is not a speech-to-text (Whisper) model; "
                           "give a Whisper model (e.g. whisper-tiny.en)")


def load_engine(spec: str, load_options: dict, engine_config=None, show_progress: bool = True,
                data_parallel_size: int = 1, ray_address: str | None = None, scalable: bool = False):
    """Load the model and start its engine (an AsyncEngine, which `ServerState.set_engine` serves); with
    `data_parallel_size` > 1, replicas 1.. load in processes of their own meanwhile (Ray actors with
    `ray_address`); `scalable`: replicas even when there is one (they will be scaled). Loads on demand show no
    progress bars (they would tangle with the access log)."""
    from contextlib import nullcontext

    from tfserve.cli.progress import step_progress
    from tfserve.engine.async_engine import AsyncEngine
    from tfserve.engine.engine import Engine

    def load_here():
        with step_progress() if show_progress else nullcontext(lambda *args, **kwargs: None) as progress:
            return Engine.from_pretrained(spec, engine_config, progress=progress, **load_options)

    if data_parallel_size == 1 and not scalable:
        return AsyncEngine(load_here()).start()
    from tfserve.serving.replica import ReplicaSpec
    from tfserve.serving.replicas import start_replicas

    return start_replicas(ReplicaSpec(spec, load_options, engine_config, data_parallel_size), load_here,
                          ray_address=ray_address)
