"""`tfserve serve`'s own flags, declared once: their types, help texts and panels (the command's signature names
them, with their defaults). The Limits panel's are in serve_limits.py, transformers serve's spellings in
serve_compat.py."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer

from tfserve.cli import serve_compat as compat
from tfserve.cli import serve_limits
from tfserve.cli.completion import chat_models, choices, speech_models
from tfserve.cli.serve_compat import Reasoning
from tfserve.serving.autoscale import MAX_REPLICAS

ENGINE = "Engine"
DISTRIBUTED = "Distributed"
SERVER = "Server"
MCP = "MCP tools"
MEDIA = "Media"
SPEECH = "Speech"


class GenerationConfig(str, Enum):
    """--generation-config: where a request's missing sampling fields come from."""

    auto = "auto"
    none = "none"


class LogLevel(str, Enum):
    """--log-level: Python's levels, and transformers' detail."""

    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"
    critical = "critical"
    detail = "detail"  # transformers' name for debug with file and line


def _power_of_two(value: int | None) -> int | None:
    if value is not None and value & (value - 1):
        raise typer.BadParameter(f"must be a power of two (got {value})")
    return value


def _seed(value: int | None) -> int | None:
    """--default-seed: any seed torch takes (transformers passes it to torch.manual_seed as it is), a negative
    one as torch maps it, 2**64 + seed."""
    if value is not None and not -2**63 <= value < 2**64:
        raise typer.BadParameter(f"must be an integer from -2**63 to 2**64 - 1 (got {value})")
    return value + 2**64 if value is not None and value < 0 else value


def _fraction(value: float | None) -> float | None:
    if value is not None and not 0 < value <= 1:
        raise typer.BadParameter(f"must be a fraction in (0, 1] (got {value})")
    return value


ModelArg = Annotated[str | None, typer.Argument(
    metavar="MODEL", show_default=False, autocompletion=chat_models,
    help="Model to serve, pinned as with --force-model (as `transformers serve MODEL`; its org/model@rev and "
         "repo-or-dir:file.gguf forms too).")]
HostOpt = Annotated[str, typer.Option(help="Address to listen on (0.0.0.0 for every interface).",
                                      rich_help_panel=SERVER)]
PortOpt = Annotated[int, typer.Option("--port", "-p", min=1, max=65535, help="Port to listen on.",
                                      rich_help_panel=SERVER)]
GenerationConfigOpt = Annotated[GenerationConfig, typer.Option(
    help="auto: sampling fields a request leaves out (temperature, top_p, top_k, min_p, repetition_penalty, "
         "max_tokens) take the model's generation_config; none: OpenAI's defaults.",
    rich_help_panel=ENGINE)]
MaxBatchTokensOpt = Annotated[int, typer.Option(min=1, help="Token budget of one engine step (prefill chunks + "
                                                            "decodes).", rich_help_panel=ENGINE)]
MaxNumSeqsOpt = Annotated[int, typer.Option(min=1, help="Sequences decoded together, at most.",
                                            rich_help_panel=ENGINE)]
MaxModelLenOpt = Annotated[int | None, typer.Option(
    min=2, metavar="TOKENS", show_default=False, rich_help_panel=ENGINE,
    help="Longest sequence, prompt and output together (vLLM's flag; default: the model's context length).")]
LongPrefillTokenThresholdOpt = Annotated[int | None, typer.Option(
    min=1, metavar="TOKENS", show_default=False, rich_help_panel=ENGINE,
    help="A prefill takes at most TOKENS of a step (vLLM's flag): long prompts and images run over several "
         "steps and the decodes beside them keep their pace (default: the step's budget).")]
KvCacheMemoryOpt = Annotated[str | None, typer.Option(
    help="KV cache size: bytes (2GiB, 512MiB) or a fraction of free memory (0.5). "
         "Default: 1 GiB on CPU, 70% of free GPU memory.", rich_help_panel=ENGINE)]
NumBlocksOpt = Annotated[int | None, typer.Option(
    min=1, show_default=False, help="KV cache blocks (instead of sizing the cache by --kv-cache-memory).",
    rich_help_panel=ENGINE)]
