"""Speech models on demand, beside the chat model: a transcription request naming a Whisper model (or
`whisper-1`, or none: the default speech model) loads it once, with its own transcriber thread, and it stays
loaded next to whatever chat model is resident. At most `max_loaded` stay; the least recently used idle one
makes room."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tfserve.errors import ModelNotFoundError, TfserveError
from tfserve.server.errors import ApiError, model_not_found
from tfserve.server.runtime.model_names import OPENAI_NAMES, is_loadable_name
from tfserve.server.runtime.threads import in_daemon_thread

if TYPE_CHECKING:
    from tfserve.audio.transcriber import Transcriber

logger = logging.getLogger("tfserve.server")


@dataclass(slots=True)
class SpeechOptions:
    """Speech settings of a server."""

    default_model: str = "whisper-tiny.en"  # for `whisper-1` or no `model`
    max_audio_s: float = 3600.0  # longer files are refused
    max_num_windows: int = 8  # 30-second windows decoded together per model
    max_loaded: int = 2  # speech models kept loaded
    device: str = "cpu"  # where they run: the chat model's --device ("auto" resolves the same way)


class SpeechModels:
    """The loaded speech models of a server, by name. Lives on the event loop's thread."""

    def __init__(self, options: SpeechOptions | None = None) -> None:
        self.options = options or SpeechOptions()
        self.loaded: OrderedDict[str, Transcriber] = OrderedDict()  # least recently used first
        self._loading: dict[str, asyncio.Future] = {}

    def resolve(self, name: str | None) -> str:
        """The speech model a request's `model` means."""
        return self.options.default_model if name in (None, "", *OPENAI_NAMES) else name

    async def get(self, name: str | None, chat_names: set[str] = frozenset()) -> Transcriber:
        """The running transcriber of the model `name` means, loaded first when needed. 400 for a chat model,
        404 for a model this server cannot find."""
        spec = self.resolve(name)
        if spec in self.loaded:
            self.loaded.move_to_end(spec)
            return self.loaded[spec]
        if spec in chat_names:
            raise _not_speech(spec)
        if spec != self.options.default_model and not is_loadable_name(spec):
            raise model_not_found(spec)
        future = self._loading.get(spec)
        if future is None:
            future = self._loading[spec] = asyncio.ensure_future(self._load(spec))
            future.add_done_callback(lambda _: self._loading.pop(spec, None))
        return await asyncio.shield(future)

    async def _load(self, spec: str) -> Transcriber:
        from tfserve.audio.transcriber import Transcriber
        from tfserve.audio.whisper_forward import WhisperSlots
        from tfserve.audio.whisper_model import NotSpeechModelError, WhisperModel
        from tfserve.engine.runner import available_memory

        try:  # the operator's --speech-model may be a path; a client's name may not
            whisper = await in_daemon_thread(WhisperModel.from_spec, spec, None, spec == self.options.default_model,
                                             self.options.device)
        except NotSpeechModelError:
            raise _not_speech(spec) from None
        except ModelNotFoundError as exc:
            logger.debug("speech model %r cannot be loaded: %s", spec, exc)  # the operator's detail, not the client's
            raise model_not_found(spec) from None
        except TfserveError as exc:
            raise ApiError(500, f"loading speech model {spec!r} failed: {exc}", param="model",
                           code="model_load_failed") from None
        self._make_room()
        needed = WhisperSlots.cache_bytes(whisper.model.config, self.options.max_num_windows,
                                          whisper.model.dtype.itemsize) + (256 << 20)
        available = available_memory(whisper.device)
        if available < needed:  # the chat model and the other speech models keep theirs
            raise ApiError(503, f"not enough memory to run speech model {spec!r} beside the loaded models: it needs "
                                f"{needed >> 20} MiB, {available >> 20} MiB are free (fewer --max-audio-windows "
                                f"need less)", param="model", code="insufficient_memory")
        transcriber = (await in_daemon_thread(Transcriber, whisper, self.options.max_num_windows)).start()
        self.loaded[spec] = transcriber
        logger.info("loaded speech model %s", spec)
        return transcriber

    def _make_room(self) -> None:
        while len(self.loaded) >= self.options.max_loaded:
            idle = next((n for n, t in self.loaded.items() if not t.num_running and not t.num_waiting), None)
            if idle is None:
                return  # every loaded model is busy: hold one more for now
            logger.info("unloading speech model %s to make room", idle)
            self.loaded.pop(idle).stop()

    @property
    def num_running(self) -> int:
        return sum(t.num_running for t in self.loaded.values())

    @property
    def num_waiting(self) -> int:
        return sum(t.num_waiting for t in self.loaded.values())

    def total(self, stat: str) -> float:
        """A `TranscriberStats` counter summed over the loaded models."""
        return sum(getattr(t.stats, stat) for t in self.loaded.values())

    def stop(self) -> None:
        for transcriber in self.loaded.values():
            transcriber.stop()
        self.loaded.clear()


def _not_speech(spec: str) -> ApiError:
    return ApiError(400, f"{spec!r} is not a speech recognition model; name a Whisper model such as "
                         f"'whisper-tiny.en' (or 'whisper-1' for the default)", param="model",
                    code="model_not_supported")
