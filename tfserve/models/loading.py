"""The one loader every command uses: `--model` spec -> (model, tokenizer) on the chosen device.

A spec is a store name, a local HF directory, a local `.gguf` file, or a hub id already in the local HF
cache, as `transformers serve` names them: `org/model@revision` for a branch, tag or commit other than main,
and `<repo-or-dir>:<file>.gguf` for a GGUF file in a hub repo or a local folder. tfserve never downloads from
the hub; the only network access is pulling the default model from the package index when it is missing.
torch and transformers are imported inside `load_model` only.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import struct
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tfserve.errors import DeviceError, ModelLoadError, ModelNotFoundError, first_line, one_line
from tfserve.models import store
from tfserve.models.convert import hf_progress_bars
from tfserve.models.gguf_native import alone
from tfserve.models.pull import pull
from tfserve.models.catalog import DEFAULT_MODEL, get_known, recommend_sampling

ModelKind = Literal["store", "hf_dir", "gguf", "hf_cache"]
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "bnb-4bit", "bnb-8bit")

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """Where a `--model` spec points."""

    kind: ModelKind
    path: Path  # the model directory, or the .gguf file for kind "gguf"
    name: str  # what to call the model in output and in the API (store name, hub id, or file/dir name)


@dataclass(slots=True)
class LoadedModel:
    """A model ready for inference, with its tokenizer."""

    model: Any  # transformers PreTrainedModel, in eval mode
    tokenizer: Any  # transformers tokenizer (with the chat template when the model has one)
    name: str
    path: Path
    device: str  # "cpu", "cuda:0", ...
    dtype: Any  # torch.dtype of the weights (compute dtype when quantized)
    quantization: str = "none"
    processor: Any = None  # a vision-language model's AutoProcessor (images in prompts); None for text models


def resolve_model(spec: str) -> ResolvedModel:
    """Find what `spec` names, without loading anything; raises ModelNotFoundError."""
    try:
        return _resolve(spec)
    except OSError as exc:  # a name the filesystem refuses (too long, ...) names no model either
        raise ModelNotFoundError(f"no such model or path: {spec[:60]!r}{'...' if len(spec) > 60 else ''} "
                                 f"({exc.strerror or first_line(exc)})") from None


def _resolve(spec: str) -> ResolvedModel:
    if not spec.strip():
        raise ModelNotFoundError("empty model name: give a store name, a model folder, a .gguf file or a hub id")
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(f"{path} is not a model (expected an HF model directory or a .gguf file)")
        return ResolvedModel("gguf", _gguf_path(path), path.stem)
    if store.is_store_name(spec) and store.model_path(spec).is_dir():
        path = store.model_path(spec)
        problem = store.load_problem(path)
        if problem is not None:
            if get_known(spec) is not None:  # what a pull made, a pull makes again
                raise ModelNotFoundError(f"store model {spec!r} cannot load ({problem}); run `tfserve models pull "
                                         f"{spec} --force`")
            raise ModelNotFoundError(f"store model {spec!r} cannot load ({problem} in {path}): not a model "
                                     f"`tfserve models pull` knows; remove it with `tfserve models rm {spec}`")
        return ResolvedModel("store", path, spec)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"no model in {path} (config.json missing)")
        return ResolvedModel("hf_dir", path.resolve(), path.resolve().name)
    base, gguf_file = split_model_id(spec)
    if gguf_file is not None:
        return _resolve_gguf(spec, base, gguf_file)
    if _looks_like_path(spec):
        raise ModelNotFoundError(f"no such file or directory: {spec}")
    repo_id, revision = split_revision(spec)
    cached = _hf_cache_snapshot(repo_id, revision)
    if cached is not None and (cached / "config.json").is_file():
        return ResolvedModel("hf_cache", cached, spec)
    if cached is not None:  # a GGUF repo (its files hold config and tokenizer), or only some files fetched
        ggufs = sorted(str(file.relative_to(cached)) for file in cached.rglob("*.gguf"))
        hint = (f"name one of its GGUF files, as transformers does: {spec}:{ggufs[0]}" if ggufs else
                f"fetch the rest (`{_hf_download(repo_id, revision)}`)")
        raise ModelNotFoundError(f"{spec!r} is in the local HF cache without a config.json; {hint}")
    if "/" in repo_id:
        raise ModelNotFoundError(
            f"{spec!r} is not in the local HF cache and tfserve does not download from the hub; "
            f"fetch it first (`{_hf_download(repo_id, revision)}`) or pass a local directory")
    raise ModelNotFoundError(store.not_found_message(spec))


def split_model_id(spec: str) -> tuple[str, str | None]:
    """`org/model:weights.gguf` -> ("org/model", "weights.gguf"); anything else -> (spec, None). As transformers
    serve's `split_model_id`: only a `.gguf` file after the last colon counts."""
    base, colon, gguf_file = spec.rpartition(":")
    return (base, gguf_file) if colon and base and gguf_file.endswith(".gguf") else (spec, None)


