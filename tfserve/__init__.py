"""tfserve: serve, chat with and benchmark Hugging Face transformers models.

The public API is imported lazily so that `import tfserve` (and `tfserve --help`) stays instant:
torch and transformers load only when an engine is built.
"""

__version__ = "0.1.0"

__all__ = ["Engine", "SamplingParams", "Grammar", "RequestOutput", "__version__"]


def __getattr__(name: str):
    if name == "Engine":
        from tfserve.engine.engine import Engine

        return Engine
    if name == "SamplingParams":
        from tfserve.sampling_params import SamplingParams

        return SamplingParams
    if name == "Grammar":
        from tfserve.sampling_params import Grammar

        return Grammar
    if name == "RequestOutput":
        from tfserve.engine.request import RequestOutput

        return RequestOutput
    raise AttributeError(f"module 'tfserve' has no attribute {name!r}")
