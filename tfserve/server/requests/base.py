"""Request bodies -> typed requests, parsed once at the edge (pydantic, in the shape of OpenAI's own types):
types checked strictly (a number is never a boolean, `"5"` is no integer), ranges from the one table
(`tfserve.sampling_params.RANGES`: a sampling field's by SamplingParams itself, built from the request at parse
time, `SamplingFields._check_sampling`), and unknown fields ignored, as OpenAI ignores them, here in one place
(`RequestModel.model_config`). Every mistake is a 400 naming its field as the client sent it.

OpenAI semantics: a field sent as `null` means "use the default".
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from tfserve.errors import ParamError
from tfserve.sampling_params import RANGES, SamplingParams
from tfserve.server.errors import ApiError, bad_request
from tfserve.server.protocol import json_type

# pydantic's error type -> the JSON type it wanted, in the words of our other 400s
_WANTED = {"int_type": "an integer", "float_type": "a number", "bool_type": "a boolean", "string_type": "a string",
           "list_type": "an array", "dict_type": "an object", "model_type": "an object"}
# the aliases of max_tokens: SamplingParams checks the one a request sent, rendered under the name it was sent by
MAX_TOKENS_ALIASES = ("max_tokens", "max_completion_tokens", "max_output_tokens", "max_new_tokens")
_SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))


class SentAs(ValueError):
    """SamplingParams' ParamError about a request's fields, with the names the client sent them by (`max_tokens`
    -> `max_completion_tokens`). A model validator raises it, so pydantic places it at the model: a nested
    model's fields are named under their parent (`parameters.max_new_tokens`, `options.num_predict`)."""

    def __init__(self, error: ParamError, names: dict[str, str]) -> None:
        super().__init__(str(error))
        self.error, self.names = error, names

    def api_error(self, where: str) -> ApiError:
        """The 400, every field named as sent, under `where` (the nested model's place, or "")."""
        prefix = f"{where}." if where else ""
        names = {name: prefix + self.names.get(name, name) for name in (*_SAMPLING_FIELDS, *self.names)}
        return bad_request(self.error.message(names), self.error.param_for(names), self.error.code)


class RequestModel(BaseModel):
    """A request body's fields, typed. Subclasses declare fields as OpenAI's types do; `parse` turns every
    mistake into the 400 naming its field. Validators may raise ApiError (it passes through as it is) or
    ParamError (named as it says)."""

    model_config = ConfigDict(strict=True, extra="ignore", arbitrary_types_allowed=True)
    # fields SamplingParams checks under their own name (SamplingFields builds them): not checked here too
    ENGINE_CHECKED: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def parse(cls, body: dict[str, Any], where: str = "") -> Any:
        """The typed request of `body` (a JSON object, from `read_json`; or one inside another, at field `where`);
        ApiError 400 naming the first bad field."""
        try:
            return cls.model_validate(body)
        except ValidationError as exc:
            raise _api_error(exc, where) from None

    @field_validator("*", mode="before")
    @classmethod
    def _in_range(cls, value: Any, info: Any) -> Any:
        """A number of the field's kind checked against the one table (another kind is the type check's), where
        SamplingParams does not check it: a field of another name (`top_logprobs`, TGI's `top_n_tokens`) or the
        API's narrower top (`temperature` <= 2). The rest, max_tokens and its aliases first, SamplingParams checks
        (`SamplingFields._check_sampling`)."""
        name = info.field_name
        table = "max_tokens" if name in MAX_TOKENS_ALIASES else name
        if table in cls.ENGINE_CHECKED and RANGES[table].api_high is None:
            return value
        limits = RANGES.get(table)
        if limits is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
            if not limits.integer or isinstance(value, int):
                cls._range(name, table).check(name, value, api=True)
        return value

    @classmethod
    def _range(cls, name: str, table: str) -> Any:
        """The range `name` is held to (a subclass may widen one: /v1/completions takes max_tokens 0)."""
        return RANGES[table]


def _api_error(exc: ValidationError, where: str = "") -> ApiError:
    """The first of pydantic's errors as our 400: a ParamError's own words, else the field and what it wanted;
    each named by its place in the body (TGI's `parameters.stop`, Ollama's `options.repeat_penalty`)."""
    error = exc.errors(include_url=False)[0]
    cause = (error.get("ctx") or {}).get("error")
    param = where + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"])
    param = param.lstrip(".")
    if isinstance(cause, SentAs):
        return cause.api_error(param)
    if isinstance(cause, ParamError):
        names = {cause.param.partition(".")[0]: param} if param else {}
        return bad_request(cause.message(names), cause.param_for(names), cause.code)
    if error["type"] == "missing":
        return bad_request(f"{param} is required", param)
    wanted = _WANTED.get(error["type"])
    if wanted is not None:
        return bad_request(f"{param} must be {wanted}, not {json_type(error['input'])}", param)
    return bad_request(f"{param}: {error['msg']}", param)