def split_revision(spec: str) -> tuple[str, str | None]:
    """`org/model@dev` -> ("org/model", "dev"); no `@` (or nothing after it) -> (spec, None). Callers ask only
    for what is not a local path, where an `@` is part of the name (`/tmp/ckpt@1000`)."""
    repo_id, _, revision = spec.partition("@")
    return repo_id, revision or None


def _resolve_gguf(spec: str, base: str, gguf_file: str) -> ResolvedModel:
    """`<dir>:<file>.gguf` -> that file in a local folder (a store model's too: its model.gguf);
    `<repo>[@rev]:<file>.gguf` -> the file in the repo's snapshot in the local HF cache (a GGUF repo has no
    config.json: the file holds config and tokenizer)."""
    # a store name, as everywhere, before a folder of that name here
    folders = [*([store.model_path(base)] if store.is_store_name(base) else []), Path(base).expanduser()]
    folder = next((candidate for candidate in folders if candidate.is_dir()), None)
    if folder is not None:
        path = folder / gguf_file
        if not path.is_file():
            raise ModelNotFoundError(f"no {gguf_file} in {folder}")
        # a store model's file goes by the name it was asked by (a request's `model` is answered with it)
        in_store = store.is_store_name(base) and folder == store.model_path(base)
        return ResolvedModel("gguf", _gguf_path(path), spec if in_store else path.stem)
    if Path(base).expanduser().exists():
        raise ModelNotFoundError(f"{base} is not a directory (in {spec}: DIR:FILE.gguf names FILE.gguf in DIR)")
    if _looks_like_path(base):
        raise ModelNotFoundError(f"no such directory: {base} (in {spec})")
    repo_id, revision = split_revision(base)
    snapshot = _hf_cache_snapshot(repo_id, revision)
    if snapshot is not None and (snapshot / gguf_file).is_file():
        return ResolvedModel("gguf", _gguf_path(snapshot / gguf_file), spec)
    where = f"{base!r} in the local HF cache has no {gguf_file}" if snapshot is not None else \
        f"{base!r} is not in the local HF cache"
    raise ModelNotFoundError(f"{where} and tfserve does not download from the hub; fetch it first "
                             f"(`{_hf_download(repo_id, revision, gguf_file)}`) or pass a local .gguf file")


def _gguf_path(path: Path) -> Path:
    """An absolute path to a .gguf file that still ends in .gguf: the HF cache's files are links to blobs named
    by their hash, and the file's name is what transformers and the engine's GGUF weights go by."""
    return path.parent.resolve() / path.name


def _hf_download(repo_id: str, revision: str | None, filename: str | None = None) -> str:
    """The `hf download` command line that fetches what a spec names (a revision is its --revision option)."""
    return " ".join(["hf download", repo_id, *([filename] if filename else []),
                     *(["--revision", revision] if revision else [])])


