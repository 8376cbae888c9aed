"""/v1/audio/transcriptions and /translations through the openai SDK, on the real whisper-tiny.en."""

from __future__ import annotations

import openai
import pytest
from speech import DATA, SENTENCES, wer, whisper_dir  # noqa: F401  (whisper_dir: a fixture)

pytestmark = pytest.mark.slow


@pytest.fixture
def speech_server(start_server, whisper_dir):  # noqa: F811  (the fixture, by name)
    from tfserve.server.runtime.speech import SpeechOptions

    return start_server(state_kwargs={"speech": SpeechOptions(default_model=str(whisper_dir), max_audio_s=20)},
                        max_body_size=1_000_000)


def fox() -> bytes:
    return (DATA / "fox.opus").read_bytes()


def test_every_format_and_the_stream(speech_server):
    client = speech_server.client()
    result = client.audio.transcriptions.create(model="whisper-1", file=("fox.opus", fox()))
    assert wer(SENTENCES["fox"]["text"], result.text) < 0.5 and result.usage.seconds > 4
    assert client.audio.transcriptions.create(model="whisper-1", file=("f.opus", fox()),
                                              response_format="text").strip() == result.text
    srt = client.audio.transcriptions.create(model="whisper-1", file=("f.opus", fox()), response_format="srt")
    assert srt.startswith("1\n00:00:00,000 --> 00:00:0")
    vtt = client.audio.transcriptions.create(model="whisper-1", file=("f.opus", fox()), response_format="vtt")
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> ")
    verbose = client.audio.transcriptions.create(model="whisper-1", file=("f.opus", fox()),
                                                 response_format="verbose_json",
                                                 timestamp_granularities=["word", "segment"])
    assert verbose.language == "english" and verbose.segments[0].start == 0.0 and verbose.words[0].word == "The"
    events = list(client.audio.transcriptions.create(model="whisper-1", file=("f.opus", fox()), stream=True))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    assert events[-1].type == "transcript.text.done" and events[-1].text == "".join(deltas) == result.text
    usage = events[-1].usage  # the SDK's type for it has token counts only
    assert abs(usage.input_tokens - result.usage.seconds * 50) <= 1 and usage.output_tokens > len(result.text.split())
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


@pytest.mark.parametrize("fields, param", [
    ({"file": ("x.wav", b"not audio at all")}, "file"),
    ({"file": ("x.wav", b"")}, "file"),
    ({"file": ("x.opus", (DATA / "fox.opus").read_bytes()[:300])}, "file"),
    ({"language": "xx"}, "language"),
    ({"language": "fr"}, "language"),
    ({"model": "smollm2-135m-instruct"}, "model"),
    ({"response_format": "docx"}, "response_format"),
    ({"temperature": 7}, "temperature"),
])
def test_bad_input_is_a_400_naming_the_field(speech_server, fields, param):
    client = speech_server.client()
    args = {"model": "whisper-1", "file": ("fox.opus", fox()), **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        client.audio.transcriptions.create(**args)
    assert caught.value.body["param"] == param


def test_limits_and_english_only_translation(speech_server):
    client = speech_server.client()
    with pytest.raises(openai.BadRequestError) as caught:
        client.audio.translations.create(model="whisper-1", file=("fox.opus", fox()))
    assert caught.value.body["param"] == "model"
    import numpy as np

    from tfserve.bench.audio import to_wav

    with pytest.raises(openai.BadRequestError) as caught:  # 25 s over --max-audio-seconds 20
        client.audio.transcriptions.create(model="whisper-1", file=("long.wav", to_wav(np.zeros(400_000))))
    assert caught.value.body["param"] == "file"
    with pytest.raises(openai.APIStatusError) as caught:  # over the 1 MB body limit
        client.audio.transcriptions.create(model="whisper-1", file=("big.wav", to_wav(np.zeros(1_100_000))))
    assert caught.value.status_code == 413
    with pytest.raises(openai.NotFoundError):
        client.audio.transcriptions.create(model="no-such-model", file=("fox.opus", fox()))