BlockSizeOpt = Annotated[int, typer.Option(min=1, callback=_power_of_two,
                                           help="Tokens per KV cache block (a power of two).",
                                           rich_help_panel=ENGINE)]
SpeculativeOpt = Annotated[str | None, typer.Option(
    autocompletion=choices("ngram", "draft"),
    help="Speculative decoding for greedy requests, the same tokens several per step: ngram (prompt lookup: "
         "where the text repeats itself, as in edits, code and quotes) or draft (a smaller model of the same "
         "tokenizer guesses: --speculative-model).", rich_help_panel=ENGINE)]
SpeculativeModelOpt = Annotated[str | None, typer.Option(
    autocompletion=chat_models,
    help="The draft model of --speculative draft (implies it), as --model takes it: a store name, an HF "
         "directory, a .gguf file or a cached hub id.", rich_help_panel=ENGINE, show_default=False)]
NumSpeculativeTokensOpt = Annotated[int, typer.Option(
    min=1, max=16, help="Tokens proposed per step with --speculative.", rich_help_panel=ENGINE)]
DistributedInitMethodOpt = Annotated[str | None, typer.Option(
    help="The ranks' rendezvous, tcp://HOST:PORT (default: a free local port).", rich_help_panel=DISTRIBUTED,
    show_default=False)]
DataParallelSizeOpt = Annotated[int, typer.Option(
    "--data-parallel-size", "-dp", min=1, max=MAX_REPLICAS,
    help="Engine replicas, each a process with its own KV cache; a request goes to the one most likely to hold "
         "its prompt's prefix unless that one is much busier.", rich_help_panel=DISTRIBUTED)]
MinReplicasOpt = Annotated[int | None, typer.Option(
    "--min-replicas", min=1, show_default=False,
    help="Scale the replicas with the load, never below this (default: 1 with --max-replicas).",
    rich_help_panel=DISTRIBUTED)]
MaxReplicasOpt = Annotated[int | None, typer.Option(
    "--max-replicas", min=1, max=MAX_REPLICAS, show_default=False,
    help="Scale the replicas with the load, up to this: one per --target-requests-per-replica requests in "
         "flight, added after 5 s of such load, retired after 60 s without (--data-parallel-size: the count "
         "at start).", rich_help_panel=DISTRIBUTED)]
TargetRequestsPerReplicaOpt = Annotated[int, typer.Option(
    "--target-requests-per-replica", min=1,
    help="Requests in flight (running and queued) per replica that scaling aims at.",
    rich_help_panel=DISTRIBUTED)]
RayOpt = Annotated[str | None, typer.Option(
    "--ray", metavar="ADDRESS", show_default=False,
    help="Run replicas 1.. of --data-parallel-size as Ray actors on the cluster at ADDRESS (auto: the one "
         "`ray start` runs here; local: start one on this machine). Needs `pip install ray`.",
    rich_help_panel=DISTRIBUTED)]
NnodesOpt = Annotated[int, typer.Option(
    min=1, help="Machines the ranks span (each runs this command with its --node-rank; the first serves).",
    rich_help_panel=DISTRIBUTED)]
NodeRankOpt = Annotated[int, typer.Option(
    min=0, help="This machine's place among --nnodes: 0 serves HTTP, the others only run their ranks.",
    rich_help_panel=DISTRIBUTED)]
DistributedTimeoutOpt = Annotated[float, typer.Option(
    min=1, help="Seconds any collective may take before the engine gives up on a rank (a dead rank fails "
                "the requests in flight, and the server exits, within this).", rich_help_panel=DISTRIBUTED)]
NoPrefixCachingOpt = Annotated[bool, typer.Option("--no-prefix-caching",
                                                  help="Do not reuse the KV of shared prompt prefixes.",
                                                  rich_help_panel=ENGINE)]
MaxBodySizeOpt = Annotated[str, typer.Option(help="Largest request body; bigger ones get 413.",
                                             rich_help_panel=SERVER)]
MaxQueuedOpt = Annotated[int, typer.Option(min=0, help="Sequences waiting for their first token, at most; more get "
                                                       "429 (0: no limit).", rich_help_panel=SERVER)]