def load_model(spec: str = DEFAULT_MODEL, *, dtype: str = "auto", device: str = "auto", quantization: str = "none",
               attn_implementation: str | None = None, trust_remote_code: bool = False,
               progress=None, gguf_native: frozenset[str] = frozenset()) -> LoadedModel:
    """Load `spec` for inference; the default model is pulled first when the store lacks it.
    `progress(step)` (optional) is told each step, and the pull's bytes (see `tfserve.models.pull`).
    `gguf_native`: the model classes (`Qwen2ForCausalLM` ...) whose .gguf files the caller runs from their own
    blocks: such a file on the CPU in float32 loads natively (tfserve.models.gguf_native), no weight expanded."""
    spec = str(getattr(spec, "value", spec))  # accept the CLI's enums as well as strings
    dtype, quantization = str(getattr(dtype, "value", dtype)), str(getattr(quantization, "value", quantization))
    # check the options before a possibly long pull
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "trust_remote_code": trust_remote_code, "local_files_only": True}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if quantization != "none":
        kwargs["quantization_config"] = bnb_config(quantization, torch_dtype)
        kwargs["device_map"] = {"": device}
    if spec == DEFAULT_MODEL and not store.is_pulled(DEFAULT_MODEL):
        pull(DEFAULT_MODEL, progress=progress)
    resolved = resolve_model(spec)
    if quantization != "none" and resolved.kind == "gguf":
        raise DeviceError(f"--quantization {quantization} cannot re-quantize a .gguf file; "
                          "load it with --quantization none, or convert it to an HF directory first")

    if resolved.kind == "gguf" and gguf_native and device == "cpu" and dtype == "auto" and quantization == "none":
        native = _load_native(resolved, gguf_native, progress)
        if native is not None:
            return native

    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    tok_kwargs = {"trust_remote_code": trust_remote_code, "local_files_only": True}
    if resolved.kind == "gguf":
        kwargs["gguf_file"] = tok_kwargs["gguf_file"] = resolved.path.name
    if progress is not None:
        progress(f"Loading {resolved.name}")
    from safetensors import SafetensorError

    try:
        with hf_progress_bars(enabled=progress is None), _source(resolved) as source:
            processor = None
            if resolved.kind != "gguf" and _is_vision_language(AutoConfig.from_pretrained(source, **tok_kwargs)):
                processor = _processor(source, tok_kwargs)
                tokenizer = processor.tokenizer
                model = AutoModelForImageTextToText.from_pretrained(source, **kwargs)
            else:
                tokenizer = AutoTokenizer.from_pretrained(source, **tok_kwargs)
                model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    # struct.error, IndexError: transformers' and gguf's readers meeting the end of a cut GGUF file
    except (OSError, ValueError, KeyError, ImportError, RuntimeError, struct.error, IndexError,
            SafetensorError) as exc:
        raise _load_error(resolved, exc) from None
    if quantization == "none":
        model = model.to(device)
    model.eval()
    known = get_known(resolved.name) if resolved.kind == "store" else None
    if known is not None:  # a store model converted before its recommended sampling was written
        recommend_sampling(model.generation_config, known.sampling)
    return LoadedModel(model, tokenizer, resolved.name, resolved.path, str(device), torch_dtype, quantization,
                       processor)


def _load_native(resolved: ResolvedModel, architectures: frozenset[str], progress) -> LoadedModel | None:
    """The GGUF file as tfserve.models.gguf_native loads it, or None where it holds what only transformers' loader
    reads (another architecture, a tensor type the kernels do not run)."""
    import torch

    from tfserve.models import gguf_native
    from tfserve.models.gguf_reader import read

    if progress is not None:
        progress(f"Loading {resolved.name}")
    try:
        config, tokenizer = gguf_native.load_config_and_tokenizer(resolved.path)
        architecture = gguf_native.architecture_class(config)
        reader = read(resolved.path) if architecture in architectures else None  # one header parse for both
        why_not = (f"{architecture or config.model_type} is not one of {', '.join(sorted(architectures))}"
                   if reader is None else gguf_native.why_not(reader))
        if why_not is not None:
            logger.info("%s loads through transformers, every weight expanded to float32: %s", resolved.name, why_not)
            return None
        model = gguf_native.build_model(reader, config)
    except (OSError, ValueError, KeyError, ImportError, RuntimeError, struct.error, IndexError) as exc:
        raise _load_error(resolved, exc) from None
    return LoadedModel(model, tokenizer, resolved.name, resolved.path, "cpu", torch.float32)


@contextmanager
def _source(resolved: ResolvedModel) -> Iterator[str]:
    """The folder transformers loads from: a GGUF file's from a folder that holds it alone
    (`gguf_native.alone`)."""
    if resolved.kind != "gguf":
        yield str(resolved.path)
        return
    with alone(resolved.path) as folder:
        yield folder


