"""The aiohttp application: routes, and the middlewares every request passes through
(metrics + access log, OpenAI error bodies, API-key auth, body-size limit, CORS)."""

from __future__ import annotations

import functools
import hmac
import logging
import re
import time
import uuid
from collections.abc import Sequence
from http import HTTPStatus

import aiohttp_cors
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from tfserve.server.api import admin, audio, chat, completions, conversations, health, models, responses
from tfserve.server.api import embeddings, ollama, tgi, tokenize
from tfserve.server.errors import TGI_PATHS, ApiError, error_for
from tfserve.server.generation import USAGE
from tfserve.server.runtime.connection_limits import ConnectionLimits
from tfserve.server.runtime.connections import ConnectionTracker, LimitedHandler
from tfserve.server.runtime.residency import LEASE
from tfserve.server.runtime.state import STATE, ServerState
from tfserve.server.sse import EVENT_STREAM

logger = logging.getLogger("tfserve.server")
CLIENT_LEFT = web.RequestKey("tfserve_client_left", bool)  # request[CLIENT_LEFT]: its event stream lost the client
access_logger = logging.getLogger("tfserve.access")

DEFAULT_MAX_BODY_SIZE = 16 * 1024 * 1024
API_KEY = web.AppKey("tfserve_api_key", str)
ADMIN_KEY = web.AppKey("tfserve_admin_key", str)
CONNECTION_LIMITS = web.AppKey("tfserve_connection_limits", ConnectionLimits)
# what clients call (the API key guards them, draining waits for them): OpenAI's /v1, Ollama's /api, vLLM's tokenize
SERVED_PATHS = ("/v1/", "/api/", "/tokenize", "/detokenize")


def create_app(state: ServerState, *, api_key: str | None = None, cors_allow_origins: Sequence[str] = (),
               max_body_size: int = DEFAULT_MAX_BODY_SIZE,
               connection_limits: ConnectionLimits | None = None, admin_key: str | None = None) -> web.Application:
    """The server's application over `state`. `api_key` guards /v1/*, `admin_key` /admin/* (which are off
    without it); `cors_allow_origins` ("*" for any)
    lets browsers call it; bodies over `max_body_size` bytes get 413; `connection_limits` hold once
    `json_errors(runner)` has run (default: ConnectionLimits())."""
    app = web.Application(
        middlewares=[_observe, _errors, _auth],
        client_max_size=max_body_size,
        handler_args={
            "access_log_class": AccessLogger,
            "access_log": access_logger,
            # a client that disconnects cancels its handler, which aborts its generation at once
            "handler_cancellation": True,
            # read_json undoes Content-Encoding itself: aiohttp's own decoding answers a bad one with a 500 or
            # a plain-text 400 and leaves the keep-alive connection unusable
            "auto_decompress": False,
        },
    )
    app[STATE] = state
    app[API_KEY] = api_key
    app[ADMIN_KEY] = admin_key
    app[CONNECTION_LIMITS] = connection_limits or ConnectionLimits()
    app.on_response_prepare.append(_request_id)
    app.router.add_post("/v1/chat/completions", chat.chat_completions)
    app.router.add_post("/v1/completions", completions.completions)
    app.router.add_post("/v1/responses", responses.create_response)
    app.router.add_post("/v1/responses/input_tokens", responses.count_input_tokens)
    conversations.add_routes(app)
    app.router.add_get("/v1/responses/{response_id}", responses.get_response)
    app.router.add_delete("/v1/responses/{response_id}", responses.delete_response)
    app.router.add_get("/v1/responses/{response_id}/input_items", responses.list_input_items)
    app.router.add_post("/v1/audio/transcriptions", audio.transcriptions)
    app.router.add_post("/v1/audio/translations", audio.translations)
    app.router.add_post("/v1/embeddings", embeddings.create_embeddings)
    app.router.add_get("/v1/models", models.list_models)
    app.router.add_get("/v1/models/{model_id:.+}", models.get_model)
    app.router.add_get("/health", health.health)
    tgi.add_routes(app)  # TGI's /generate, /generate_stream, /info
    ollama.add_routes(app)  # Ollama's /api/*
    app.router.add_post("/tokenize", tokenize.tokenize)
    app.router.add_post("/detokenize", tokenize.detokenize)
    app.router.add_get("/metrics", health.metrics)
    app.router.add_get("/admin/replicas", admin.get_replicas)
    app.router.add_post("/admin/replicas", admin.set_replicas)
    if cors_allow_origins:
        options = aiohttp_cors.ResourceOptions(allow_credentials=True, expose_headers="*", allow_headers="*",
                                               allow_methods="*")
        cors = aiohttp_cors.setup(app, defaults={origin: options for origin in cors_allow_origins})
        for route in list(app.router.routes()):
            cors.add(route)
        app.on_response_prepare.append(functools.partial(_cors_on_errors, frozenset(cors_allow_origins)))
    return app


