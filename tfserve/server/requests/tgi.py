"""Text Generation Inference's request body, typed: `{"inputs", "parameters", "stream"}`. TGI validates strictly:
an unknown field or parameter is an error (a 422 on the wire, `errors.error_for`), and so is a parameter that
would change the output and is not honoured here."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, PrivateAttr, model_validator

from tfserve.sampling_params import RANGES, Range
from tfserve.server.errors import bad_request
from tfserve.server.protocol import json_type
from tfserve.server.requests.base import RequestModel
from tfserve.server.requests.sampling import SamplingFields
from tfserve.server.tools.response_format import requested_grammar

DEFAULT_MAX_NEW_TOKENS = 100  # huggingface_hub's documented default, where a request sends none
# parameters that would change the output, accepted at these values only (what TGI does when they are absent)
_UNHONOURED = {"typical_p": (None, 1.0), "watermark": (None, False), "adapter_id": (None, ""), "best_of": (None, 1)}
_HONOURED = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "repetition_penalty",
             "frequency_penalty", "do_sample", "details", "decoder_input_details", "return_full_text", "grammar",
             "top_n_tokens", "truncate")
_TRUNCATE = Range(1, integer=True)


class TgiParameters(SamplingFields):
    """TGI's `parameters`: its sampling fields (with the ranges of the one table), `details`, `grammar`, ..."""

    MAX_TOKENS_FIELDS: ClassVar[tuple[str, ...]] = ("max_new_tokens",)
    DEFAULT_MAX_TOKENS: ClassVar[int | None] = DEFAULT_MAX_NEW_TOKENS

    max_new_tokens: int | None = None
    do_sample: bool | None = None
    details: bool | None = None
    decoder_input_details: bool | None = None
    return_full_text: bool | None = None
    grammar: Any = None
    top_n_tokens: int | None = None
    truncate: int | None = None

    _constraint: Any = PrivateAttr(None)

    @model_validator(mode="before")
    @classmethod
    def _known(cls, parameters: Any) -> Any:
        for name, value in parameters.items() if isinstance(parameters, dict) else ():
            if name in _UNHONOURED:
                if not any(_same(value, allowed) for allowed in _UNHONOURED[name]):
                    raise bad_request(f"parameters.{name} is not supported by this server", f"parameters.{name}")
            elif name not in _HONOURED:
                raise bad_request(f"parameters.{name} is not a parameter this server takes", f"parameters.{name}")
        return {k: v for k, v in parameters.items() if k not in _UNHONOURED} if isinstance(parameters, dict) \
            else parameters

    @classmethod
    def _range(cls, name: str, table: str) -> Range:
        return {"top_n_tokens": RANGES["logprobs"], "truncate": _TRUNCATE}.get(name) or RANGES[table]

    @model_validator(mode="after")
    def _grammar(self) -> TgiParameters:
        self._constraint = requested_grammar({"parameters.grammar": self.grammar}, "parameters.grammar")
        return self

    @property
    def constraint(self) -> Any:
        """`grammar` as a Grammar and its field, or None."""
        return self._constraint

    def to_sampling_kwargs(self) -> dict[str, Any]:
        kwargs = super().to_sampling_kwargs()
        # TGI samples when do_sample is set or a warper is (temperature other than 1, top_k, top_p); else greedy
        warped = kwargs.get("temperature", 1.0) != 1.0 or "top_k" in kwargs or "top_p" in kwargs
        if not self.do_sample and not warped:
            kwargs["temperature"] = 0.0
        kwargs["logprobs"] = self.top_n_tokens or 0  # every token event carries its logprob
        if self.decoder_input_details:
            kwargs["prompt_logprobs"] = 0
        return kwargs


class TgiRequest(RequestModel):
    """A TGI generate request: `inputs`, its `parameters`, `stream` (POST / only)."""

    inputs: Any = Field(None, validate_default=True)
    parameters: TgiParameters = Field(default_factory=TgiParameters)
    stream: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _known(cls, body: Any) -> Any:
        unknown = sorted(set(body) - {"inputs", "parameters", "stream"}) if isinstance(body, dict) else []
        if unknown:
            raise bad_request(f"unknown field {unknown[0]!r}: send inputs, parameters and stream", unknown[0])
        return {k: v for k, v in body.items() if v is not None} if isinstance(body, dict) else body

    @model_validator(mode="after")
    def _inputs(self) -> TgiRequest:
        if self.inputs is None:
            raise bad_request("inputs is required", "inputs")
        if not isinstance(self.inputs, str):
            raise bad_request(f"inputs must be a string, not {json_type(self.inputs)}", "inputs")
        return self

    @property
    def names(self) -> dict[str, str]:
        """The engine's words -> TGI's fields, for the engine's errors."""
        return {"max_tokens": "parameters.max_new_tokens", "prompt": "inputs"}


def _same(value: Any, allowed: Any) -> bool:
    """JSON equality: a boolean is no number (True is not 1)."""
    return value is allowed or (isinstance(value, bool) == isinstance(allowed, bool) and value == allowed)
