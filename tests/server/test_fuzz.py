"""Odd input never makes a 500: each case a fuzz once found, then a seeded fuzz of every field of the three
generating endpoints. Every answer is a 200 or a 4xx OpenAI error body, the server keeps serving, and a bad
request leaves its keep-alive connection usable."""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import random
import time
import zlib

import aiohttp
import pytest

from tfserve.server.chat_prompt import template_arguments
from tiny import MODEL_NAME, sse_events, wait_until_idle

CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
BASE = {
    CHAT: {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    COMPLETIONS: {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2},
    RESPONSES: {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 2},
}


def raw_request(server, method: str, path: str, body: bytes | str | None = b"", headers: dict | None = None,
                chunked: bool = False) -> tuple[int, dict, bytes]:
    """One request on its own connection, headers exactly as given -> (status, headers, raw body)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request(method, path, body=body, headers=headers or {}, encode_chunked=chunked)
    response = conn.getresponse()
    raw = response.read()
    conn.close()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, raw


def assert_clean(status: int, headers: dict, raw: bytes, case=None) -> None:
    """A 200 (a JSON body, or an event stream without an error event) or a 4xx OpenAI error body."""
    assert status == 200 or 400 <= status < 500, (case, status, raw[:300])
    if status == 200 and headers.get("content-type", "").startswith("text/event-stream"):
        events = sse_events(raw.decode())
        assert not any(isinstance(e, dict) and (e.get("error") or e.get("type") == "error") for e in events), case
        return
    assert headers.get("content-type", "").startswith("application/json"), (case, status, raw[:300])
    data = json.loads(raw)
    if status != 200:
        error = data["error"]
        assert set(error) == {"message", "type", "param", "code"}, (case, data)
        assert isinstance(error["message"], str) and error["message"], (case, data)


def post(server, path: str, body, headers: dict | None = None) -> tuple[int, dict]:
    """POST `body` (an object, or raw text/bytes sent as is) -> (status, error or response object)."""
    raw = body if isinstance(body, (bytes, str)) else json.dumps(body)
    raw = raw.encode() if isinstance(raw, str) else raw  # http.client would send a str as latin-1
    status, response_headers, data = raw_request(server, "POST", path, raw,
                                                 {"Content-Type": "application/json", **(headers or {})})
    assert_clean(status, response_headers, data, body if len(raw) < 300 else raw[:300])
    payload = json.loads(data) if response_headers["content-type"].startswith("application/json") else data
    return status, payload.get("error", payload) if isinstance(payload, dict) else payload


def assert_400(server, path: str, body, param: str | None, headers: dict | None = None) -> dict:
    status, error = post(server, path, body, headers)
    assert status == 400, error
    assert error["param"] == param, error
    return error


# -- what the fuzz found ------------------------------------------------------------------------------------


def test_a_300_character_model_name_is_a_404(server, start_server, async_engine):
    from tfserve.server.runtime.state import ServerState

    status, error = post(server, CHAT, {**BASE[CHAT], "model": "m" * 300})
    assert status == 404 and error["code"] == "model_not_found" and error["param"] == "model"
    on_demand = ServerState(load=lambda spec: pytest.fail(f"nothing should load {spec}"))
    on_demand.set_engine(async_engine, MODEL_NAME)
    live = start_server(state=on_demand)
    for name in ["m" * 300, "org/" + "m" * 300]:
        status, error = post(live, CHAT, {**BASE[CHAT], "model": name})
        assert status == 404 and error["code"] == "model_not_found" and error["param"] == "model"
        status, _, _ = raw_request(live, "GET", f"/v1/models/{name}")
        assert status == 404


@pytest.mark.parametrize("token_id", [-1, -(2**63) - 1, 2**63, 2**64, 384, 10**30])
def test_prompt_token_ids_outside_the_vocabulary_are_a_400(server, engine, token_id):
    assert engine.vocab_size == 384
    for prompt in [[token_id], [[1, 2], [token_id]]]:
        error = assert_400(server, COMPLETIONS, {**BASE[COMPLETIONS], "prompt": prompt}, "prompt")
        assert "vocabulary" in error["message"]


@pytest.mark.parametrize("path,field", [(COMPLETIONS, "prompt"), (CHAT, "messages"), (RESPONSES, "input"),
                                        (CHAT, "stop"), (RESPONSES, "metadata")])
def test_a_lone_surrogate_is_a_400(server, path, field):
    body = {**BASE[path], field: {"prompt": "a\ud800b", "messages": [{"role": "user", "content": "\udfff"}],
                                  "input": "\ud800", "stop": ["\ud800"], "metadata": {"k": "\ud800"}}[field]}
    raw = json.dumps(body)  # ensure_ascii: the surrogate travels as the escape "\ud800", as a client sends it
    error = assert_400(server, path, raw, field)
    assert "surrogate" in error["message"]
    emoji = json.dumps({**BASE[path], "user": "\U0001f389"})  # a valid pair of escapes is fine
    assert post(server, path, emoji)[0] == 200


@pytest.mark.parametrize("raw", [
    '{"prompt": "hi", "max_tokens": 1%s}' % ("0" * 5000),  # over Python's 4,300-digit int limit
    '{"prompt": "hi", "temperature": NaN}',
    '{"prompt": "hi", "temperature": Infinity}',
    '{"prompt": "hi", "temperature": -Infinity}',
    '{"prompt": "hi", "top_p": 1e400}',
    '{"prompt": "hi", "user": [%s]}' % ("[" * 5000 + "]" * 5000),
    '{"prompt": "hi", "user": %s}' % ("[" * 100_000 + "]" * 100_000),
    '{"prompt": "hi", "metadata": %s}' % ('{"a": ' * 65 + "1" + "}" * 65),
    "[" * 100_000,
])
def test_json_python_accepts_but_openai_does_not_is_a_400(server, raw):
    error = assert_400(server, COMPLETIONS, raw, None)
    assert "JSON" in error["message"]


def test_nesting_within_the_limit_is_served(server):
    assert post(server, COMPLETIONS, '{"prompt": "hi", "max_tokens": 1, "metadata": %s}'
                % ('{"a": ' * 60 + "1" + "}" * 60))[0] == 200


def test_tool_call_arguments_that_are_no_json_object_go_back_as_strings(server):
    """OpenAI takes any string as a past call's arguments: deep, huge or non-standard JSON is text to the template
    (never parsed past the limits, never a 500); only a value that is no string is a 400."""
    def call(arguments):
        return {**BASE[CHAT], "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                  "function": {"name": "f", "arguments": arguments}}]}]}

    for arguments in ["[" * 300, "NaN", "[1, 2]", "1" * 300, '{"city": "Pa', '{"city": "Paris"}']:
        status, body = post(server, CHAT, call(arguments))
        assert status == 200, (arguments[:10], body)
    assert_400(server, CHAT, call(7), "messages[1].tool_calls[0].function.arguments")
    # past Python's recursion and integer-digit limits (longer than the tiny model's context, so here alone)
    for arguments in ["[" * 5000, "1" * 5000, "NaN"]:
        assert template_arguments(arguments, "arguments") == arguments
    assert template_arguments('{"a": [1]}', "arguments") == {"a": [1]} and template_arguments("", "a") == {}


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
FLAT_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}
DEEP = "[" * 5000


@pytest.mark.parametrize("path,body,param", [
    (CHAT, {"tools": [TOOL], "tool_choice": {"type": "function", "function": "f"}}, "tool_choice.function"),
    (RESPONSES, {"tools": [FLAT_TOOL], "tool_choice": {"type": "function", "function": ["f"]}},
     "tool_choice.function"),
    (CHAT, {"tools": [{**TOOL, "function": {"name": "f", "parameters": {"type": {"a": 1}}}}]},
     "tools[0].function.parameters.type"),
    (CHAT, {"tools": [{**TOOL, "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": ["string", ["a"]]}}}}}]},
     "tools[0].function.parameters.properties.x.type"),
    (CHAT, {"guided_json": DEEP}, "guided_json"),
    (CHAT, {"structured_outputs": {"json": DEEP}}, "structured_outputs.json"),
    (RESPONSES, {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": 7}]},
     "input[0].arguments"),
    # what OpenAI refuses too: a strict that is no boolean, a format name it does not take, a past call's odd
    # id or type, an output modality that does not exist, metadata past its limits
    (CHAT, {"tools": [{**TOOL, "function": {"name": "f", "strict": "x"}}]}, "tools[0].function.strict"),
    (RESPONSES, {"tools": [{**FLAT_TOOL, "strict": 1}]}, "tools[0].strict"),
    (RESPONSES, {"text": {"format": {"type": "json_schema", "name": "a", "schema": {}, "strict": "yes"}}},
     "text.format.strict"),
    # a call's arguments are a JSON object: a string or array schema made them no JSON at all ("f", "[]")
    (CHAT, {"tools": [{**TOOL, "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    (RESPONSES, {"tools": [{**FLAT_TOOL, "parameters": {"type": "array"}}]}, "tools[0].parameters"),
    (CHAT, {"tools": [{**TOOL, "function": {"name": "f", "description": 7}}]}, "tools[0].function.description"),
    (RESPONSES, {"text": {"format": {"type": "json_schema", "name": "a.b", "schema": {}}}}, "text.format.name"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "a b!", "schema": {}}}},
     "response_format.json_schema.name"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": 1, "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[1].tool_calls[0].id"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "zzz", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[1].tool_calls[0].type"),
    (CHAT, {"modalities": [1, "a"]}, "modalities[0]"),
    (CHAT, {"best_of": 3}, "best_of"), (CHAT, {"best_of": "x"}, "best_of"),
    (CHAT, {"spaces_between_special_tokens": "x"}, "spaces_between_special_tokens"),
    (COMPLETIONS, {"spaces_between_special_tokens": 1}, "spaces_between_special_tokens"),
    (CHAT, {"logit_bias": {"99999999": 5}}, "logit_bias.99999999"),
    # keywords whose values JSON Schema constrains: a multipleOf of 0 or less, a negative or fractional count
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"n": {"type": "number", "multipleOf": -2}}}}}},
     "response_format.json_schema.schema.properties.n.multipleOf"),
    (CHAT, {"tools": [{**TOOL, "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "maxLength": -1}}}}}]},
     "tools[0].function.parameters.properties.s.maxLength"),
    (RESPONSES, {"text": {"format": {"type": "json_schema", "name": "a", "schema": {
        "type": "array", "minItems": 1.5}}}}, "text.format.schema.minItems"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "string", "pattern": 7}}}}, "response_format.json_schema.schema.pattern"),
    (CHAT, {"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    (RESPONSES, {"metadata": {"k": "v" * 513}}, "metadata.k"),
])
def test_odd_tool_and_schema_shapes_are_a_400(server, path, body, param):
    assert_400(server, path, {**BASE[path], **body}, param)


def test_a_flat_tools_stray_function_key_is_not_its_definition(server):
    tool = {**FLAT_TOOL, "function": "not a definition"}
    assert post(server, RESPONSES, {**BASE[RESPONSES], "tools": [tool], "tool_choice": "required",
                                    "max_output_tokens": 16})[0] == 200


NESTED_FORM = (b"--x\r\nContent-Type: multipart/mixed; boundary=y\r\n\r\n--y\r\nContent-Disposition: form-data; "
               b'name="file"\r\n\r\nabc\r\n--y--\r\n--x--\r\n')
ODD_CHARSET = (b'--x\r\nContent-Disposition: form-data; name="model"\r\nContent-Type: text/plain; charset=bogus-xyz'
               b"\r\n\r\nwhisper-1\r\n--x--\r\n")


ODD_ENCODING = (b'--x\r\nContent-Disposition: form-data; name="model"\r\nContent-Transfer-Encoding: bogus'
                b"\r\n\r\nwhisper-1\r\n--x--\r\n")
MISNAMED_FILE = b'--x\r\nContent-Disposition: form-data; name="files"\r\n\r\n\xcc\xff\x00\r\n--x--\r\n'
TWO_FILES = (b'--x\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\nabc\r\n'
             b'--x\r\nContent-Disposition: form-data; name="file"; filename="b.wav"\r\n\r\ndef\r\n--x--\r\n')


@pytest.mark.parametrize("body,param,says", [
    (NESTED_FORM, "file", "nested"), (ODD_CHARSET, "model", "bogus-xyz"), (ODD_ENCODING, "model", "bogus"),
    (MISNAMED_FILE, "file", "`file` field is missing"), (TWO_FILES, "file", "two `file` fields")],
    ids=["nested", "charset", "encoding", "misnamed", "two-files"])
def test_an_odd_audio_form_is_a_400_naming_the_field(server, body, param, says):
    status, headers, raw = raw_request(server, "POST", "/v1/audio/transcriptions", body,
                                       {"Content-Type": "multipart/form-data; boundary=x"})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == param and says in error["message"], raw


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, RESPONSES])
@pytest.mark.parametrize("field,value", [("temperature", 2**63), ("repetition_penalty", 2**64),
                                         ("top_p", 2**63), ("presence_penalty", -(2**70))])
def test_huge_numbers_are_a_400_before_the_stream_starts(server, path, field, value):
    for stream in (False, True):
        assert_400(server, path, {**BASE[path], field: value, "stream": stream}, field)


BAD_RANGES = [
    ("temperature", -0.1), ("temperature", 2.01), ("temperature", 1e300), ("top_p", 1.01),
    ("top_p", -1), ("presence_penalty", 2.5), ("presence_penalty", -2.5), ("frequency_penalty", 3),
    ("min_p", -0.5), ("min_p", 1.5), ("repetition_penalty", 0), ("repetition_penalty", -1),
    ("repetition_penalty", 2.5), ("top_k", -2), ("n", 0), ("n", 129), ("n", 2**63), ("seed", 2**63),
    ("seed", -(2**63) - 1), ("max_tokens", -1), ("max_tokens", -(2**64)), ("max_tokens", 1.5),
    ("stop_token_ids", [-1]), ("stop_token_ids", [2**63]), ("stop_token_ids", [True]), ("stop_token_ids", ["a"]),
]


@pytest.mark.parametrize("field,value", BAD_RANGES, ids=[f"{f}={v}" for f, v in BAD_RANGES])
def test_values_outside_openais_ranges_are_a_400(server, field, value):
    error = assert_400(server, COMPLETIONS, {**BASE[COMPLETIONS], field: value}, field)
    assert field in error["message"]


def test_values_at_the_edges_of_the_ranges_are_served(server):
    for extra in [{"temperature": 0}, {"temperature": 2}, {"top_p": 0}, {"top_p": 1e-9}, {"presence_penalty": -2},
                  {"frequency_penalty": 2}, {"min_p": 1}, {"repetition_penalty": 2}, {"top_k": -1},
                  {"seed": -(2**63)}, {"seed": 2**63 - 129}, {"n": 3}]:
        assert post(server, COMPLETIONS, {**BASE[COMPLETIONS], **extra})[0] == 200, extra
    body = {**BASE[CHAT], "logprobs": True, "top_logprobs": 20}
    assert post(server, CHAT, body)[0] == 200


@pytest.mark.parametrize("path,field", [(CHAT, "max_completion_tokens"), (CHAT, "max_tokens"),
                                        (RESPONSES, "max_output_tokens"), (COMPLETIONS, "max_tokens")])
def test_context_errors_name_the_field_the_client_sent(server, engine, path, field):
    body = {**BASE[path], "max_tokens": None, "max_output_tokens": None, field: engine.max_model_len}
    error = assert_400(server, path, body, field)
    assert error["code"] == "context_length_exceeded"
    assert field in error["message"] and ("max_tokens" in error["message"]) == (field == "max_tokens")
    assert_400(server, path, {**body, field: -1}, field)


@pytest.mark.parametrize("path,field", [(CHAT, "messages"), (RESPONSES, "input"), (COMPLETIONS, "prompt")])
def test_a_prompt_longer_than_the_context_names_the_prompt(server, engine, path, field):
    prompt = [7] * (engine.max_model_len + 1)
    text = "hello world " * engine.max_model_len
    body = {**BASE[path], field: {"messages": [{"role": "user", "content": text}], "input": text,
                                  "prompt": prompt}[field]}
    for sent in [body, {**body, "max_tokens": None, "max_output_tokens": None}]:
        error = assert_400(server, path, sent, field)
        assert error["code"] == "context_length_exceeded" and "prompt" in error["message"]


def test_a_template_error_from_chat_template_kwargs_names_them(server):
    """The messages render without them: the 400 is about the kwarg, not the messages."""
    error = assert_400(server, CHAT, {**BASE[CHAT], "chat_template_kwargs": {"documents": "x", "fine": 1}},
                       "chat_template_kwargs.documents")
    assert error["message"]


def test_template_kwargs_cannot_set_render_arguments(server):
    body = {**BASE[CHAT], "chat_template_kwargs": {"padding": "max_length", "max_length": 10**9}}
    assert_400(server, CHAT, body, "chat_template_kwargs.max_length")
    assert post(server, CHAT, {**BASE[CHAT], "chat_template_kwargs": {"anything": [1, {"x": None}]}})[0] == 200


def test_an_authorization_header_that_is_not_utf8_is_a_401(start_server):
    live = start_server(api_key="secret")
    status, headers, raw = raw_request(live, "POST", CHAT, json.dumps(BASE[CHAT]),
                                       {"Authorization": "Bearer \xff\xfe".encode("latin-1")})
    assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key"


# -- Content-Encoding -------------------------------------------------------------------------------------


async def _bad_then_good(url: str, headers: dict, body: bytes) -> tuple[int, dict, int, int]:
    """A request, then a good one on the same keep-alive connection -> (status, body, 2nd status, connections)."""
    connections = []

    async def on_connection(session, context, params):
        connections.append(params)

    trace = aiohttp.TraceConfig()
    trace.on_connection_create_end.append(on_connection)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1), trace_configs=[trace]) as session:
        async with session.post(url, data=body, headers={"Content-Type": "application/json", **headers}) as first:
            status, data = first.status, await first.json(content_type=None)
        async with session.post(url, json=BASE[COMPLETIONS]) as second:
            await second.read()
            return status, data, second.status, len(connections)


ENCODED = json.dumps(BASE[COMPLETIONS]).encode()
ENCODINGS = [
    ({"Content-Encoding": "gzip"}, ENCODED, 400),
    ({"Content-Encoding": "deflate"}, ENCODED, 400),
    ({"Content-Encoding": "gzip"}, gzip.compress(ENCODED)[:-12], 400),  # truncated
    ({"Content-Encoding": "br"}, ENCODED, 415),
    ({"Content-Encoding": "zstd"}, ENCODED, 415),
    ({"Content-Encoding": "gzip, xyz"}, ENCODED, 415),
    ({"Content-Encoding": "gzip"}, gzip.compress(ENCODED), 200),
    ({"Content-Encoding": "GZIP"}, gzip.compress(ENCODED), 200),
    ({"Content-Encoding": "x-gzip"}, gzip.compress(ENCODED), 200),
    ({"Content-Encoding": "deflate"}, zlib.compress(ENCODED), 200),
    ({"Content-Encoding": "deflate"}, zlib.compress(ENCODED)[2:-4], 200),  # raw deflate, as some clients send
    ({"Content-Encoding": "gzip, gzip"}, gzip.compress(gzip.compress(ENCODED)), 415),  # one layer, as browsers send
    ({"Content-Encoding": "identity"}, ENCODED, 200),
]


@pytest.mark.parametrize("headers,body,status", ENCODINGS, ids=[f"{i}-{h['Content-Encoding']}-{s}"
                                                                 for i, (h, _, s) in enumerate(ENCODINGS)])
def test_content_encoding_is_decoded_or_a_json_4xx_and_the_connection_lives_on(server, headers, body, status):
    got, data, second, num_connections = asyncio.run(_bad_then_good(server.url + COMPLETIONS, headers, body))
    assert got == status, data
    if status != 200:
        assert data["error"]["message"] and set(data["error"]) == {"message", "type", "param", "code"}
    assert second == 200 and num_connections == 1


def test_a_small_gzip_that_inflates_past_the_body_limit_is_a_413(start_server):
    live = start_server(max_body_size=1000)
    bomb = gzip.compress(json.dumps({**BASE[COMPLETIONS], "prompt": "a" * 100_000}).encode())
    assert len(bomb) < 1000
    status, _, raw = raw_request(live, "POST", COMPLETIONS, bomb, {"Content-Encoding": "gzip"})
    assert status == 413 and json.loads(raw)["error"]["code"] == "request_too_large"


# -- the fuzz -----------------------------------------------------------------------------------------------

ODD_VALUES = [
    None, True, False, 0, 1, -1, 2, 0.5, -0.0, 1.5, 2**31, 2**63, -(2**63) - 1, 2**64, 10**300, 1e308, -1e308,
    1e-320, "", " ", "x", "🎉", "\u0000", "\u202e\u200b", "<|im_end|>", "a" * 5000, [], [None], [[]], [1, "a"],
    [-1], ["x"] * 20, {}, {"type": None}, {"type": "text"}, {"a": {"b": {"c": [1, [2, [3]]]}}}, [{}], [{"role": 1}],
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": 5}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": []}}}, {"json": True}, {"regex": ""},
    {"format": {"type": "json_schema", "name": "x", "schema": {"$ref": "#/nowhere"}}}, {"type": "regex", "regex": "a{99999}"},
    [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}], {"type": "function"},
]
COMMON_FIELDS = [
    "model", "temperature", "top_p", "top_k", "min_p", "n", "stop", "seed", "stream", "stream_options",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "user", "stop_token_ids",
    "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "metadata", "", "min_tokens",
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
]
FIELDS = {
    CHAT: COMMON_FIELDS + ["messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
                           "tool_choice", "response_format", "chat_template_kwargs", "parallel_tool_calls",
                           "prompt_logprobs", "continue_final_message", "add_generation_prompt"],
    COMPLETIONS: COMMON_FIELDS + ["prompt", "max_tokens", "echo", "logprobs", "suffix", "best_of", "response_format",
                                  "prompt_logprobs"],
    RESPONSES: COMMON_FIELDS + ["input", "instructions", "max_output_tokens", "previous_response_id",
                                "conversation", "chat_template_kwargs", "tools", "tool_choice", "text", "store",
                                "parallel_tool_calls"],
}
MESSAGE_FIELDS = {CHAT: ("messages", ["role", "content", "name", "tool_calls", "tool_call_id"]),
                  RESPONSES: ("input", ["role", "content", "type"])}


def fuzz_cases(seed: int = 20240601, values_per_field: int = 3) -> list[tuple[str, object]]:
    """(path, body) pairs: each endpoint's fields (and its messages' fields) set to a few odd values, plus
    bodies that are odd as a whole. Deterministic."""
    rng = random.Random(seed)
    cases: list[tuple[str, object]] = []
    for path, fields in FIELDS.items():
        for name in fields:
            for value in rng.sample(ODD_VALUES, values_per_field):
                cases.append((path, {**BASE[path], name: value}))
    for path, (key, fields) in MESSAGE_FIELDS.items():
        for name in fields:
            for value in rng.sample(ODD_VALUES, values_per_field):
                item = {"role": "user", "content": "hi", name: value}
                cases.append((path, {**BASE[path], key: [item]}))
        for value in rng.sample(ODD_VALUES, values_per_field):  # odd content parts
            cases.append((path, {**BASE[path], key: [{"role": "user", "content": [value]}]}))
            cases.append((path, {**BASE[path], key: [{"role": "user", "content": [{"type": "text", "text": value}]}]}))
    for path in FIELDS:
        for whole in ["null", "[]", '"text"', "3", "true", "{}", "{", '{"a": 1}}', "\ufeff{}", b"\xff\xfe\x00",
                      b"\x1f\x8b\x08\x00", '{"model": "a", "model": 5}']:
            cases.append((path, whole))
        mixed = dict(BASE[path])
        for name in rng.sample(FIELDS[path], 4):  # several odd fields at once
            mixed[name] = rng.choice(ODD_VALUES)
        cases.append((path, mixed))
    return cases


def test_the_fuzz_is_bounded():
    cases = fuzz_cases()
    assert 200 <= len(cases) <= 500 and cases == fuzz_cases()


def test_fuzzed_bodies_get_a_200_or_a_4xx_error_body(server, engine, monkeypatch):
    monkeypatch.setattr(engine, "sampling_defaults", {"max_tokens": 2})  # a max_tokens fuzzed away stays quick
    statuses = []
    for path, body in fuzz_cases():
        status, _ = post(server, path, body)
        statuses.append(status)
    assert statuses.count(200) > 50 and statuses.count(400) > 100  # the fuzz reaches both sides
    assert post(server, CHAT, BASE[CHAT])[0] == 200
    assert wait_until_idle(engine), "a fuzzed request leaked KV blocks"


ODD_HTTP = [
    # (method, path, headers, body)
    ("GET", CHAT, {}, None),
    ("PUT", COMPLETIONS, {"Content-Type": "application/json"}, json.dumps(BASE[COMPLETIONS])),
    ("DELETE", RESPONSES, {}, None),
    ("PATCH", CHAT, {}, "{}"),
    ("OPTIONS", CHAT, {}, None),
    ("PROPFIND", CHAT, {}, None),
    ("POST", CHAT + "/", {}, "{}"),
    ("POST", "/v1/chat/completions?stream=true&x=%00", {}, json.dumps(BASE[CHAT])),
    ("POST", "/v1/%00%ff", {}, "{}"),
    ("POST", "/v1/models", {}, "{}"),
    ("GET", "/v1/models/" + "x" * 300, {}, None),
    ("GET", "/v1/models/%2e%2e%2f%2e%2e%2fetc", {}, None),
    ("POST", COMPLETIONS, {"Content-Type": "text/plain"}, json.dumps(BASE[COMPLETIONS])),
    ("POST", COMPLETIONS, {"Content-Type": "application/x-www-form-urlencoded"}, "prompt=hi&max_tokens=2"),
    ("POST", COMPLETIONS, {"Content-Type": "multipart/form-data; boundary=x"}, "--x\r\n\r\nhi\r\n--x--\r\n"),
    ("POST", COMPLETIONS, {"Content-Type": "application/json; charset=latin-1"}, json.dumps(BASE[COMPLETIONS])),
    ("POST", COMPLETIONS, {}, None),
    ("POST", COMPLETIONS, {"Accept": "text/html"}, "{"),
    ("POST", COMPLETIONS, {"Authorization": "Bearer \u00e9"}, json.dumps(BASE[COMPLETIONS])),
    ("POST", COMPLETIONS, {"Content-Encoding": ""}, json.dumps(BASE[COMPLETIONS])),
    ("POST", COMPLETIONS, {"Content-Encoding": "gzip"}, b""),
    ("POST", COMPLETIONS, {"X-Odd": "\u00ff" * 1000}, json.dumps(BASE[COMPLETIONS])),
]


@pytest.mark.parametrize("method,path,headers,body", ODD_HTTP, ids=[f"{m} {p[:40]}" for m, p, _, _ in ODD_HTTP])
def test_odd_http_gets_a_json_answer(server, method, path, headers, body):
    status, response_headers, raw = raw_request(server, method, path, body,
                                                {k: v.encode("latin-1") for k, v in headers.items()})
    assert_clean(status, response_headers, raw, (method, path))


def test_http_aiohttp_cannot_parse_is_a_4xx_and_the_server_goes_on(server):
    """Malformed HTTP never reaches the app: aiohttp's parser answers it (a plain-text 400) and closes the
    connection; other connections are not disturbed."""
    for request_line, headers in [(b"FOO / HTTP/1.1", b""), (b"POST /v1/completions HTTP/1.1", b"Bad Header\r\n"),
                                  (b"POST /v1/completions HTTP/1.1", b"Content-Length: -5\r\n")]:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.connect()
        conn.sock.sendall(request_line + b"\r\nHost: x\r\n" + headers + b"\r\n")
        response = http.client.HTTPResponse(conn.sock)
        response.begin()
        assert 400 <= response.status < 500
        conn.close()
    assert post(server, COMPLETIONS, BASE[COMPLETIONS])[0] == 200


def test_chunked_bodies_are_read(server):
    chunks = iter([b'{"prompt": "hi", ', b'"max_tokens": 2}'])
    status, headers, raw = raw_request(server, "POST", COMPLETIONS, chunks, {"Content-Type": "application/json"},
                                       chunked=True)
    assert status == 200, raw


MCP_FIELDS = ["server_label", "server_url", "allowed_tools", "require_approval", "headers", "authorization",
              "connector_id"]


def test_fuzzed_mcp_tools_and_items_get_a_200_or_a_4xx(start_server, async_engine, engine, monkeypatch):
    """Odd `mcp` tool fields, `max_tool_calls` and approval items, on a server with the toy MCP server configured
    and every URL allowed (so odd URLs reach the connection code)."""
    from test_responses_mcp import _state

    monkeypatch.setattr(engine, "sampling_defaults", {"max_tokens": 2})
    live = start_server(_state(async_engine, allow_url_patterns=("*",), timeout_s=2))
    rng = random.Random(7)
    statuses = []
    for path in (CHAT, RESPONSES):
        for name in MCP_FIELDS:
            for value in rng.sample(ODD_VALUES, 4):
                tool = {"type": "mcp", "server_label": "toy", "allowed_tools": ["pick"], name: value}
                statuses.append(post(live, path, {**BASE[path], "tools": [tool]})[0])
        for value in rng.sample(ODD_VALUES, 4):
            statuses.append(post(live, path, {**BASE[path], "max_tool_calls": value,
                                              "tools": [{"type": "mcp", "server_label": "toy"}]})[0])
    for name in ["approval_request_id", "approve", "reason"]:
        for value in rng.sample(ODD_VALUES, 4):
            item = {"type": "mcp_approval_response", "approval_request_id": "mcpr_x", "approve": True, name: value}
            statuses.append(post(live, RESPONSES, {**BASE[RESPONSES], "input": [item]})[0])
    for kind in ["mcp_call", "mcp_list_tools", "mcp_approval_request"]:
        for value in rng.sample(ODD_VALUES, 4):
            item = {"type": kind, "id": value, "name": value, "arguments": value, "server_label": value, "output": value}
            statuses.append(post(live, RESPONSES, {**BASE[RESPONSES], "input": [item]})[0])
    assert statuses.count(200) > 5 and statuses.count(400) > 30  # the fuzz reaches both sides
    assert post(live, RESPONSES, BASE[RESPONSES])[0] == 200
    assert wait_until_idle(engine), "a fuzzed request leaked KV blocks"


def test_a_response_input_the_chat_template_rejects_names_input(server):
    """Only a reasoning item: no message for the template, whose error names the Responses field, not `messages`."""
    error = assert_400(server, RESPONSES, {**BASE[RESPONSES], "input": [{"type": "reasoning", "summary": []}]}, "input")
    assert "chat template" in error["message"]


def _send_slowly(server, path: str, pieces: list[bytes], pause: float, length: int | None = None,
                 content_type: str = "application/json"):
    """POST `pieces` of a body `pause` seconds apart under a Content-Length of `length` (all the pieces' by
    default); the status and the parsed body of the answer."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.connect()
    total = sum(map(len, pieces)) if length is None else length
    conn.sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
                      f"Content-Length: {total}\r\n\r\n".encode())
    for piece in pieces:
        conn.sock.sendall(piece)
        time.sleep(pause)
    response = http.client.HTTPResponse(conn.sock)
    response.begin()
    status, body = response.status, json.loads(response.read())
    conn.close()
    return status, body


