"""A window of a job being decoded in a Transcriber's slot; each decode of it judged as an `Attempt` (openai-whisper's
thresholds), the hotter decodes of a failed one (`Fallback`), and the token each window samples."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tfserve.audio.job import (COMPRESSION_RATIO_THRESHOLD, LOGPROB_THRESHOLD, NO_SPEECH_THRESHOLD, TEMPERATURE_STEP,
                               TranscriptionJob)
from tfserve.engine.sampler import inverse_cdf
from tfserve.sampling_params import MIN_TEMPERATURE


@dataclass(eq=False)
class Window:
    """One window of a job being decoded in a slot."""

    job: TranscriptionJob
    seek: int  # its first mel frame
    num_frames: int  # of audio in it, <= 3000
    prompt: list[int]  # fed before sampling: previous text, <|startoftranscript|>, language and task
    temperature: float
    pending: list[int] = field(default_factory=list)  # fed at the next step
    position: int = 0  # decoder positions filled
    sampled: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # of each sampled token
    sum_logprob: float = 0.0
    no_speech_prob: float = 0.0
    sot_index: int = -1  # index of <|startoftranscript|> in `pending` (its logits give the no-speech probability)
    detect_language: bool = False  # the step after <|startoftranscript|> picks the language first
    fallback: Fallback | None = None  # the hotter decodes of this window, once its greedy one failed
    generator: torch.Generator | None = None  # its draws at a temperature (each decode's own, seeded 0)


@dataclass(slots=True)
class Attempt:
    """One decode of a window, judged by its average log-probability and compression ratio."""

    tokens: list[int]  # sampled, without the end of text
    logprobs: list[float]  # of each of `tokens`
    temperature: float
    avg_logprob: float  # over the window's every token, the end of text included (what the thresholds judge)
    compression_ratio: float
    no_speech_prob: float

    @property
    def silent(self) -> bool:
        """Likely no speech: the window is skipped."""
        return self.no_speech_prob > NO_SPEECH_THRESHOLD and self.avg_logprob < LOGPROB_THRESHOLD

    @property
    def accepted(self) -> bool:
        """Fluent and likely enough (or silent): no hotter decode is needed."""
        failed = self.compression_ratio > COMPRESSION_RATIO_THRESHOLD or self.avg_logprob < LOGPROB_THRESHOLD
        return self.silent or not failed


@dataclass(eq=False)
class Fallback:
    """The hotter decodes of a window whose greedy decode failed: each temperature decoded once, in a slot of its
    own (`Transcriber.spread`) or after a cooler one in the same slot; the first in order that passes is taken."""

    greedy: Attempt
    temperatures: list[float]
    waiting: list[float] = field(init=False)  # not started (or stopped for a job), coolest first
    attempts: dict[float, Attempt] = field(default_factory=dict)  # the finished ones, by temperature
    windows: list[Window] = field(default_factory=list)  # decoding one of the temperatures

    def __post_init__(self) -> None:
        self.waiting = list(self.temperatures)

    def take(self) -> float | None:
        """The coolest temperature not decoding nor done, or None."""
        return self.waiting.pop(0) if self.waiting else None

    def give_back(self, window: Window) -> None:
        """`window`'s temperature stops decoding (its slot goes to a job); it starts again later."""
        self.windows.remove(window)
        self.waiting = sorted(self.waiting + [window.temperature])

    def ahead(self) -> list[Window]:
        """The windows decoding what one decode after another would not have reached yet: all but the coolest."""
        return sorted(self.windows, key=lambda w: w.temperature)[1:]

    def hopeless(self, window: Window, max_sample_len: int) -> bool:
        """Whether `window`'s decode can no longer change the outcome, however it goes on: even if every token to
        come had probability 1, its average log-probability stays under the threshold (it cannot pass) and under
        that of a fluent attempt already finished (it cannot be the likeliest either), and the window is not
        likely silent (where a low average is what skips it). Such a decode stops: the transcript is the same."""
        best_case = window.sum_logprob / (max_sample_len + 1)  # every token to come at log-probability 0
        if best_case >= LOGPROB_THRESHOLD or window.no_speech_prob > NO_SPEECH_THRESHOLD:
            return False
        done = [self.greedy, *self.attempts.values()]
        return any(a.compression_ratio <= COMPRESSION_RATIO_THRESHOLD and a.avg_logprob > best_case for a in done)

    def decide(self) -> Attempt | None:
        """The attempt taken once the cooler ones are known: the first that passes, or the likeliest of all when
        none does; None while a cooler one is still decoding."""
        for temperature in self.temperatures:
            attempt = self.attempts.get(temperature)
            if attempt is None:
                return None
            if attempt.accepted:
                return attempt
        return best([self.greedy, *self.attempts.values()])


def hotter(temperature: float) -> list[float]:
    """The fallback's temperatures after `temperature`: +0.2 each, up to 1.0."""
    steps = round((1.0 - temperature) / TEMPERATURE_STEP)
    return [round(temperature + TEMPERATURE_STEP * (i + 1), 6) for i in range(steps)]


def best(attempts: list[Attempt]) -> Attempt:
    """The likeliest attempt that does not repeat itself, else the likeliest (as faster-whisper chooses)."""
    fluent = [a for a in attempts if a.compression_ratio <= COMPRESSION_RATIO_THRESHOLD]
    return max(fluent or attempts, key=lambda a: a.avg_logprob)


def sample(logits: torch.Tensor, windows: list[Window]) -> torch.Tensor:
    """Row i's token for windows[i]: the argmax, or drawn at its temperature by inverse CDF (the chat
    sampler's), one uniform from the decode's own generator, seeded 0 (so a transcript depends neither on the
    jobs sharing its steps nor on whether its hotter decodes ran side by side). The hot rows are drawn
    together: one softmax and one running sum for all (torch.multinomial took ~0.9 ms a row)."""
    chosen = logits.max(dim=-1).indices  # the first maximum, as argmax; ~2x faster on a CPU
    hot = [i for i, window in enumerate(windows) if window.temperature >= MIN_TEMPERATURE]
    if not hot:
        return chosen
    uniforms = []
    for i in hot:
        window = windows[i]
        if window.generator is None:
            window.generator = torch.Generator().manual_seed(0)
        uniforms.append(torch.rand(1, dtype=torch.float64, generator=window.generator))
    temperatures = torch.tensor([windows[i].temperature for i in hot])[:, None]
    probs = torch.softmax(logits[hot] / temperatures, dim=-1)
    chosen[hot] = inverse_cdf(probs, torch.cat(uniforms))
    return chosen