ApiKeyOpt = Annotated[str | None, typer.Option(
    envvar="TFSERVE_API_KEY", show_envvar=True, rich_help_panel=SERVER,
    help="Require `Authorization: Bearer KEY` on /v1/*, Ollama's /api/*, TGI's routes and /tokenize "
         "(/health stays open).")]
AdminKeyOpt = Annotated[str | None, typer.Option(
    envvar="TFSERVE_ADMIN_KEY", show_envvar=True, rich_help_panel=SERVER, show_default=False,
    help="Turn on /admin/* (POST /admin/replicas starts engine processes), behind `Authorization: Bearer "
         "KEY`; the --api-key does not open them. Without it they answer 403.")]
HeaderTimeoutOpt = Annotated[float, typer.Option(
    min=0.1, metavar="SECONDS", rich_help_panel=serve_limits.LIMITS,
    help="A connection whose request headers take longer is closed (slowloris; nginx's "
         "client_header_timeout).")]
MaxConnectionsOpt = Annotated[int, typer.Option(
    min=1, rich_help_panel=serve_limits.LIMITS,
    help="Open connections at most; more get 503 and close. Lowered to fit under the open-file limit "
         "(ulimit -n) less 128.")]
MaxConnectionsPerClientOpt = Annotated[int, typer.Option(
    min=0, rich_help_panel=serve_limits.LIMITS,
    help="Open connections from one client address at most; more get 503 and close (0: no cap; behind a "
         "reverse proxy every client is the proxy's address).")]
CorsAllowOriginsOpt = Annotated[list[str] | None, typer.Option(
    help="Origin browsers may call from (repeatable; * for any).", rich_help_panel=SERVER)]
EnableCorsOpt = Annotated[bool, typer.Option("--enable-cors/--no-enable-cors",
                                             help="Let browsers call from any origin: --cors-allow-origins '*'.",
                                             rich_help_panel=SERVER)]
DrainTimeoutOpt = Annotated[float, typer.Option(min=0, help="Seconds SIGINT/SIGTERM waits for in-flight requests.",
                                                rich_help_panel=SERVER)]
ForceModelOpt = Annotated[str | None, typer.Option(help="Serve this model whatever a request's `model` names "
                                                        "(overrides --model; no other model is loaded on demand).",
                                                   rich_help_panel=SERVER)]
ModelTimeoutOpt = Annotated[float, typer.Option(
    min=-1, metavar="SECONDS",
    help="Unload the model after SECONDS without requests; the next request loads it again. -1 (or 0): never "
         "(transformers serve's default is 300). No effect on a pinned model.", rich_help_panel=SERVER)]
DefaultSeedOpt = Annotated[int | None, typer.Option(
    callback=_seed, show_default=False,
    help="Seed torch once the model is loaded: requests without a seed then sample the same tokens after a "
         "restart (for the same requests in the same order). A negative seed is 2**64 + seed, as torch "
         "takes it.", rich_help_panel=SERVER)]
ReasoningOpt = Annotated[Reasoning, typer.Option(
    help="on/off: render chat templates with enable_thinking true/false (Qwen3 and other reasoning models); "
         "auto: the template's default.", rich_help_panel=SERVER)]
ChatTemplateOpt = Annotated[str | None, typer.Option(
    metavar="FILE", callback=compat.chat_template, show_default=False,
    help="A Jinja chat template (a file, or the template itself) used over the model's own, as vLLM's "
         "--chat-template: a base model without one then serves /v1/chat/completions too.",
    rich_help_panel=SERVER)]
ChatTemplateKwargsOpt = Annotated[str | None, typer.Option(
    metavar="JSON", callback=compat.check_json_object, show_default=False,
    help="Chat template variables for every request, a JSON object (e.g. '{\"enable_thinking\": false}'); "
         "a request's own chat_template_kwargs override them.", rich_help_panel=SERVER)]
OtelOpt = Annotated[bool, typer.Option("--otel", help="Export a trace per request and the engine's gauges over "
                                                      "OTLP (OTEL_* variables configure it; needs the otel extra).",
                                       rich_help_panel=SERVER)]