@pytest.mark.parametrize("path", [COMPLETIONS, "/v1/audio/transcriptions"])
def test_a_body_that_stops_arriving_is_a_408_and_a_slow_one_that_keeps_coming_is_read(server, monkeypatch, path):
    """A client that sends part of its body and then nothing holds no handler for ever (a 408 once no byte came
    for the idle limit, here 0.5 s), while a body that keeps arriving, however slowly, is read to its end."""
    from tfserve.server import body as body_module

    monkeypatch.setattr(body_module, "BODY_IDLE_TIMEOUT_S", 0.5)
    start = time.monotonic()
    if path == COMPLETIONS:
        status, answer = _send_slowly(server, path, [b'{"prompt": "hi", '], 0, length=1000)
    else:  # the multipart form of a transcription, its first field half sent
        status, answer = _send_slowly(server, path, [b'--xyz\r\nContent-Disposition: form-data; name="model"\r\n'],
                                      0, length=1000, content_type="multipart/form-data; boundary=xyz")
    assert status == 408 and answer["error"]["code"] == "request_timeout", answer
    assert "stopped arriving" in answer["error"]["message"] and time.monotonic() - start < 10
    if path == COMPLETIONS:  # eight pieces 0.25 s apart: 2 s in all, four times the idle limit
        raw = json.dumps({**BASE[COMPLETIONS], "max_tokens": 2}).encode()
        pieces = [raw[len(raw) * i // 8:len(raw) * (i + 1) // 8] for i in range(8)]
        status, answer = _send_slowly(server, path, pieces, 0.25)
        assert status == 200, answer
    assert post(server, COMPLETIONS, BASE[COMPLETIONS])[0] == 200
