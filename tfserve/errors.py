"""Exceptions that carry a message meant for a person: the CLI prints them as one line, the server as an
OpenAI error body."""


class TfserveError(Exception):
    """An error whose message is fit to show a user as it is."""

    exit_code = 1  # the command line's, where it ends a command


class UsageError(TfserveError):
    """A command line's option values that cannot go together or mean nothing: exit code 2, as Click's own."""

    exit_code = 2


class ModelNotFoundError(TfserveError):
    """A model name or path that the store, the disk and the local HF cache do not have."""


class ModelStoreError(TfserveError):
    """Pulling, converting or removing a model in the store failed."""


class DeviceError(TfserveError):
    """A device, dtype or quantization that this machine cannot run."""


class ModelLoadError(TfserveError):
    """A model that was found but that transformers could not load (bad files, unsupported architecture)."""


class EngineFailedError(TfserveError):
    """The engine cannot run another step (a tensor-parallel rank died): what runs fails, nothing more is taken."""


def first_line(exc: BaseException) -> str:
    """An exception as one line of text (its first line, or its type when it has no message)."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def one_line(exc: BaseException) -> str:
    """An exception's whole message on one line: its lines joined with spaces (a message whose first line is
    "... from one of:" says its point in the lines after it), or its type when it has no message."""
    text = str(exc).strip() or type(exc).__name__
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


class _Names(dict):
    """Field names for a message template: a field the caller does not rename keeps its own name."""

    def __missing__(self, key: str) -> str:
        return key


class ParamError(TfserveError, ValueError):
    """A request field whose value cannot run. `param` names it as the engine knows it (`max_tokens`,
    `logit_bias.50256`); `template` is the message with each field it mentions written `{field}` (literal braces
    doubled), so the server can show them as the client sent them (`max_completion_tokens`) without rewriting
    text: `message(names)`, `param_for(names)`. The server answers 400 with `code`."""

    code: str | None = None

    def __init__(self, param: str, template: str, *, code: str | None = None) -> None:
        self.param, self.template = param, template
        if code is not None:
            self.code = code
        super().__init__(self.message())

    def message(self, names: dict[str, str] | None = None) -> str:
        """The message, each field named as `names` maps it (engine field -> the client's)."""
        return self.template.format_map(_Names(names or {}))

    def param_for(self, names: dict[str, str] | None = None) -> str:
        """`param` as the client sent it: a renamed field, or a renamed field's entry (`logit_bias.7`)."""
        head, dot, rest = self.param.partition(".")
        return (names or {}).get(head, head) + dot + rest

    def __reduce__(self):  # pickled whole (a replica's process sends it back), whatever the subclass's signature
        return _rebuild, (type(self), self.param, self.template, self.code)


def _rebuild(cls: type[ParamError], param: str, template: str, code: str | None) -> ParamError:
    error = cls.__new__(cls)
    ParamError.__init__(error, param, template, code=code)
    return error


class ContextLengthError(ParamError):
    """A prompt that leaves no room to generate in the model's context or the KV cache, or a max_tokens past it.
    `param` names the input to shorten ("prompt", "max_tokens"); the server answers 400 `context_length_exceeded`."""

    code = "context_length_exceeded"

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(param, message)


class GrammarFailed(TfserveError):
    """A request's output grammar failed while it generated (the grammar engine rejected a token its own mask
    allowed, or a mask took too long): the request ends with this as its error; the server answers 400
    `invalid_grammar`."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)  # the one argument: pickled and rebuilt as it is
        self.detail = detail

    def __str__(self) -> str:
        return f"the output grammar failed: {self.detail}"


class ChatTemplateError(TfserveError, ValueError):
    """The model has no chat template, or its template rejected the messages."""
