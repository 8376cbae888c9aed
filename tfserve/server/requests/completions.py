"""POST /v1/completions' body, typed: OpenAI's `CompletionCreateParams` (legacy `logprobs`, `echo`) and vLLM's
fields. The prompt itself is read by the handler, which has the tokenizer."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, model_validator

from tfserve.server.errors import bad_request
from tfserve.server.requests.sampling import SamplingRequest


class CompletionRequest(SamplingRequest):
    """A completion request. `prompt` as sent (text, token ids, or a list of either); `logprobs` the legacy top
    count; max_tokens 0 (`score_only`) scores the prompt without showing a token."""

    DEFAULT_MAX_TOKENS: ClassVar[int | None] = 16

    prompt: Any = Field(None, validate_default=True)
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _completion_checks(self) -> CompletionRequest:
        if self.prompt is None:
            raise bad_request("prompt is required", "prompt")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        return self

    @property
    def score_only(self) -> bool:
        """max_tokens 0: the prompt is read (and scored), one token generated to finish it, unseen."""
        return self.max_tokens == 0

    def to_sampling_kwargs(self) -> dict[str, Any]:
        kwargs = super().to_sampling_kwargs()
        # max_tokens 0 (OpenAI's minimum here) only reads the prompt: with echo and logprobs, it scores the prompt
        # (lm-eval-harness's loglikelihood); SamplingParams checks any other value
        if self.score_only:
            kwargs["max_tokens"] = 1
        if self.logprobs is not None:
            kwargs["logprobs"] = self.logprobs
        # the prompt's own logprobs come first in `logprobs` with echo; vLLM's field shows them on its own
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        if wanted:
            kwargs["prompt_logprobs"] = max(wanted)
        return kwargs