async def _cors_on_errors(origins: frozenset[str], request: web.Request, response: web.StreamResponse) -> None:
    """aiohttp_cors answers for the routes it wraps; a 404 or 405 comes from no route, so a browser could not read
    its error body: those get the same Access-Control-Allow-Origin."""
    origin = request.headers.get("Origin")
    if origin is None or "Access-Control-Allow-Origin" in response.headers:
        return
    if "*" in origins or origin in origins:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Allow-Credentials"] = "true"
        response.headers.add("Vary", "Origin")


_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # a client's own X-Request-Id: printable ASCII, kept short


async def _request_id(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer carries `x-request-id` (as OpenAI's do; the SDK shows it as `_request_id`): the client's own
    X-Request-Id where it sent a sane one (vLLM's rule), else a new one."""
    given = request.headers.get("X-Request-Id", "")
    response.headers["x-request-id"] = given if _REQUEST_ID.fullmatch(given) else f"req_{uuid.uuid4().hex}"


def json_errors(runner: web.AppRunner) -> None:
    """After `runner.setup()`: what aiohttp answers itself, for a request that never reaches the app (a request
    line or header it cannot parse, a line past its limits, a broken chunked body), is an OpenAI error body like
    every other error here, not aiohttp's text/plain. aiohttp has no hook for it: its server makes our handler,
    which also holds the app's ConnectionLimits (connections.py)."""
    runner.server.__class__ = _JsonErrorServer
    runner.server.tracker = ConnectionTracker(runner.app[CONNECTION_LIMITS])


class _JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JsonErrorHandler(self, loop=self._loop, **self._kwargs)


class _JsonErrorHandler(LimitedHandler):
    __slots__ = ()

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs it; refuses where a response has begun
        if status >= 500:
            error = ApiError(status, HTTPStatus(status).phrase, code="internal_error")
        else:  # aiohttp's message points at the bad byte over three lines: one line here
            lines = [line.strip() for line in (message or "").splitlines() if line.strip().strip("^")]
            error = ApiError(status, " ".join(lines) or HTTPStatus(status).phrase, code="bad_http_request")
        response = web.json_response(error.body(), status=status)
        response.force_close()
        return response

    def log_exception(self, *args, **kwargs) -> None:
        """A request aiohttp cannot parse is the client's bytes, not our fault: one warning line (aiohttp logged
        a traceback for each, so anyone could fill the log), the rest as aiohttp logs it."""
        exc = kwargs.get("exc_info")
        if isinstance(exc, HttpProcessingError) and 400 <= exc.code < 500:
            reason = " ".join(line.strip() for line in str(exc.message).splitlines() if line.strip().strip("^"))
            self.logger.warning("%s: %s (%d)", args[0] % args[1:], printable(reason), exc.code)
            return
        super().log_exception(*args, **kwargs)


def _endpoint(request: web.Request) -> str:
    """The route's pattern, so that metrics labels stay few whatever paths clients send."""
    resource = getattr(request.match_info.route, "resource", None)
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def _observe(request: web.Request, handler) -> web.StreamResponse:
    """Count requests by endpoint and status; track in-flight /v1 requests for draining; end the request's
    model lease; with telemetry, make the request's trace."""
    state: ServerState = request.app[STATE]
    counted = request.path.startswith(SERVED_PATHS) or request.path in TGI_PATHS
    state.num_active += counted
    traced = counted and state.telemetry is not None
    start_ns, start_perf = time.time_ns(), time.perf_counter()
    status = 499  # the client went away before an answer
    try:
        response = await handler(request)
        status = 499 if request.get(CLIENT_LEFT) else response.status
        return response
    finally:
        state.num_active -= counted
        model = request.get(LEASE)
        state.models.release(request)
        endpoint = _endpoint(request)
        state.metrics.requests.labels(endpoint, str(status)).inc()
        if status == 499:  # aiohttp logs no line for a request its client left: this one says so
            log_access(access_logger, request, status, time.perf_counter() - start_perf)
        if traced:
            try:
                state.telemetry.record_request(request, endpoint, status, start_ns, start_perf, request.get(USAGE),
                                               model)
            except Exception:  # telemetry never fails a request
                logger.exception("recording the trace of %s %s failed", request.method, request.path)


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    """Every error leaves as an OpenAI error body with its status; never a traceback page."""
    try:
        return await handler(request)
    except ApiError as exc:
        body, status = error_for(request.path, exc)  # TGI's and Ollama's routes answer in their own shapes
        return web.json_response(body, status=status, headers=exc.headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.text or exc.reason
        if exc.status == 404:
            message = f"no route {request.method} {request.path}"
        elif exc.status == 405:
            message = f"method {request.method} is not allowed on {request.path}"
        error = ApiError(exc.status, message, code={413: "request_too_large"}.get(exc.status))
        headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
        body, status = error_for(request.path, error)
        return web.json_response(body, status=status, headers=headers)
    except ConnectionResetError:  # the client left mid-response: nothing to answer
        stream = request.get(EVENT_STREAM)
        if stream is None or not stream.is_open:
            raise
        request[CLIENT_LEFT] = True
        return stream.response  # ended by aiohttp quietly (it logged a traceback for the error raised)
    except Exception as exc:
        logger.exception("%s %s failed", printable(request.method), printable(request.path))
        error = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")
        return web.json_response(error_for(request.path, error)[0], status=500)


@web.middleware
async def _auth(request: web.Request, handler) -> web.StreamResponse:
    """With an API key, /v1/*, Ollama's /api/*, TGI's routes and /tokenize need `Authorization: Bearer KEY`;
    /admin/* needs the admin key (the API key does not open it) and is off without one; /health, /metrics and
    CORS preflights need neither."""
    if request.method == "OPTIONS":
        return await handler(request)
    if request.path.startswith("/admin"):
        admin_key = request.app[ADMIN_KEY]
        if not admin_key:
            raise ApiError(403, "the admin endpoints are off: the server was started without --admin-key",
                           code="admin_disabled")
        if not _bearer_is(request, admin_key):
            raise ApiError(401, "invalid or missing admin key: send Authorization: Bearer <admin key>",
                           code="invalid_api_key")
        return await handler(request)
    api_key = request.app[API_KEY]
    guarded = request.path.startswith(SERVED_PATHS) or request.path in TGI_PATHS
    if api_key and guarded and not _bearer_is(request, api_key):
        raise ApiError(401, "invalid or missing API key: send Authorization: Bearer <key>", code="invalid_api_key")
    return await handler(request)


def _bearer_is(request: web.Request, key: str) -> bool:
    """Whether the request's `Authorization: Bearer` token is `key` (compared in constant time)."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    # aiohttp keeps header bytes that are not UTF-8 as surrogates: encode them back rather than fail
    token_bytes = token.strip().encode("utf-8", "surrogateescape")
    return scheme.lower() == "bearer" and hmac.compare_digest(token_bytes, key.encode())


_PROBES = frozenset({"/health", "/metrics"})


def log_access(log: logging.Logger, request: web.BaseRequest, status: int, seconds: float) -> None:
    """The request's access line: method, path, status, prompt/completion tokens, TTFT, duration."""
    usage = request.get(USAGE)
    tokens = ttft = "-"
    if usage is not None:
        tokens = f"{usage.prompt_tokens}/{usage.completion_tokens}"
        ttft = f"{usage.ttft_s * 1000:.0f}ms" if usage.ttft_s is not None else "-"
    # probes (load balancers, `bench --launch`, orchestrators) poll these: keep them out of the info log
    level = logging.DEBUG if request.path in _PROBES else logging.INFO
    log.log(level, "%s %s %s tokens=%s ttft=%s duration=%.0fms", printable(request.method), printable(request.path),
            status, tokens, ttft, seconds * 1000)


_UNPRINTABLE = re.compile(r"[^\x20-\x7e\xa0-\ud7ff\ue000-\U0010ffff]|[\u2028\u2029\u200b-\u200f\u202a-\u202e]")


def printable(text: str) -> str:
    """`text` for a log line: control and other non-printable characters (a `%0a` a client put in its path) as
    escapes, so that no client can end the line and forge the next."""
    return _UNPRINTABLE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


class AccessLogger(AbstractAccessLogger):
    """One line per request: method, path, status, prompt/completion tokens, TTFT, duration."""

    def log(self, request, response, time: float) -> None:
        log_access(self.logger, request, response.status, time)

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)
