"""Response formats, the timestamp grammar's segment split, and the word aligner's DTW: no model."""

import numpy as np

from tfserve.audio import formats
from tfserve.audio.job import Segment, TranscriptionResult, Word, compression_ratio
from tfserve.audio.timestamps import split_window
from tfserve.audio.words import dtw

TS = 1000  # timestamp_begin of these hand-made token lists: <|t|> is TS + t / 0.02


def segment(i, start, end, text):
    return Segment(id=i, seek=0, start=start, end=end, text=text, tokens=[1, 2], temperature=0.0, avg_logprob=-0.25,
                   compression_ratio=1.1, no_speech_prob=0.01)


RESULT = TranscriptionResult(text="Hello there. Bye.", segments=[segment(0, 0.0, 1.5, " Hello there."),
                                                                segment(1, 3661.5, 3662.0, " Bye.")],
                             language="en", duration_s=3662.25, num_windows=2)


def test_srt_and_vtt_number_and_time_cues():
    srt = formats.render(RESULT, "srt")
    assert srt.startswith("1\n00:00:00,000 --> 00:00:01,500\nHello there.\n\n2\n01:01:01,500 --> 01:01:02,000\nBye.")
    vtt = formats.render(RESULT, "vtt")
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nHello there.\n")
    assert "01:01:01.500 --> 01:01:02.000\nBye." in vtt
    assert formats.render(RESULT, "text") == "Hello there. Bye.\n"


def test_srt_and_vtt_with_words_have_a_cue_per_word():
    timed = [Segment(id=0, seek=0, start=0.0, end=1.5, text=" Hello there.", tokens=[1, 2], temperature=0.0,
                     avg_logprob=-0.25, compression_ratio=1.1, no_speech_prob=0.01,
                     words=[Word(" Hello", 0.0, 0.6), Word(" there.", 0.7, 1.5)]),
             Segment(id=1, seek=0, start=2.0, end=2.5, text=" Bye.", tokens=[3], temperature=0.0, avg_logprob=-0.5,
                     compression_ratio=1.0, no_speech_prob=0.01, words=[Word(" Bye.", 2.0, 2.5)])]
    result = TranscriptionResult(text="Hello there. Bye.", segments=timed, language="en", duration_s=3.0,
                                 num_windows=1)
    assert formats.render(result, "srt", include_words=True) == (
        "1\n00:00:00,000 --> 00:00:00,600\nHello\n\n2\n00:00:00,700 --> 00:00:01,500\nthere.\n\n"
        "3\n00:00:02,000 --> 00:00:02,500\nBye.\n")
    assert formats.render(result, "vtt", include_words=True) == (
        "WEBVTT\n\n00:00:00.000 --> 00:00:00.600\nHello\n\n00:00:00.700 --> 00:00:01.500\nthere.\n\n"
        "00:00:02.000 --> 00:00:02.500\nBye.\n")
    assert formats.render(result, "srt").count(" --> ") == 2  # without words: a cue per segment


def test_verbose_json_has_openais_fields():
    body = formats.render(RESULT, "verbose_json", "transcribe", usage={"type": "duration", "seconds": 3662.25})
    assert body["task"] == "transcribe" and body["language"] == "english" and body["duration"] == 3662.25
    assert set(body["segments"][0]) == {"id", "seek", "start", "end", "text", "tokens", "temperature",
                                        "avg_logprob", "compression_ratio", "no_speech_prob"}
    assert "words" not in body
    assert formats.render(RESULT, "json") == {"text": "Hello there. Bye."}


def test_split_window_cuts_at_timestamp_pairs():
    # <|0.00|> a b <|1.00|><|1.00|> c <|2.00|> (single timestamp ending: nothing said after 2.00)
    tokens = [TS, 1, 2, TS + 50, TS + 50, 3, TS + 100]
    segments, advance = split_window(tokens, 3000, TS)
    assert [(s.start, s.end) for s in segments] == [(0.0, 1.0), (1.0, 2.0)]
    assert [tokens[s.first:s.first + len(s.tokens)] == s.tokens for s in segments] == [True, True]  # where each is
    assert [s.first for s in segments] == [0, 4]
    assert advance == 3000


def test_split_window_resumes_at_an_unfinished_segment():
    # the last segment (from 1.00) did not end: the next window starts at 1.00 s = 100 frames
    tokens = [TS, 1, 2, TS + 50, TS + 50, 3, 4]
    segments, advance = split_window(tokens, 3000, TS)
    assert [(s.start, s.end) for s in segments] == [(0.0, 1.0)]
    assert advance == 100


def test_split_window_without_pairs_is_one_segment():
    segments, advance = split_window([TS, 1, 2, TS + 190], 1200, TS)
    assert [(round(s.start, 2), round(s.end, 2)) for s in segments] == [(0.0, 3.8)] and advance == 1200


def test_dtw_follows_the_cheap_diagonal():
    cost = np.ones((3, 6))
    for i, j in [(0, 0), (0, 1), (1, 2), (1, 3), (2, 4), (2, 5)]:
        cost[i, j] = 0.0
    rows, cols = dtw(cost)
    assert list(zip(rows, cols)) == [(0, 0), (0, 1), (1, 2), (1, 3), (2, 4), (2, 5)]


def test_compression_ratio_flags_repetition():
    assert compression_ratio("the cat sat on the mat") < 2.4 < compression_ratio("la la la " * 40)
