"""What every handler shares: the loaded engine (None while loading), the served model's names, the
server's lifecycle (loading -> ready -> draining), its counters, the model registry and telemetry."""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from tfserve.server.api.logprobs import TokenTexts
from tfserve.server.errors import ApiError
from tfserve.server.media import MediaOptions
from tfserve.server.runtime.embedding_models import EmbeddingModels, EmbeddingOptions
from tfserve.server.runtime.metrics import ServerMetrics
from tfserve.server.runtime.request_limits import RequestLimits
from tfserve.server.runtime.residency import Loader, ModelResidency
from tfserve.server.runtime.speech import SpeechModels, SpeechOptions
from tfserve.server.runtime.stores import ConversationStore, ResponseStore
from tfserve.server.tools.mcp_tools import McpOptions

if TYPE_CHECKING:
    from tfserve.engine.async_engine import AsyncEngine
    from tfserve.engine.client import AsyncEngineClient, EngineClient

LOADING, READY, DRAINING = "loading", "ready", "draining"


class ServerState:
    """The model holder and lifecycle of one server. Lives on the event loop's thread."""

    def __init__(self, *, max_queued: int = 1024, force_model: bool = False, load: Loader | None = None,
                 model_timeout_s: float | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                 mcp: McpOptions | None = None, media: MediaOptions | None = None,
                 speech: SpeechOptions | None = None, embeddings: EmbeddingOptions | None = None,
                 limits: RequestLimits | None = None) -> None:
        self.engine: EngineClient | None = None  # the engine that admits requests, once loaded
        self.async_engine: AsyncEngineClient | None = None  # what streams them (one engine, or replicas)
        self.model_name: str | None = None
        self.model_spec: str | None = None  # what reloads the served model after a failed swap
        self.model_aliases: set[str] = set()  # other names a request may use for the served model
        self.created = int(time.time())
        self.status = LOADING
        self.failure: str | None = None  # why the engine stopped for good (the server exits with it)
        self.request_stop: Callable[[], None] | None = None  # ends `serve` (set by it)
        self.max_queued = max_queued  # sequences waiting for their first token, at most; 0 = no limit
        self.force_model = force_model  # serve the loaded model whatever a request's `model` says
        self.num_waiting = 0  # sequences submitted that have not produced a token yet
        # engine requests admitted (generation.admit) and not submitted yet: counted against --max-queued from
        # the moment they are admitted, so requests arriving together cannot all pass; held weakly, so one
        # whose handler ends before submitting it (a client gone while its stream opened) leaves no count
        self.admitted: weakref.WeakSet = weakref.WeakSet()
        self.num_active = 0  # HTTP requests being answered (draining waits for 0)
        self.token_texts: TokenTexts | None = None
        self.limits = limits or RequestLimits()  # per-request budgets: messages, n, model swaps, stored bytes
        self.metrics = ServerMetrics(self)
        self.models = ModelResidency(self, load, model_timeout_s)  # `load(spec)` loads models on demand; None: never
        # defaults for every chat template render (--chat-template-kwargs, --reasoning); a request's own override
        self.chat_template_kwargs: dict[str, Any] = dict(chat_template_kwargs or {})
        self.telemetry: Any = None  # tfserve.server.runtime.telemetry.Telemetry, with --otel
        # stored /v1/responses results (for previous_response_id) and /v1/conversations, each within its bytes
        self.responses = ResponseStore(self.limits.max_store_bytes, self.limits.max_stored_item_bytes)
        self.conversations = ConversationStore(self.limits.max_store_bytes, self.limits.max_stored_item_bytes)
        self.mcp_options = mcp or McpOptions()
        self._mcp_servers: Any = None  # tfserve.mcp.client.McpServers, made on first use (the SDK loads then)
        self.media_options = media or MediaOptions()  # image URLs, files and limits
        self.speech = SpeechModels(speech)  # Whisper models for /v1/audio/*, loaded on first use
        self.embeddings = EmbeddingModels(embeddings)  # encoders for /v1/embeddings, loaded at start

    @property
    def mcp_servers(self) -> Any:
        """The MCP servers this server calls tools on: --mcp-config's, and request URLs --mcp-allow-url allows."""
        if self._mcp_servers is None:
            from tfserve.mcp.client import McpServers

            self._mcp_servers = McpServers(self.mcp_options.configs,
                                           allow_url_patterns=self.mcp_options.allow_url_patterns)
        return self._mcp_servers

    async def start_mcp(self) -> None:
        """Start the configured stdio servers and connect the HTTP ones (failures are logged and retried on use)."""
        if self.mcp_options.configs:
            await self.mcp_servers.start()

    async def close_mcp(self) -> None:
        """Stop every stdio MCP server and close every connection."""
        if self._mcp_servers is not None:
            await self._mcp_servers.close()

    @property
    def num_queued(self) -> int:
        """Sequences waiting to run: the engine's queue, or, where more, those submitted without a first token
        that are not running (one waiting for its model to load, or for the engine's next step). Never counts
        a sequence twice (the sum did: the engine's queue is among the sequences without a first token)."""
        engine = self.engine
        if engine is None:
            return self.num_waiting
        return max(engine.num_waiting, self.num_waiting - engine.num_running)

    def set_engine(self, async_engine: AsyncEngine, name: str | None = None, path: str | Path | None = None) -> None:
        """Serve the (started) engine of `async_engine` under `name` (default: the engine's model name, and
        its path as another name); the server becomes ready."""
        engine = async_engine.engine
        name = name or engine.model_name
        path = path if path is not None else engine.model_path
        self.engine, self.async_engine, self.model_name = engine, async_engine, name
        self.model_spec = str(path) if path is not None else name
        self.model_aliases = {name}
        if path is not None:
            self.model_aliases |= {str(path), Path(path).name}
        self.token_texts = TokenTexts(engine.tokenizer) if engine.tokenizer is not None else None
        if self.status == LOADING:
            self.status = READY
        self.models.arm_idle_timer()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # set outside the server's loop (tests): nobody to tell
            return
        async_engine.manager.on_failure = lambda message: loop.call_soon_threadsafe(self.engine_failed, message)

    def engine_failed(self, message: str) -> None:
        """The engine cannot step any more (a dead tensor-parallel rank): answer 503 from now on and stop the
        server, which exits non-zero with `message`."""
        self.failure = message
        if self.request_stop is not None:
            self.request_stop()

    @property
    def is_ready(self) -> bool:
        """Loaded and serving: not still loading its first model, not draining."""
        return self.status == READY

    def clear_engine(self) -> None:
        """Forget the served model (the registry stops and frees it); the server stays ready."""
        self.engine = self.async_engine = self.model_name = self.token_texts = None
        self.model_aliases = set()

    def begin_drain(self) -> None:
        """Stop accepting requests: new ones and /health get 503; in-flight ones go on."""
        self.status = DRAINING

    def check_available(self) -> None:
        """503 unless a model is loaded and the server is not draining."""
        if self.failure is not None:
            raise ApiError(503, f"the engine failed: {self.failure}", code="engine_failed")
        if self.status == LOADING:
            raise ApiError(503, "the model is still loading; retry shortly", code="model_loading",
                           headers={"Retry-After": "2"})
        if self.status == DRAINING:
            raise ApiError(503, "the server is shutting down", code="server_draining")

    def resolve_model_name(self, name: str | None) -> str:
        """The served model's name for a request's `model`; 404 model_not_found for any other model."""
        if name is None or self.force_model or name in self.model_aliases:
            return self.model_name
        raise ApiError(404, f"The model {name!r} does not exist or is not served here; this server serves "
                            f"{self.model_name!r} (see GET /v1/models)", param="model", code="model_not_found")

    def generate(self, request: Any) -> AsyncIterator[Any]:
        """The outputs of one engine request built by `Engine.make_requests` (one sequence). Tests replace
        this to script a model's output."""
        return self.async_engine.generate_request(request)

    def stop(self) -> None:
        if self.async_engine is not None:
            self.async_engine.stop()
        self.speech.stop()
        self.embeddings.stop()


STATE = web.AppKey("tfserve_state", ServerState)  # app[STATE]: the state every handler reads
