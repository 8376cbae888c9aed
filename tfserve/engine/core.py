"""The engine: `schedule() -> execute() -> postprocess()`, one step at a time, and `generate_batch`.

Requests come in through `admission.py` (checked, defaults filled, `n` fanned out), models through
`loading.py` (`Engine.from_pretrained`); a step's tokens go out through `postprocess.py`.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from typing import Any, Iterable

from tfserve.config import EngineConfig
from tfserve.engine import admission
from tfserve.engine.client import EngineStats
from tfserve.engine.detokenizer import IncrementalDetokenizer
from tfserve.engine.draft import DraftModel
from tfserve.engine.kernel_paths import kernel_paths
from tfserve.engine.kv_cache import BlockPool
from tfserve.engine.loading import close_ranks, load_engine, with_overrides
from tfserve.engine.multimodal import VisionLanguage
from tfserve.engine.offline import generate_batch
from tfserve.engine.postprocess import logprobs_to_send, make_output, take_tokens
from tfserve.engine.request import Request, RequestOutput, RequestStatus
from tfserve.engine.runner import ModelRunner
from tfserve.engine.scheduler import Scheduler, SchedulerOutput
from tfserve.engine.spec_decode import accepted
from tfserve.engine.structured import StructuredOutputs
from tfserve.engine.threads import run_in_fresh_thread
from tfserve.errors import EngineFailedError
from tfserve.sampling_params import Grammar, SamplingParams

logger = logging.getLogger(__name__)


class Engine:
    """Continuous batching over a transformers causal LM: paged KV cache, prefix caching, chunked prefill,
    preemption, vectorised sampling. Not thread-safe: use `BatchingManager` (or `AsyncEngine`) to share it."""

    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None, *, processor: Any = None,
                 tensor_parallel: Any = None, workers: Any = None, draft_model: Any = None,
                 draft_gguf_file: str | None = None, **overrides: Any) -> None:
        """`config` (default: EngineConfig()) with any of its fields overridden by keyword, e.g.
        `Engine(model, tokenizer, max_num_seqs=8)`; a bad value raises ValueError naming the field. A
        vision-language model comes with its `processor` (images in prompts: `render_multimodal`). With
        `speculative="draft"`, `draft_model` (of the same tokenizer) proposes the greedy decodes' tokens.
        `tensor_parallel`, `workers`: rank 0's split of the model and the ranks it started (from_pretrained)."""
        self.config = config = with_overrides(config, overrides)
        self.model = model
        self.tokenizer = tokenizer
        self.processor = processor
        self.tensor_parallel = tensor_parallel  # rank 0's TensorParallel when the model is split (from_pretrained)
        self._workers = workers  # the worker ranks this process started
        self.failure: str | None = None  # why the engine cannot step any more (a dead rank), once it cannot
        self.vocab_size = model.config.get_text_config().vocab_size
        self.vision = VisionLanguage(model, processor) if processor is not None else None
        draft, propose = None, None
        if config.speculative == "draft":
            if draft_model is None:
                raise ValueError("speculative draft needs a draft model (speculative_model, or draft_model=)")
            if self.vision is not None:  # (tensor parallelism: EngineConfig refuses it)
                raise ValueError("a draft model proposes for text models only, not with images")
            # made by the runner once its KV cache is sized: the draft's cache has the same blocks
            draft = functools.partial(DraftModel, draft_model, config, vocab_size=self.vocab_size,
                                      gguf_file=draft_gguf_file)
            propose = _draft_places
        self.runner = ModelRunner(model, config, tensor_parallel, vision=self.vision, draft=draft)
        if self.vision is not None and self.vision.bidirectional and self.runner.flash_attention:
            raise ValueError("attn_implementation flash_attention_2 cannot attend an image's tokens both ways "
                             f"({type(model).__name__}); leave it unset for tfserve's paged attention")
        self.block_pool = BlockPool(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_pool, config.max_batch_tokens, config.max_num_seqs,
                                   config.num_speculative_tokens if config.speculative else 0,
                                   config.long_prefill_token_threshold, propose)
        self.num_draft_tokens = 0  # speculative decoding: proposals checked, and accepted
        self.num_accepted_tokens = 0
        self.max_model_len = self.runner.max_model_len
        self.eos_token_ids = admission.eos_token_ids(model, tokenizer)
        self.structured = StructuredOutputs(tokenizer, self.vocab_size, self.eos_token_ids)
        # what a request that leaves a sampling field out gets (as vLLM's --generation-config auto)
        self.sampling_defaults = admission.sampling_defaults(model) if config.generation_config == "auto" else {}
        # where the model came from, for banners and /v1/models (from_pretrained fills them in)
        self.model_name: str = type(model).__name__
        self.model_path: str | None = None
        self.device = str(self.runner.device)
        self.dtype = self.runner.dtype
        self.quantization = "none"
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.load_seconds: float | None = None  # from_pretrained: from the start of the load to a ready engine
        self.matmul_units: dict[str, str] = {}  # weight format -> the instructions that multiply it (CPU kernels)
        self.kernel_paths = kernel_paths(self.runner.cpu_ops)  # CPU kernel path -> the instructions it runs on

    @classmethod
    def from_pretrained(cls, model: str | None = None, config: EngineConfig | None = None, *, dtype: str = "auto",
                        device: str = "auto", quantization: str = "none", attn_implementation: str | None = None,
                        trust_remote_code: bool = False, progress=None, **overrides: Any) -> Engine:
        """Load a model through the store's loader (store name, HF directory, .gguf file or cached hub id; the
        default model is pulled when missing) and build the engine over it. `progress(step, ...)` is told each
        stage: pull, load, the CPU kernels' first build, the KV cache (engine/loading.py)."""
        return run_in_fresh_thread(load_engine, cls, model, config, dtype=dtype, device=device,
                                   quantization=quantization, attn_implementation=attn_implementation,
                                   trust_remote_code=trust_remote_code, progress=progress, **overrides)

    def close(self) -> None:
        """Stop the worker ranks of a tensor-parallel engine (a no-op otherwise); the engine cannot step after."""
        tp, self.tensor_parallel = self.tensor_parallel, None
        if tp is not None:
            close_ranks(tp, self._workers)

    # -- requests in (admission.py) -------------------------------------------------------------------

    def add_request(self, prompt: list[int] | str, params: SamplingParams | Any | None = None,
                    request_id: str | None = None) -> list[str]:
        """Queue a prompt; returns the ids of its requests (one, or `n` for `params.n > 1`).
        Bad input raises `ValueError` naming the field, here and never inside the step loop."""
        requests = self.make_requests(prompt, params, request_id)
        for request in requests:
            self.enqueue(request)
        return [r.request_id for r in requests]

    def make_requests(self, prompt: list[int] | str, params: SamplingParams | Any | None = None,
                      request_id: str | None = None, mm: Any = None) -> list[Request]:
        """Validate a prompt and build its requests without queueing them. Reads only immutable engine
        state, so other threads may call it while the engine steps. `mm`: the prompt's images, from
        `render_multimodal`."""
        if self.failure is not None:
            raise EngineFailedError(self.failure)
        # no params: the model's own recommended sampling (its generation_config), as the server's defaults
        params = SamplingParams(**self.sampling_defaults) if params is None else admission.as_sampling_params(params)
        prompt_ids = admission.encode_prompt(self.tokenizer, prompt)
        self._validate(prompt_ids, params)
        if mm is not None and self.vision is None:
            raise ValueError(f"the model {self.model_name} does not take images")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        children = admission.fan_out(request_id, params)
        for child_id, _ in children:
            if child_id in self.requests:
                raise ValueError(f"request_id {child_id!r} is already in use")
        return [self.attach(Request(child_id, prompt_ids, child_params, self.eos_token_ids, mm=mm))
                for child_id, child_params in children]

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        admission.validate(prompt_ids, params, self.vocab_size, self._capacity(), self.tokenizer is not None)

    def sampling_params(self, num_prompt_tokens: int, **kwargs: Any) -> SamplingParams:
        """SamplingParams for a prompt of `num_prompt_tokens`: fields left out (or None) take the model's
        generation_config defaults; a max_tokens still unset is what is left of the context and of the KV
        cache. Raises ValueError naming a bad field; ContextLengthError (a ValueError naming "prompt") for a
        prompt that leaves no room to generate, whatever max_tokens says."""
        return admission.fill_params(num_prompt_tokens, kwargs, self.sampling_defaults, self.vocab_size,
                                     self._capacity())

    def _capacity(self) -> int:
        """The tokens a sequence may hold: the context, or the whole KV cache where that is smaller."""
        return min(self.max_model_len, self.block_pool.num_blocks * self.block_pool.block_size)

    def attach(self, request: Request) -> Request:
        """Give `request` what this engine makes for it from its params: the grammar's matcher (compiled once,
        here, off the step loop) and the detokenizer. A request made by another process's engine (a replica's
        front-end) comes without them."""
        params = request.params
        if params.grammar is not None and request.matcher is None:
            request.matcher = self.structured.matcher(params.grammar)
        if self.tokenizer is not None and request.detokenizer is None:
            request.detokenizer = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
                min_tokens=params.min_tokens)
        return request

    def enqueue(self, request: Request) -> None:
        """Hand a request made by `make_requests` to the scheduler."""
        if self.failure is not None:
            raise EngineFailedError(self.failure)
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request now and free its blocks. Unknown or finished ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        return make_output(request, [], "", final=True)

    def fail(self, request: Request, message: str) -> RequestOutput:
        """Finish a request with an error (queued or not) and free its blocks."""
        request.error = message
        if self.requests.pop(request.request_id, None) is request:
            self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
        else:
            request.status = RequestStatus.FINISHED_ERROR
        return make_output(request, [], "", final=True)

    @property
    def has_unfinished(self) -> bool:
        """Whether any request is queued or running."""
        return self.scheduler.has_unfinished

    # -- the step -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass and process its samples. Returns an output for each request that
        produced tokens, finished or failed in this step."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        self.num_steps += 1
        now = time.perf_counter()
        for request in plan.requests:
            if request.scheduled_time is None:
                request.scheduled_time = now
        try:
            sampled, samples, verified = self.runner.execute(plan)
        except EngineFailedError as exc:  # no step can run again: everything fails now, nothing more is taken
            self.failure = self._failure(exc)
            logger.error("the engine failed: %s", self.failure)
            return [self.fail(r, self.failure) for r in list(self.requests.values())]
        except Exception:  # isolate the failing request(s); the others keep going
            logger.exception("step failed; retrying its requests one by one")
            return self._step_one_by_one(plan)
        return self._finish_step(plan, sampled, samples, verified)

    def _finish_step(self, plan: SchedulerOutput, sampled, samples, verified) -> list[RequestOutput]:
        """Commit a step that ran: the proposals each request keeps, its computed tokens, its outputs."""
        self.block_pool.commit()
        kept = {}
        for request, choices in verified:
            tokens = accepted(request.spec_token_ids, choices)
            kept[request.request_id] = tokens
            self.num_draft_tokens += len(request.spec_token_ids)
            self.num_accepted_tokens += len(tokens) - 1
        self.scheduler.advance(plan, {r.request_id: len(r.spec_token_ids) + 1 - len(kept[r.request_id])
                                      for r, _ in verified})
        new_tokens = [(r, [samples.token_ids[i]], samples.logprobs[i] if samples.logprobs is not None else None)
                      for i, r in enumerate(sampled)]
        new_tokens += [(r, kept[r.request_id], None) for r, _ in verified]
        return self._postprocess(new_tokens)

    def _step_one_by_one(self, plan: SchedulerOutput) -> list[RequestOutput]:
        # Blocks cached for the failed step may hold no KV: forget them, and recompute from scratch any
        # request that shared one of them in this very step (the others rewrite their own blocks below).
        unwritten = self.block_pool.uncache_uncommitted()
        size = self.block_pool.block_size
        outputs = []
        for request, num_new in zip(plan.requests, plan.num_new_tokens):
            if any(b in unwritten for b in request.block_ids[: request.num_computed_tokens // size]):
                self.scheduler.requeue(request)
                continue
            single = SchedulerOutput([request], [num_new], int(num_new == 1), [], num_new)
            try:
                sampled, samples, verified = self.runner.execute(single)
            except Exception as exc:
                logger.exception("request %s failed", request.request_id)
                outputs.append(self.fail(request, f"{type(exc).__name__}: {exc}"))
                continue
            outputs.extend(self._finish_step(single, sampled, samples, verified))
        return outputs

    def _postprocess(self, new_tokens: list[tuple[Request, list[int], dict | None]]) -> list[RequestOutput]:
        """Each request's new tokens (one, or several from speculative decoding; a logprob for a sampled one),
        appended one at a time until one of them finishes it; finished requests leave and free their blocks."""
        outputs = []
        now = time.perf_counter()
        for request, token_ids, logprob in new_tokens:
            if request.first_token_time is None:
                request.first_token_time = now
            if logprob is not None:
                request.logprobs.append(logprob)
            taken, delta, status = take_tokens(request, token_ids, self.max_model_len)
            if status is not None:
                self.requests.pop(request.request_id, None)
                self.scheduler.finish(request, status)
                request.finish_time = now
            outputs.append(make_output(request, taken, delta, final=status is not None,
                                       delta_logprobs=logprobs_to_send(request, status is not None)))
        return outputs

    def dead_ranks(self, wait_s: float = 1.0) -> list[str]:
        """The tensor-parallel worker ranks this process started whose process has exited ("rank N (how)")."""
        return self._workers.dead(wait_s) if self._workers is not None else []

    def _failure(self, exc: Exception) -> str:
        dead = self.dead_ranks()
        if dead:
            return f"tensor-parallel {', '.join(dead)} failed; the engine stopped"
        return str(exc)

    # -- offline batch (offline.py) --------------------------------------------------------------------

    def generate_batch(self, inputs: Iterable[list[int] | str], params: SamplingParams | Any | None = None,
                       progress: bool = False) -> dict[str, RequestOutput]:
        """Generate for every input (a prompt alone, a string or a list of token ids, is one input); returns
        request id -> final output, in input order. Every input is validated before any is queued."""
        return generate_batch(self, inputs, params, progress)

    # -- what the layers above read (client.py's EngineClient) ------------------------------------------

    @property
    def input_modalities(self) -> list[str]:
        """What a prompt may hold: text, and images for a vision-language model."""
        return ["text", "image"] if self.vision is not None else ["text"]

    def render_multimodal(self, messages: list[dict], images: list[Any], tools: list | None = None,
                          template_kwargs: dict[str, Any] | None = None, **options: Any) -> tuple[list[int], Any]:
        """A conversation with images (`{"type": "image"}` content parts, `images` in their order) -> the prompt
        ids with each image's tokens expanded, and the `MultiModalInput` to pass to `make_requests(mm=...)`.
        ValueError for a model without a vision side, or images that do not fit it."""
        if self.vision is None:
            raise ValueError(f"the model {self.model_name} does not take images")
        return self.vision.render(messages, images, tools, template_kwargs, **options)

    @property
    def model_type(self) -> str:
        """The model's architecture family as transformers names it (`config.model_type`: "llama", "qwen2")."""
        return getattr(getattr(self.model, "config", None), "model_type", "") or ""

    @property
    def num_parameters(self) -> int:
        """The model's parameter count (0 where its module does not hold them)."""
        try:
            return sum(p.numel() for p in self.model.parameters())
        except Exception:  # a backend without the module's parameters at hand: not known
            return 0

    def grammar_compiled(self, grammar: Grammar) -> bool:
        """Whether `grammar` is compiled already (`compile_grammar` of it returns at once)."""
        return self.structured.is_compiled(grammar)

    @property
    def grammars_ready(self) -> bool:
        """Whether the grammar compiler's view of the tokenizer is built (`prepare_grammars`)."""
        return self.structured.has_ll_tokenizer

    def prepare_grammars(self) -> None:
        """Build the grammar compiler's view of the tokenizer (~0.5 s, once). Thread-safe; GrammarError where
        the model's tokenizer cannot constrain output."""
        self.structured.ll_tokenizer  # noqa: B018 - built on first read

    def compile_grammar(self, grammar: Grammar) -> None:
        """Compile `grammar` into the engine's cache, off the step loop (thread-safe): a request that uses it
        later gets its matcher at once. GrammarError (a ValueError) saying why it does not compile."""
        self.structured.compile(grammar)

    @property
    def num_running(self) -> int:
        """Sequences in the running batch."""
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Sequences queued, not yet scheduled."""
        return len(self.scheduler.waiting)

    @property
    def spec_acceptance_rate(self) -> float:
        """Speculative decoding: the share of proposed tokens the model agreed with (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of queried prompt tokens found in the prefix cache."""
        return self.block_pool.stats.hit_rate

    def stats(self) -> EngineStats:
        """The engine's counters now. Safe to call beside the engine thread (it reads lengths and counters)."""
        pool, graphs = self.block_pool, self.runner.graphs
        return EngineStats(
            num_running=self.num_running, num_waiting=self.num_waiting,
            kv_cache_blocks_used=pool.num_used_blocks, kv_cache_blocks_total=pool.num_blocks,
            prefix_cache_hit_rate=pool.stats.hit_rate, prefix_cache_queried_tokens=pool.stats.num_queried_tokens,
            prefix_cache_hit_tokens=pool.stats.num_hit_tokens, num_preemptions=self.scheduler.num_preemptions,
            num_draft_tokens=self.num_draft_tokens, num_accepted_tokens=self.num_accepted_tokens,
            cuda_graphs_captured=graphs.num_captured if graphs is not None else 0,
            cuda_graph_replays=graphs.num_replays if graphs is not None else 0, num_steps=self.num_steps)


def _draft_places(request: Request, k: int) -> list[int]:
    """k places for a draft model's proposals, which the runner fills before the step (engine/draft.py)."""
    return [0] * k