McpConfigOpt = Annotated[str | None, typer.Option(
    metavar="FILE", show_default=False, rich_help_panel=MCP,
    help="MCP servers whose tools requests may use by server_label (/v1/responses mcp tools; chat completions "
         "with {\"type\": \"mcp\"} tools): an mcpServers JSON file as Claude Desktop and Cursor use. Stdio "
         "servers start with this server, restart if they die and stop with it.")]
McpAllowUrlOpt = Annotated[list[str] | None, typer.Option(
    metavar="PATTERN", show_default=False, rich_help_panel=MCP,
    help="Let requests name a server_url matching PATTERN (a glob over the URL, e.g. "
         "'https://mcp.example.com/*'); repeatable. Without it a request's server_url is refused.")]
McpTimeoutOpt = Annotated[float, typer.Option(
    min=0.001, metavar="SECONDS", rich_help_panel=MCP,
    help="A tool call running longer fails (an mcp_call error the model reads), never a hung request.")]
AllowedMediaDomainsOpt = Annotated[list[str] | None, typer.Option(
    metavar="HOST", show_default=False, rich_help_panel=MEDIA,
    help="Only image URLs on this host are fetched (repeatable; vLLM's flag). Without it any host is, unless "
         "it resolves to a private, loopback, link-local or reserved address.")]
AllowedLocalMediaPathOpt = Annotated[str | None, typer.Option(
    metavar="DIR", show_default=False, rich_help_panel=MEDIA,
    help="Let requests name file:// image URLs under DIR (symlinks resolved; vLLM's flag). Without it "
         "file:// URLs are refused.")]
LimitMmPerPromptOpt = Annotated[str | None, typer.Option(
    metavar="N|JSON", show_default=False, rich_help_panel=MEDIA,
    help="Images one request may hold, over its whole conversation: a number or vLLM's JSON "
         "('{\"image\": 4}'). Default 16.")]
MaxImageSizeOpt = Annotated[str, typer.Option(
    metavar="SIZE", rich_help_panel=MEDIA,
    help="Largest image file (a data URL, a download, a file); a bigger one is a 400.")]
MaxImagePixelsOpt = Annotated[int, typer.Option(
    min=1, metavar="PIXELS", rich_help_panel=MEDIA,
    help="Largest image, width x height, checked before decoding.")]
MediaFetchTimeoutOpt = Annotated[float, typer.Option(
    min=0.001, metavar="SECONDS", rich_help_panel=MEDIA,
    help="An image URL taking longer to fetch (redirects included) is a 400.")]
SpeechModelOpt = Annotated[str, typer.Option(
    metavar="NAME", rich_help_panel=SPEECH, autocompletion=speech_models,
    help="Whisper model for /v1/audio/* requests naming 'whisper-1' or no model; loaded on the first "
         "one (pulled first if it is a catalog model the store lacks). Requests may name others.")
]
MaxAudioSecondsOpt = Annotated[float, typer.Option(
    min=1.0, metavar="SECONDS", rich_help_panel=SPEECH,
    help="Longest audio file a transcription takes; a longer one is a 400.")]
MaxAudioWindowsOpt = Annotated[int, typer.Option(
    min=1, metavar="N", rich_help_panel=SPEECH,
    help="30-second windows of audio one speech model decodes in one batch (across requests).")]
LogLevelOpt = Annotated[LogLevel, typer.Option(case_sensitive=False,
                                               help="info logs one access line per request; also sets "
                                                    "transformers' level (except info).",
                                               rich_help_panel=SERVER)]
CbBlockSizeOpt = Annotated[int | None, typer.Option(
    min=1, callback=_power_of_two, show_default=False, help="Same as --block-size.",
    rich_help_panel=compat.COMPAT)]
CbNumBlocksOpt = Annotated[int | None, typer.Option(
    min=1, show_default=False, help="Same as --num-blocks.", rich_help_panel=compat.COMPAT)]
CbMaxBatchTokensOpt = Annotated[int | None, typer.Option(
    min=1, show_default=False, help="Same as --max-batch-tokens.", rich_help_panel=compat.COMPAT)]
CbMaxMemoryPercentOpt = Annotated[float | None, typer.Option(
    callback=_fraction, show_default=False, rich_help_panel=compat.COMPAT,
    help="Same as --kv-cache-memory FRACTION: the KV cache as a fraction of free memory.")]
