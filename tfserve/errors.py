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


class ContextLengthError(TfserveError, ValueError):
    """A prompt that leaves no room to generate in the model's context or the KV cache. `param` names the
    input to shorten ("prompt"); the server answers 400 `context_length_exceeded`."""

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message)
        self.param = param


class ChatTemplateError(TfserveError, ValueError):
    """The model has no chat template, or its template rejected the messages."""
