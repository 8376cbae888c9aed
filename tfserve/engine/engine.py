"""The engine: `schedule() -> execute() -> postprocess()`, one step at a time, and `generate_batch`."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import numbers
import time
from typing import Any, Iterable

from tfserve.config import EngineConfig
from tfserve.engine.cpu_linear import matmul_units
from tfserve.engine.detokenizer import IncrementalDetokenizer
from tfserve.engine.draft import DraftModel
from tfserve.engine.kv_cache import BlockPool
from tfserve.engine.multimodal import VisionLanguage
from tfserve.engine.request import Request, RequestMetrics, RequestOutput, RequestStatus
from tfserve.engine.runner import ModelRunner
from tfserve.engine.scheduler import Scheduler, SchedulerOutput
from tfserve.engine.spec_decode import accepted
from tfserve.engine.structured import GRAMMAR_FAILED, StructuredOutputs, grammar_error_line
from tfserve.engine.threads import run_in_fresh_thread
from tfserve.errors import ContextLengthError, DeviceError, EngineFailedError
from tfserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class Engine:
    """Continuous batching over a transformers causal LM: paged KV cache, prefix caching, chunked prefill,
    preemption, vectorised sampling. Not thread-safe: use `BatchingManager` (or `AsyncEngine`) to share it."""

    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None, *, processor: Any = None,
                 tensor_parallel: Any = None, draft_model: Any = None, draft_gguf_file: str | None = None,
                 **overrides: Any) -> None:
        """`config` (default: EngineConfig()) with any of its fields overridden by keyword, e.g.
        `Engine(model, tokenizer, max_num_seqs=8)`; a bad value raises ValueError naming the field. A
        vision-language model comes with its `processor` (images in prompts: `render_multimodal`). With
        `speculative="draft"`, `draft_model` (of the same tokenizer) proposes the greedy decodes' tokens."""
        self.config = config = _with_overrides(config, overrides)
        self.model = model
        self.tokenizer = tokenizer
        self.processor = processor
        self.tensor_parallel = tensor_parallel  # rank 0's TensorParallel when the model is split (from_pretrained)
        self._workers: Any = None  # the worker ranks this process started
        self.failure: str | None = None  # why the engine cannot step any more (a dead rank), once it cannot
        self.runner = ModelRunner(model, config, tensor_parallel)
        self.vision = VisionLanguage(model, processor) if processor is not None else None
        self.runner.vision = self.vision
        self.runner.warm_up()
        if self.vision is not None and self.vision.bidirectional and self.runner.flash_attention:
            raise ValueError("attn_implementation flash_attention_2 cannot attend an image's tokens both ways "
                             f"({type(model).__name__}); leave it unset for tfserve's paged attention")
        text_config = model.config.get_text_config()
        self.vocab_size = text_config.vocab_size
        propose = None
        if config.speculative == "draft":
            if draft_model is None:
                raise ValueError("speculative draft needs a draft model (speculative_model, or draft_model=)")
            if self.vision is not None:  # (tensor parallelism: EngineConfig refuses it)
                raise ValueError("a draft model proposes for text models only, not with images")
            self.runner.draft = DraftModel(draft_model, config, self.runner.num_blocks, self.vocab_size,
                                           draft_gguf_file)
            propose = _draft_places
        self.block_pool = BlockPool(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_pool, config.max_batch_tokens, config.max_num_seqs,
                                   config.num_speculative_tokens if config.speculative else 0,
                                   config.long_prefill_token_threshold, propose)
        self.num_draft_tokens = 0  # speculative decoding: proposals checked, and accepted
        self.num_accepted_tokens = 0
        self.max_model_len = self.runner.max_model_len
        self.eos_token_ids = _eos_token_ids(model, tokenizer)
        self.structured = StructuredOutputs(tokenizer, self.vocab_size, self.eos_token_ids)
        # what a request that leaves a sampling field out gets (as vLLM's --generation-config auto)
        self.sampling_defaults = sampling_defaults(model) if config.generation_config == "auto" else {}
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

    @classmethod
    def from_pretrained(cls, model: str | None = None, config: EngineConfig | None = None, *, dtype: str = "auto",
                        device: str = "auto", quantization: str = "none", attn_implementation: str | None = None,
                        trust_remote_code: bool = False, progress=None, **overrides: Any) -> Engine:
        """Load a model through the store's loader (store name, HF directory, .gguf file or cached hub id; the
        default model is pulled when missing) and build the engine over it. `progress(step, ...)` is told each
        stage: pull, load, the CPU kernels' first build, the KV cache."""
        return run_in_fresh_thread(cls._from_pretrained, model, config, dtype=dtype, device=device,
                                   quantization=quantization, attn_implementation=attn_implementation,
                                   trust_remote_code=trust_remote_code, progress=progress, **overrides)

    @classmethod
    def _from_pretrained(cls, model: str | None = None, config: EngineConfig | None = None, *, dtype: str = "auto",
                         device: str = "auto", quantization: str = "none", attn_implementation: str | None = None,
                         trust_remote_code: bool = False, progress=None, **overrides: Any) -> Engine:
        """`from_pretrained` on the caller's thread (the torch work of loading makes that thread's OpenMP pool:
        `tfserve.engine.threads`)."""
        from tfserve.engine import kernels
        from tfserve.models.loading import DEFAULT_MODEL, load_model, resolve_device
        from tfserve.engine.backends.lean import SUPPORTED
        from tfserve.models.gguf_weights import gguf_source, is_native
        from tfserve.models.pull import no_progress

        config = _with_overrides(config, overrides)  # checked before a long load
        dtype, quantization = str(getattr(dtype, "value", dtype)), str(getattr(quantization, "value", quantization))
        config, load_kwargs = _load_plan(config, dtype, device, quantization, attn_implementation, trust_remote_code)
        report = progress or no_progress
        if config.tensor_parallel_size > 1:
            if resolve_device(device) != "cpu":
                raise DeviceError("tensor parallelism runs CPU ranks for now (CUDA ranks, on NCCL, are not built "
                                  "yet); use --device cpu, or one GPU without --tensor-parallel-size")
            if config.cpu_kernels:  # built once, before the worker ranks load them
                kernels.build_with_progress(report)
            return _tensor_parallel(cls, _worker_spec(model or DEFAULT_MODEL, config, load_kwargs), progress)
        if config.cpu_kernels and resolve_device(device) == "cpu":
            kernels.start_building()  # a first run compiles while the model is pulled and loaded
        # a .gguf file the lean forward runs loads natively: no weight expanded, the kernels multiply its blocks
        native = frozenset(SUPPORTED) if (config.cpu_kernels and config.forward_backend != "hf"
                                          and config.weights in ("auto", "gguf")) else frozenset()
        start = time.perf_counter()
        loaded = load_model(model or DEFAULT_MODEL, progress=progress, gguf_native=native, **load_kwargs)
        if config.cpu_kernels and loaded.device == "cpu":
            kernels.build_with_progress(report)
        if is_native(loaded.model) and kernels.cpu_ops() is None:  # no compiler here: transformers expands it
            loaded = load_model(model or DEFAULT_MODEL, progress=progress, **load_kwargs)
        _use_chat_template(loaded, config)
        gguf_file = gguf_source(loaded.path) if loaded.device == "cpu" and dtype == "auto" else None
        if gguf_file is not None and config.weights in ("auto", "gguf") and not config.gguf_file:
            config = dataclasses.replace(config, gguf_file=str(gguf_file))
        draft, draft_gguf = None, None
        if config.speculative == "draft" and config.speculative_model is not None:  # (without: Engine says so)
            # as its own files say, whatever --dtype the served model has: a GGUF draft runs its blocks
            _, draft_kwargs = _load_plan(config, "auto", device, quantization, attn_implementation, trust_remote_code)
            draft = load_model(config.speculative_model, progress=progress, **draft_kwargs)
            _check_draft_tokenizer(loaded, draft)
            draft_gguf = gguf_source(draft.path) if draft.device == "cpu" and config.cpu_kernels else None
        report("Allocating the KV cache" + (" (and compiling, where the model's own forward runs)"
                                            if config.compile else ""))
        engine = cls(loaded.model, loaded.tokenizer, config, processor=loaded.processor,
                     draft_model=draft.model if draft else None,
                     draft_gguf_file=str(draft_gguf) if draft_gguf is not None else None)
        engine.model_name, engine.model_path = loaded.name, str(loaded.path)
        engine.device, engine.dtype, engine.quantization = loaded.device, loaded.dtype, loaded.quantization
        formats = getattr(engine.runner.forward, "weight_formats", {})
        if set(formats) - {"float32"}:  # the CPU kernels hold the weights: say how (compute stays float32)
            engine.quantization = "/".join(sorted(formats))
        engine.matmul_units = matmul_units(formats, getattr(engine.runner.forward, "ops", None))
        for unit in dict.fromkeys(engine.matmul_units.values()):
            formats = "/".join(sorted(f for f, u in engine.matmul_units.items() if u == unit))
            logger.info("%s weights multiply through %s", formats, unit)
        engine.load_seconds = time.perf_counter() - start
        logger.info("%s ready in %.1f s (%s)", loaded.name, engine.load_seconds,
                    "its GGUF blocks as stored" if is_native(loaded.model) else f"weights {engine.quantization}")
        return engine

    def close(self) -> None:
        """Stop the worker ranks of a tensor-parallel engine (a no-op otherwise); the engine cannot step after."""
        tp, self.tensor_parallel = self.tensor_parallel, None
        if tp is None:
            return
        from tfserve.distributed import tensor_parallel

        try:
            tensor_parallel.send_step(None, tp)
        except tensor_parallel.TensorParallelError:
            pass  # a worker already died: it has nothing to stop
        if self._workers is not None:
            self._workers.stop()
        import torch.distributed

        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    # -- requests -----------------------------------------------------------------------------------

    def add_request(self, prompt: list[int] | str, params: SamplingParams | Any | None = None,
                    request_id: str | None = None) -> list[str]:
        """Queue a prompt; returns the ids of its requests (one, or `n` for `params.n > 1`).
        Bad input raises `ValueError` naming the field, here and never inside the step loop."""
        requests = self.make_requests(prompt, params, request_id)
        for request in requests:
            self.enqueue(request)
        return [r.request_id for r in requests]

    @property
    def input_modalities(self) -> list[str]:
        return ["text", "image"] if self.vision is not None else ["text"]

    def render_multimodal(self, messages: list[dict], images: list[Any], tools: list | None = None,
                          template_kwargs: dict[str, Any] | None = None, **options: Any) -> tuple[list[int], Any]:
        """A conversation with images (`{"type": "image"}` content parts, `images` in their order) -> the prompt
        ids with each image's tokens expanded, and the `MultiModalInput` to pass to `make_requests(mm=...)`.
        ValueError for a model without a vision side, or images that do not fit it."""
        if self.vision is None:
            raise ValueError(f"the model {self.model_name} does not take images")
        return self.vision.render(messages, images, tools, template_kwargs, **options)

    def make_requests(self, prompt: list[int] | str, params: SamplingParams | Any | None = None,
                      request_id: str | None = None, mm: Any = None) -> list[Request]:
        """Validate a prompt and build its requests without queueing them. Reads only immutable engine
        state, so other threads may call it while the engine steps. `mm`: the prompt's images, from
        `render_multimodal`."""
        if self.failure is not None:
            raise EngineFailedError(self.failure)
        # no params: the model's own recommended sampling (its generation_config), as the server's defaults
        params = SamplingParams(**self.sampling_defaults) if params is None else _as_sampling_params(params)
        prompt_ids = self._encode(prompt)
        self._validate(prompt_ids, params)
        if mm is not None and self.vision is None:
            raise ValueError(f"the model {self.model_name} does not take images")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if params.n == 1:
            children = [(request_id, params)]
        else:
            children = [(f"{request_id}-{i}", params.replace(n=1, seed=None if params.seed is None else params.seed + i))
                        for i in range(params.n)]
        for child_id, _ in children:
            if child_id in self.requests:
                raise ValueError(f"request_id {child_id!r} is already in use")
        requests = []
        for child_id, child_params in children:
            requests.append(self.attach(Request(child_id, prompt_ids, child_params, self.eos_token_ids, mm=mm)))
        return requests

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

    def sampling_params(self, num_prompt_tokens: int, **kwargs: Any) -> SamplingParams:
        """SamplingParams for a prompt of `num_prompt_tokens`: fields left out (or None) take the model's
        generation_config defaults; a max_tokens still unset is what is left of the context and of the KV
        cache. Raises ValueError naming a bad field; ContextLengthError (a ValueError naming "prompt") for a
        prompt that leaves no room to generate, whatever max_tokens says."""
        capacity = self._room_for(num_prompt_tokens)
        kwargs = {**self.sampling_defaults, **{k: v for k, v in kwargs.items() if v is not None}}
        if isinstance(kwargs.get("top_k"), int) and kwargs["top_k"] >= self.vocab_size:
            kwargs["top_k"] = 0  # keeps every token: the same as no top-k
        if kwargs.get("max_tokens") is None:
            kwargs["max_tokens"] = capacity - num_prompt_tokens
        return SamplingParams(**kwargs)

    def _room_for(self, num_prompt_tokens: int) -> int:
        """The tokens a sequence may hold (the context, or the whole KV cache if smaller); ContextLengthError for
        a prompt that leaves no room to generate."""
        capacity = min(self.max_model_len, self.block_pool.num_blocks * self.block_pool.block_size)
        if num_prompt_tokens >= capacity:
            # OpenAI's words, which client libraries (litellm, LangChain) match to tell a context overflow apart
            raise ContextLengthError(
                f"This model's maximum context length is {capacity} tokens (prompt and output together). However, "
                f"the prompt is {num_prompt_tokens} tokens, which leaves no room to generate: the prompt is too long")
        return capacity

    def enqueue(self, request: Request) -> None:
        """Hand a request made by `make_requests` to the scheduler."""
        if self.failure is not None:
            raise EngineFailedError(self.failure)
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def _encode(self, prompt: list[int] | str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is text but the engine has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if hasattr(prompt, "tolist") and getattr(prompt, "ndim", 1) == 1:  # a numpy array or torch tensor of ids
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)) or not all(_is_token_id(t) for t in prompt):
            raise ValueError("prompt must be a string or a list of token ids")
        return [int(t) for t in prompt]

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("prompt must not be empty")
        if any(t < 0 or t >= self.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {self.vocab_size})")
        capacity = self._room_for(len(prompt_ids))  # the context, or the whole KV cache where that is smaller
        num_tokens = len(prompt_ids) + params.max_tokens
        if num_tokens > capacity:
            raise ContextLengthError(
                f"This model's maximum context length is {capacity} tokens. However, you requested "
                f"{num_tokens} tokens ({len(prompt_ids)} in the prompt, {params.max_tokens} in max_tokens): "
                f"lower max_tokens or shorten the prompt", param="max_tokens")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; use stop_token_ids")
        outside = [t for t in params.logit_bias if t >= self.vocab_size]
        if outside:
            raise ValueError(f"logit_bias.{outside[0]}: token id {outside[0]} is outside the vocabulary "
                             f"[0, {self.vocab_size})")

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request now and free its blocks. Unknown or finished ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        return self._output(request, [], "", final=True)

    @property
    def has_unfinished(self) -> bool:
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

    def dead_ranks(self, wait_s: float = 1.0) -> list[str]:
        """The tensor-parallel worker ranks this process started whose process has exited ("rank N (how)")."""
        return self._workers.dead(wait_s) if self._workers is not None else []

    def _failure(self, exc: Exception) -> str:
        dead = self.dead_ranks()
        if dead:
            return f"tensor-parallel {', '.join(dead)} failed; the engine stopped"
        return str(exc)

    def fail(self, request: Request, message: str) -> RequestOutput:
        """Finish a request with an error (queued or not) and free its blocks."""
        request.error = message
        if self.requests.pop(request.request_id, None) is request:
            self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
        else:
            request.status = RequestStatus.FINISHED_ERROR
        return self._output(request, [], "", final=True)

    def _postprocess(self, new_tokens: list[tuple[Request, list[int], dict | None]]) -> list[RequestOutput]:
        """Each request's new tokens (one, or several from speculative decoding; a logprob for a sampled one),
        appended one at a time until one of them finishes it."""
        outputs = []
        now = time.perf_counter()
        for request, token_ids, logprob in new_tokens:
            if request.first_token_time is None:
                request.first_token_time = now
            if logprob is not None:
                request.logprobs.append(logprob)
            delta, status, taken = "", None, []
            detok = request.detokenizer
            if request.error is not None:  # its grammar's mask overran the step's budget (apply_grammars)
                logger.error("request %s: %s", request.request_id, request.error)
                status, token_ids = RequestStatus.FINISHED_ERROR, []
            for token_id in token_ids:
                request.token_ids.append(token_id)
                taken.append(token_id)
                if request.matcher is not None and not request.matcher.consume_token(token_id):
                    # the mask allowed only what the grammar accepts: the grammar engine failed (a bug, or a
                    # limit it met only now); the rest of the output could not be held to the grammar
                    error = grammar_error_line(request.matcher.get_error())  # (the whole of it quotes the grammar)
                    logger.error("request %s: grammar rejected token %d: %s", request.request_id, token_id, error)
                    request.error = f"{GRAMMAR_FAILED}: {error}"
                    status = RequestStatus.FINISHED_ERROR
                    break
                status = self._check_stop(request, token_id)
                if detok is not None:
                    # the EOS or stop token that ended it gives no text, unless asked for (as vLLM's)
                    hides_token = (status == RequestStatus.FINISHED_STOPPED and request.stop_reason is not None
                                   and not detok.include_stop_str_in_output)
                    text, stop_str = detok.step([] if hides_token else [token_id])
                    delta += text
                    if stop_str is not None:
                        status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
                        if (request.logprobs and not detok.include_stop_str_in_output
                                and len(request.logprobs) == len(detok.token_ids)):
                            # the text ends before the stop string: so do its tokens' logprobs (as OpenAI's)
                            del request.logprobs[detok.num_tokens_of_text():]
                    elif status is not None:
                        delta += detok.flush()
                if status is not None:
                    break
            if status is not None:
                self.requests.pop(request.request_id, None)
                self.scheduler.finish(request, status)
                request.finish_time = now
            outputs.append(self._output(request, taken, delta, final=status is not None,
                                        delta_logprobs=self._logprobs_to_send(request, status is not None)))
        return outputs

    @staticmethod
    def _logprobs_to_send(request: Request, final: bool) -> list | None:
        """The logprobs a stream sends with this output: those of the tokens whose text is out (all of them once
        the request ends), so a chunk's logprobs go with its text and a stop string's tokens never show."""
        if request.logprobs is None:
            return None
        detok = request.detokenizer
        if not final and detok is not None and detok.holds_text:
            return None
        sent, request.num_logprobs_sent = request.num_logprobs_sent, len(request.logprobs)
        return request.logprobs[sent:] or None

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.params
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if not params.ignore_eos and token_id in request.eos_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _output(self, request: Request, delta_tokens: list[int], delta_text: str, final: bool,
                delta_logprobs: list | None = None) -> RequestOutput:
        metrics = None
        if final:
            finish = request.finish_time or time.perf_counter()
            arrival = request.arrival_time
            metrics = RequestMetrics(
                arrival_time=arrival,
                queue_s=None if request.scheduled_time is None else request.scheduled_time - arrival,
                ttft_s=None if request.first_token_time is None else request.first_token_time - arrival,
                e2e_s=finish - arrival,
                num_cached_tokens=request.num_cached_tokens,
                num_preemptions=request.num_preemptions,
            )
        detok = request.detokenizer
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            generated_tokens=request.output_token_ids,
            text=detok.text if detok is not None else "",
            finish_reason=request.status.finish_reason if final else None,
            logprobs=request.logprobs,
            metrics=metrics,
            delta_text=delta_text,
            delta_tokens=delta_tokens,
            delta_logprobs=delta_logprobs,
            stop_reason=request.stop_reason,
            stop_token_shown=isinstance(request.stop_reason, int) and request.params.include_stop_str_in_output,
            error=request.error,
            prompt_logprobs=None if request.needs_prompt_logits else request.prompt_logprobs,
        )

    # -- offline batch ----------------------------------------------------------------------------------

    def generate_batch(self, inputs: Iterable[list[int] | str], params: SamplingParams | Any | None = None,
                       progress: bool = False) -> dict[str, RequestOutput]:
        """Generate for every input (a prompt alone, a string or a list of token ids, is one input); returns
        request id -> final output, in input order. Every input is validated before any is queued."""
        if isinstance(inputs, str) or (isinstance(inputs, (list, tuple)) and inputs and _is_token_id(inputs[0])) \
                or getattr(inputs, "ndim", None) == 1:  # one prompt (a 1-D array or tensor of ids too)
            inputs = [inputs]
        if not isinstance(inputs, Iterable) or isinstance(inputs, (dict, bytes)):
            raise ValueError(f"inputs must be a list of prompts (strings or lists of token ids), not "
                             f"{type(inputs).__name__}")
        requests = [request for prompt in inputs for request in self.make_requests(prompt, params)]
        for request in requests:
            self.enqueue(request)
        order = [request.request_id for request in requests]
        results: dict[str, RequestOutput] = {}
        pending = set(order)
        bar = _progress(len(order)) if progress else None
        try:
            while pending:
                for output in self.step():
                    if output.finished and output.request_id in pending:
                        results[output.request_id] = output
                        pending.discard(output.request_id)
                        if bar is not None:
                            bar.update(1)
        except BaseException:  # a step that raised, Ctrl-C: these requests go, the engine stays usable
            for request_id in pending:
                self.abort(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return {request_id: results[request_id] for request_id in order}

    # -- stats ------------------------------------------------------------------------------------------

    @property
    def spec_acceptance_rate(self) -> float:
        """Speculative decoding: the share of proposed tokens the model agreed with (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.block_pool.stats.hit_rate


def _is_token_id(value: Any) -> bool:
    """An integer token id: a Python or numpy integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _as_sampling_params(params: SamplingParams | Any | None) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params.replace()  # checked again: a caller may have changed a field since it was built
    if type(params).__name__ == "GenerationConfig":
        return SamplingParams.from_generation_config(params)
    raise ValueError(f"params must be a SamplingParams or a transformers GenerationConfig, not {type(params).__name__}")


# generation_config field -> SamplingParams field, for the defaults a model's authors recommend
_GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(model) -> dict[str, Any]:
    """The sampling fields the model's `generation_config` sets to other than transformers' defaults,
    as SamplingParams keyword arguments (empty when it sets none)."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return {}
    diff = config.to_diff_dict()
    defaults = {ours: diff[theirs] for theirs, ours in _GENERATION_DEFAULTS.items() if diff.get(theirs) is not None}
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as exc:  # a broken generation_config must not break every request
        logger.warning("ignoring the model's generation_config sampling defaults %s: %s", defaults, exc)
        return {}
    return defaults


def _eos_token_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    generation_config = getattr(model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is not None:
        ids.update([eos] if isinstance(eos, int) else eos)
    return frozenset(ids)


def _cpu_weights(config: EngineConfig, dtype: str, quantization: str, device: str) -> tuple[str, str, str]:
    """What to load and how the lean forward holds its weights, for a user's dtype and quantization: on CPU with
    the kernels, float16/bfloat16 and int8 are weight formats of the engine over a float32 model (16-bit or
    8-bit storage, float32 arithmetic); elsewhere they go to transformers as they are (bitsandbytes for
    int8 on CUDA). Returns (load dtype, load quantization, weights)."""
    from tfserve.models.loading import resolve_device

    on_cpu_kernels = config.cpu_kernels and config.forward_backend != "hf" and resolve_device(device) == "cpu"
    if quantization == "int8":
        if on_cpu_kernels:
            return "float32", "none", "int8"
        return dtype, "bnb-8bit", config.weights
    if dtype in ("float16", "bfloat16") and quantization == "none" and on_cpu_kernels and config.weights == "auto":
        return "float32", "none", dtype
    return dtype, quantization, config.weights


def _check_draft_tokenizer(loaded, draft) -> None:
    """A draft model must speak the served model's tokens: its proposals are token ids."""
    from tfserve.errors import ModelLoadError

    if loaded.tokenizer is None or draft.tokenizer is None:
        return
    if loaded.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise ModelLoadError(f"the draft model {draft.name} has another tokenizer than {loaded.name}: its "
                             "proposals would be other tokens; pick a draft of the same family")


def _draft_places(request: Request, k: int) -> list[int]:
    """k places for a draft model's proposals, which the runner fills before the step (engine/draft.py)."""
    return [0] * k


def _with_overrides(config: EngineConfig | None, overrides: dict[str, Any]) -> EngineConfig:
    """`config` (default: EngineConfig()) with some fields replaced, validated again."""
    config = config or EngineConfig()
    return dataclasses.replace(config, **overrides) if overrides else config


def _progress(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate_batch", unit="req")


def worker_spec(model: str | None, config: EngineConfig, *, dtype: str = "auto", device: str = "auto",
                quantization: str = "none", attn_implementation: str | None = None, trust_remote_code: bool = False):
    """What the worker ranks of `from_pretrained(model, config, ...)` load (tfserve.distributed.workers): for a
    node past the first, which starts only worker ranks."""
    from tfserve.models.loading import DEFAULT_MODEL

    config, load_kwargs = _load_plan(config, dtype, device, quantization, attn_implementation, trust_remote_code)
    return _worker_spec(model or DEFAULT_MODEL, config, load_kwargs)


def _use_chat_template(loaded, config: EngineConfig) -> None:
    """The caller's chat template over the model's own (a base model has none)."""
    if config.chat_template is not None:
        loaded.tokenizer.chat_template = config.chat_template


def _load_plan(config: EngineConfig, dtype: str, device: str, quantization: str, attn_implementation: str | None,
               trust_remote_code: bool) -> tuple[EngineConfig, dict[str, Any]]:
    """`config` with the weight format the user's dtype and quantization mean, and `load_model`'s keywords."""
    load_dtype, load_quantization, weights = _cpu_weights(config, dtype, quantization, device)
    load_kwargs = {"dtype": load_dtype, "device": device, "quantization": load_quantization,
                   "attn_implementation": attn_implementation, "trust_remote_code": trust_remote_code}
    return (dataclasses.replace(config, weights=weights) if weights != config.weights else config), load_kwargs


def _worker_spec(model: str, config: EngineConfig, load_kwargs: dict[str, Any]):
    from tfserve.distributed import workers

    init_method = config.distributed_init_method or workers.free_init_method()
    return workers.WorkerSpec(model, load_kwargs, config, config.tensor_parallel_size, init_method,
                              config.distributed_timeout_s)


def _tensor_parallel(cls, spec, progress) -> Engine:
    """An engine over `spec.model` split `spec.world_size` ways: this process is rank 0 and starts the ranks
    of its node (tfserve.distributed)."""
    import torch

    from tfserve.distributed import tensor_parallel, workers
    from tfserve.models.loading import load_model
    from tfserve.models.pull import no_progress

    world, init_method, config, model, load_kwargs = (spec.world_size, spec.init_method, spec.config, spec.model,
                                                      spec.load_kwargs)
    report = progress or no_progress
    local = workers.local_ranks(spec, node_rank=0)[1:]  # under torchrun: none, it started every rank
    if local:
        report(f"Starting {len(local)} tensor-parallel worker process(es)")
    started = workers.spawn_workers(spec, local)
    try:
        torch.set_num_threads(tensor_parallel.torch_threads(world, config.nnodes))
        tensor_parallel.init_process_group(0, world, init_method, config.distributed_timeout_s)
        loaded = load_model(model, progress=progress, **load_kwargs)
        _use_chat_template(loaded, config)
        from tfserve.models.gguf_weights import gguf_source

        if loaded.device == "cpu" and gguf_source(loaded.path) is not None:  # as one engine would have run it
            logger.warning("tensor parallelism splits %s's %s weights; the GGUF file's quantized blocks, which one "
                           "engine runs, are not split across ranks (about 4x the memory of Q4 blocks)",
                           loaded.name, loaded.dtype)
        tp = tensor_parallel.shard(loaded.model, 0, world)
        report("Allocating the KV cache")
        engine = cls(loaded.model, loaded.tokenizer, config, processor=loaded.processor, tensor_parallel=tp)
        tensor_parallel.send_step(engine.runner.num_blocks, tp)  # the workers size their slices alike
        tensor_parallel.connect_shared_memory(tp, engine.runner.cpu_ops, tensor_parallel.one_machine(config),
                                              config.distributed_timeout_s)
        tensor_parallel.keep_alive(tp, config.distributed_timeout_s)  # an idle server's ranks wait on
    except BaseException:
        started.stop(timeout=0)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        raise
    engine._workers = started
    engine.model_name, engine.model_path = loaded.name, str(loaded.path)
    engine.device, engine.dtype, engine.quantization = loaded.device, loaded.dtype, loaded.quantization
    return engine