def _load_error(resolved: ResolvedModel, exc: BaseException) -> ModelLoadError:
    """One line for a model transformers could not load: a GGUF file that is cut short or none at all, a folder
    without tokenizer files, or transformers' own message with its lines joined (its first line alone may say
    nothing: "Couldn't instantiate the backend tokenizer from one of:")."""
    if resolved.kind == "gguf":
        from tfserve.models.gguf_file import unreadable_error

        unreadable = unreadable_error(resolved.path)
        if unreadable is not None:
            return unreadable
    elif store.missing_tokenizer(resolved.path):
        return ModelLoadError(f"cannot load {resolved.name} from {resolved.path}: no tokenizer files "
                              f"({', '.join(store.TOKENIZER_FILES[:4])}, ...)")
    message = one_line(exc)
    if resolved.kind == "gguf":  # the folder `_source` made is gone: name the file's own
        message = re.sub(re.escape(tempfile.gettempdir()) + r"/tfserve-gguf-[^/\s]+", str(resolved.path.parent),
                         message)
    return ModelLoadError(f"cannot load {resolved.name} from {resolved.path}: {message}")


def _processor(source: str, kwargs: dict[str, Any]) -> Any:
    """The model's AutoProcessor; where its video side cannot load (Qwen2-VL's video processor needs
    torchvision), the same processor class without it: images and text are all the engine takes."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    from tfserve.models.folder import read_json

    try:
        return AutoProcessor.from_pretrained(source, **kwargs)
    except (ImportError, AttributeError, ValueError, TypeError) as exc:
        config = {**(read_json(Path(source) / "preprocessor_config.json") or {}),
                  **(read_json(Path(source) / "processor_config.json") or {})}
        name = config.get("processor_class")
        if not name:
            raise ModelLoadError(f"cannot load the processor of {source}: {first_line(exc)}") from None
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        processor = images_only_processor_class(name)(
            image_processor=AutoImageProcessor.from_pretrained(source, **kwargs), tokenizer=tokenizer,
            video_processor=None, chat_template=tokenizer.chat_template)
        logger.info("%s: loaded %s without its video side (%s)", source, name, first_line(exc))
        return processor


def images_only_processor_class(name: str) -> type:
    """A transformers processor class (by name) that accepts `video_processor=None`."""
    import transformers

    base = getattr(transformers, name)

    class ImagesOnly(base):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    ImagesOnly.__name__ = ImagesOnly.__qualname__ = name
    return ImagesOnly


def _is_vision_language(config: Any) -> bool:
    """An image-text-to-text model (a vision tower next to its language model), loaded with its processor."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return hasattr(config, "vision_config") and config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def resolve_device(device: str = "auto") -> str:
    """"auto" -> "cuda" when available, else "cpu"; checks that a CUDA device exists."""
    import torch

    device = (device or "auto").strip().lower()
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return "cpu"
    if device == "cuda" or device.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise DeviceError(f"--device {device}: CUDA is not available on this machine "
                              f"(torch {torch.__version__}); --device cpu works")
        index = device.partition(":")[2]
        if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
            raise DeviceError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                              f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
        return device
    raise DeviceError(f"unknown device {device!r}: use auto, cpu, cuda or cuda:N")


def resolve_dtype(dtype: str, device: str):
    """"auto" -> float32 on CPU, bfloat16 on CUDA; else the named torch dtype."""
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype not in DTYPES:
        raise DeviceError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    return getattr(torch, dtype)


def bnb_config(quantization: str, compute_dtype):
    """A BitsAndBytesConfig for "bnb-4bit" / "bnb-8bit"; one line naming the extra when it is missing."""
    if quantization not in QUANTIZATIONS:
        raise DeviceError(f"unknown quantization {quantization!r}: use one of {', '.join(QUANTIZATIONS)}")
    missing = [pkg for pkg in ("bitsandbytes", "accelerate") if importlib.util.find_spec(pkg) is None]
    if missing:
        raise DeviceError(f"--quantization {quantization} needs {' and '.join(missing)}: "
                          "pip install 'tfserve[quant]' (or use --quantization none)")
    # bitsandbytes logs a line per int8 matmul on float32 input, and one about an optional hub kernel
    logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    from transformers import BitsAndBytesConfig

    if quantization == "bnb-4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=compute_dtype)
    return BitsAndBytesConfig(load_in_8bit=True)


def _hf_cache_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The local snapshot of hub repo `repo_id` at `revision` (a branch, tag or commit; None: main), never
    touching the network; None when not cached."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError:
        return None
    try:
        path = Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except (HFValidationError, LocalEntryNotFoundError, OSError, ValueError):
        return None
    return path if path.is_dir() else None


def _looks_like_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or spec.endswith(".gguf") or "\\" in spec
