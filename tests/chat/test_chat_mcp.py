"""The chat's MCP agent loop: a scripted OpenAI-compatible server (aiohttp, streaming SSE) answers first with tool
calls, then with text; the calls run on the real toy MCP server of tests/mcp over stdio, typed approvals come in
through prompt-toolkit's pipe input, and what the chat prints is captured as text."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from tiny import run_keys
from typer.testing import CliRunner

from tfserve.chat.agent import CANCELLED, DECLINED, MAX_TOOL_ROUNDS, NOT_RUN
from tfserve.chat.backend import ReplyStats
from tfserve.chat.client import RemoteBackend
from tfserve.chat.mcp_tools import McpToolbox, function_names
from tfserve.chat.session import ChatSession
from tfserve.cli import app
from tfserve.mcp.config import parse_mcp_config

TOY_SERVER = Path(__file__).parents[1] / "mcp" / "toy_server.py"
TOY = {"command": sys.executable, "args": [str(TOY_SERVER)]}
ADD = ("add", {"a": 1000, "b": 2345})  # the toy server answers 3345: only a real call can say that


class FakeOpenAI:
    """A scripted OpenAI-compatible server on a free port: each chat completion streams the next step of
    `script` (a string: text; a list of (name, arguments): tool calls; the last step repeats) and every
    request body is kept in `requests`."""

    def __init__(self, script: list) -> None:
        from aiohttp import web

        self.script, self.requests = list(script), []
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start():
            runner = web.AppRunner(app, shutdown_timeout=0.5)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            return runner

        self.runner = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def _models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def _chat(self, request):
        from aiohttp import web

        self.requests.append(await request.json())
        step = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in self._chunks(step, len(self.requests)):
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    @staticmethod
    def _chunks(step, num: int) -> list[dict]:
        def chunk(delta, finish=None):
            return {"id": f"chatcmpl-{num}", "object": "chat.completion.chunk", "created": 0, "model": "fake",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

        if isinstance(step, str):
            chunks = [chunk({"role": "assistant", "content": word}) for word in step.split(" ")[:1]]
            chunks += [chunk({"content": " " + word}) for word in step.split(" ")[1:]]
            chunks.append(chunk({}, "stop"))
        else:
            chunks = []
            for i, (name, arguments) in enumerate(step):
                call = {"index": i, "id": f"call_{num}_{i}", "type": "function",
                        "function": {"name": name, "arguments": ""}}
                chunks.append(chunk({"role": "assistant", "tool_calls": [call]}))
                text = json.dumps(arguments)  # the arguments arrive in two pieces, as servers stream them
                for piece in (text[:len(text) // 2], text[len(text) // 2:]):
                    chunks.append(chunk({"tool_calls": [{"index": i, "function": {"arguments": piece}}]}))
            chunks.append(chunk({}, "tool_calls"))
        usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
        return [*chunks, {"id": f"chatcmpl-{num}", "object": "chat.completion.chunk", "created": 0,
                          "model": "fake", "choices": [], "usage": usage}]

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def fake():
    servers = []

    def make(*script) -> FakeOpenAI:
        servers.append(FakeOpenAI(list(script)))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


@pytest.fixture(scope="module")
def errlog(tmp_path_factory):
    with open(tmp_path_factory.mktemp("mcp") / "stderr.log", "w") as f:
        yield f


def start_toolbox(errlog, servers: dict | None = None, **kwargs) -> McpToolbox:
    toolbox = McpToolbox(parse_mcp_config({"mcpServers": servers or {"toy": TOY}}), errlog=errlog, **kwargs)
    toolbox.start()
    return toolbox


@pytest.fixture(scope="module")
def toolbox(errlog):
    """The toy server over stdio, shared by the tests that do not break it."""
    toolbox = start_toolbox(errlog, timeout_s=10)
    yield toolbox
    toolbox.close()


def chat(fake_server: FakeOpenAI, console, toolbox: McpToolbox, **kwargs) -> ChatSession:
    return ChatSession(RemoteBackend(fake_server.url).connect(), console, tools=toolbox, **kwargs)


def tool_messages(request: dict) -> list[str]:
    return [m["content"] for m in request["messages"] if m["role"] == "tool"]


def test_a_call_runs_after_y_and_its_result_goes_back_to_the_model(fake, console, toolbox):
    server = fake([ADD], "The sum is 3345.")
    session = chat(server, console, toolbox)
    out = run_keys(session, "add them\ry\r/exit\r")
    first, second = server.requests
    offered = {t["function"]["name"]: t["function"] for t in first["tools"]}
    assert {"add", "echo", "slow"} <= offered.keys() and all(t["type"] == "function" for t in first["tools"])
    assert offered["add"]["description"] == "Add two integers."
    assert offered["add"]["parameters"]["properties"].keys() == {"a", "b"}
    user, assistant, tool = second["messages"]
    assert user == {"role": "user", "content": "add them"}
    assert assistant["role"] == "assistant" and assistant["content"] is None
    assert assistant["tool_calls"] == [{"id": "call_1_0", "type": "function",
                                        "function": {"name": "add", "arguments": json.dumps(ADD[1])}}]
    assert tool == {"role": "tool", "tool_call_id": "call_1_0", "content": "3345"}
    assert "add · toy" in out and '"a": 1000' in out and '"b": 2345' in out  # the call's panel
    assert "result" in out and "3345" in out and "The sum is 3345." in out
    assert [t["role"] for t in session.conversation.turns] == ["user", "assistant", "tool", "assistant"]
    assert session.conversation.turns[-1]["content"] == "The sum is 3345."


def test_set_tool_choice_required_forces_the_first_reply_of_a_message_only(fake, console, toolbox):
    server = fake([ADD], "The sum is 3345.", "Hello.")
    session = chat(server, console, toolbox, auto_approve=True)
    out = run_keys(session, "/set tool_choice required\radd them\rhi\r/set tool_choice sometimes\r/exit\r")
    assert [r.get("tool_choice") for r in server.requests] == ["required", None, "required"]
    assert "tool_choice = required" in out and "tool_choice is one of auto, required, none" in out


def test_n_declines_and_the_model_is_told(fake, console, toolbox):
    server = fake([ADD], "As you wish.")
    out = run_keys(chat(server, console, toolbox), "add them\rn\r/exit\r")
    assert tool_messages(server.requests[1]) == [DECLINED]
    body = out.split("\n", 1)[1]  # past the banner, whose URL's random port may hold the digits
    assert "Declined." in out and "3345" not in body and "As you wish." in out


def test_always_runs_this_call_and_every_later_one_without_asking(fake, console, toolbox):
    server = fake([ADD, ("add", {"a": 1, "b": 2})], [("add", {"a": 5, "b": 5})], "done")
    session = chat(server, console, toolbox)
    # had a later call asked, it would have taken "/exit" as its answer, and declined
    out = run_keys(session, "go\ra\r/settings\r/set approve ask\r/set approve maybe\r/exit\r")
    assert tool_messages(server.requests[1]) == ["3345", "3"]
    assert tool_messages(server.requests[2]) == ["3345", "3", "10"]
    assert len(server.requests) == 3 and "done" in out
    assert "Tools run without asking from now on" in out and "approve = ask" in out
    assert re.search(r"^approve\s+auto\s*$", out, re.MULTILINE)  # /settings, before the /set
    assert "Error: approve is auto (run MCP tools without asking) or ask (got 'maybe')" in out
    assert session.auto_approve is False


def test_yes_never_asks_and_tools_lists_the_servers(fake, console, toolbox):
    server = fake([ADD], "ok")
    session = chat(server, console, toolbox, auto_approve=True)
    out = run_keys(session, "/tools\rgo\r/exit\r")
    assert f"MCP: {len(toolbox.tools)} tools from 1 server (run without asking)" in out  # the banner
    listing = out[out.index("/tools lists them") + len("/tools lists them"):out.index("approve: auto")]
    assert re.search(r"^toy\s+running", listing, re.MULTILINE)
    for name, summary in [("add", "Add two integers."), ("echo", "Return the text unchanged."),
                          ("slow", "Sleep, then answer.")]:
        assert name in listing and summary in listing
    assert tool_messages(server.requests[1]) == ["3345"]


def test_crash_and_timeout_are_error_panels_and_the_loop_goes_on(fake, console, errlog):
    toolbox = start_toolbox(errlog, timeout_s=0.5)
    try:
        server = fake([("crash", {})], [("slow", {"seconds": 5})], [ADD], "all done")
        out = run_keys(chat(server, console, toolbox, auto_approve=True), "try things\r/exit\r")
    finally:
        toolbox.close()
    crashed, timed_out, added = tool_messages(server.requests[3])
    assert crashed.startswith("Error: ") and "closed the connection during 'crash'" in crashed
    assert timed_out == "Error: tool 'slow' timed out after 0.5 s"
    assert added == "3345"  # the crashed server was started again for the next call
    assert out.count("error") >= 2 and "timed out after 0.5 s" in out and "all done" in out


def test_a_server_that_fails_to_start_is_reported_and_clashing_names_are_prefixed(fake, console, errlog, tmp_path):
    late = tmp_path / "late_server.py"  # missing at start: that server fails; /tools starts it once it is there
    servers = {"a": TOY, "b": TOY, "late": {"command": sys.executable, "args": [str(late)]}}
    toolbox = McpToolbox(parse_mcp_config({"mcpServers": servers}), errlog=errlog)
    try:
        errors = toolbox.start()
        assert list(errors) == ["late"] and "failed to start" in errors["late"]
        assert {"a__add", "b__add", "a__echo", "b__echo"} <= toolbox.tools.keys() and "add" not in toolbox.tools
        assert toolbox.tools["b__add"].label == "b" and toolbox.tools["b__add"].tool.name == "add"
        server = fake([("b__add", ADD[1])], "ok")
        out = run_keys(chat(server, console, toolbox, auto_approve=True), "/tools\rgo\r/exit\r")
        assert tool_messages(server.requests[1]) == ["3345"]
        assert "b__add · b" in out
        assert re.search(r"^late\s+stopped\s+MCP server 'late' failed to start", out, re.MULTILINE)  # /tools
        assert not any(t["function"]["name"].startswith("late") for t in server.requests[0]["tools"])

        late.write_text(TOY_SERVER.read_text())
        out = run_keys(chat(server, console, toolbox), "/tools\r/exit\r")
        assert re.search(r"^late\s+running\s*$", out, re.MULTILINE) and "late__add" in toolbox.tools
        assert toolbox.errors == {}
    finally:
        toolbox.close()


def test_function_names_are_unique_and_valid():
    from tfserve.mcp.client import McpTool

    def tool(name):
        return McpTool(name=name, description=None, input_schema={})

    names = function_names({"x": (tool("read"), tool("dots.in/name")), "y.z": (tool("read"), tool("only_y")),
                            "w": (tool("a" * 80), tool("a" * 80))})
    long = "w__" + "a" * 61  # cut to OpenAI's 64 characters; the second one alike gets a suffix
    assert list(names) == ["x__read", "dots_in_name", "y_z__read", "only_y", long, long[:62] + "_2"]
    assert names["y_z__read"].label == "y.z" and names["dots_in_name"].tool.name == "dots.in/name"
    assert names["only_y"].to_openai() == {"type": "function", "function": {
        "name": "only_y", "description": "", "parameters": {"type": "object", "properties": {}}}}


def test_the_loop_stops_after_max_rounds_with_every_call_answered(fake, console, toolbox):
    server = fake([ADD])  # a model that never stops calling
    session = chat(server, console, toolbox, auto_approve=True)
    out = run_keys(session, "loop\r/exit\r")
    assert len(server.requests) == MAX_TOOL_ROUNDS
    assert f"Stopped after {MAX_TOOL_ROUNDS} rounds of tool calls" in out
    roles = [t["role"] for t in session.conversation.turns]
    assert roles == ["user"] + ["assistant", "tool"] * MAX_TOOL_ROUNDS


def test_ctrl_c_during_a_tool_call_cancels_it_and_answers_every_call(fake, console, toolbox):
    server = fake([("slow", {"seconds": 30}), ADD], "never asked")
    session = chat(server, console, toolbox, auto_approve=True)

    async def num_calls_running():
        return sum(t.get_coro().__qualname__ == "McpServers.call_tool" for t in asyncio.all_tasks())

    done = threading.Event()

    def ctrl_c_once_the_slow_call_runs():  # not on a timer: a slow start would send it to the prompt instead
        while not done.is_set():
            if toolbox._run(num_calls_running(), 5):
                time.sleep(0.2)  # the call is on its way to the server
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.02)

    sender = threading.Thread(target=ctrl_c_once_the_slow_call_runs, daemon=True)
    sender.start()
    try:
        out = run_keys(session, "go\r/exit\r")
    finally:
        done.set()
        sender.join(10)
    assert "[cancelled]" in out and len(server.requests) == 1
    assistant, slow, add = session.conversation.turns[1:]
    assert [c["id"] for c in assistant["tool_calls"]] == [slow["tool_call_id"], add["tool_call_id"]]
    assert (slow["content"], add["content"]) == (CANCELLED, NOT_RUN)
    assert toolbox.call(toolbox.tools["add"], {"a": 1, "b": 2}).output == "3"  # the toolbox still works

    deadline = time.monotonic() + 5
    while toolbox._run(num_calls_running()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert toolbox._run(num_calls_running()) == 0  # the slow call was cancelled, not left running


def test_ctrl_c_while_calls_stream_keeps_the_text_and_drops_the_calls(console, toolbox):
    class Backend:
        model, label = "scripted", "scripted"

        def list_models(self):
            return ["scripted"]

        def stream(self, messages, settings, tools=None, tool_choice="auto"):
            class Reply:
                stats = ReplyStats(tool_calls=[{"id": "c", "type": "function",
                                                "function": {"name": "add", "arguments": '{"a": 1'}}])

                def __iter__(self):
                    yield "Let me add"
                    raise KeyboardInterrupt

                def close(self):
                    pass

            return Reply()

        def close(self):
            pass

    session = ChatSession(Backend(), console, tools=toolbox, auto_approve=True)
    out = run_keys(session, "go\r/exit\r")
    assert "[cancelled]" in out
    assert session.conversation.turns[1:] == [{"role": "assistant", "content": "Let me add"}]


runner = CliRunner()


def invoke(*args: str, input: str | None = None):
    return runner.invoke(app, ["chat", *args], input=input, env={"COLUMNS": "200"}, prog_name="tfserve")


@pytest.mark.parametrize("content, expected", [
    (None, "cannot read the MCP config: No such file or directory"),
    ("{not json", "not valid JSON"),
    ('{"mcpServers": {"x": {"args": ["a"]}}}', 'mcpServers.x: needs a "command"'),
])
def test_a_bad_mcp_config_is_one_line_and_exit_1(tmp_path, content, expected):
    path = tmp_path / "mcp.json"
    if content is not None:
        path.write_text(content)
    result = invoke("127.0.0.1:1", "--mcp-config", str(path), input="hello\n")  # checked before connecting
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"Error: --mcp-config: {path}") and expected in lines[0]
    assert "Traceback" not in result.output


@pytest.mark.parametrize("yes", [True, False])
def test_piped_mode_runs_tools_only_with_yes(fake, tmp_path, yes):
    config = tmp_path / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {"toy": TOY, "broken": {"command": str(tmp_path / "nothing")}}}))
    server = fake([ADD], "The sum is 3345.")
    args = ["--mcp-config", str(config), *(["--yes"] if yes else [])]
    result = invoke(server.url, *args, input="add them\n")
    assert result.exit_code == 0, result.output
    assert result.stdout == "The sum is 3345.\n"  # answers only; panels and notes go to stderr
    assert "MCP server 'broken' failed to start" in result.stderr and "Warning" in result.stderr
    assert "add · toy" in result.stderr
    if yes:
        assert tool_messages(server.requests[1]) == ["3345"] and "3345" in result.stderr
    else:
        assert tool_messages(server.requests[1]) == [DECLINED]
        assert "Declined add: without a terminal, tools run only with --yes." in result.stderr


def test_in_process_replies_keep_tool_calls_out_of_the_text(tokenizer):
    import queue

    from tfserve.chat.local import _LocalReply
    from tfserve.engine.request import RequestOutput
    from tfserve.protocol.reply import ReplyParser
    from tfserve.protocol.tool_formats import detect_format

    aborted = []

    class Manager:
        def abort(self, request_id):
            aborted.append(request_id)

    outputs = queue.SimpleQueue()
    pieces = ["Let me add.", '\n<tool_call>{"name": "add", ', '"arguments": {"a": 1, "b": 2}}</tool_call>']
    for i, piece in enumerate(pieces):
        outputs.put(RequestOutput("r", [1], list(range(i + 1)), "", delta_text=piece,
                                  finish_reason="stop" if i == len(pieces) - 1 else None))
    reply = _LocalReply(Manager(), "r", outputs, ReplyStats(num_prompt_tokens=3),
                        ReplyParser(detect_format(tokenizer)))
    assert "".join(reply) == "Let me add."
    (call,) = reply.stats.tool_calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert reply.stats.finish_reason == "tool_calls" and reply.stats.num_completion_tokens == 3
    reply.close()
    assert aborted == []  # the engine had finished it


def only(toolbox: McpToolbox, name: str, monkeypatch) -> None:
    """Offer just one of the toolbox's tools: the tiny model's context (512 tokens) cannot hold them all."""
    monkeypatch.setattr(toolbox, "tools", {name: toolbox.tools[name]})
    monkeypatch.setattr(toolbox, "refresh", lambda: None)


def test_in_process_chat_renders_tools_and_tool_results(async_engine, console, toolbox, monkeypatch):
    from tiny import MODEL_NAME

    from tfserve.chat.conversation import Settings
    from tfserve.chat.local import LocalBackend, _template_message

    backend = LocalBackend(async_engine.manager, MODEL_NAME)
    settings = Settings(temperature=0.0, max_tokens=4)
    history = [{"role": "user", "content": "add"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "3"}]

    def num_prompt_tokens(messages, tools=None):
        reply = backend.stream(messages, settings, tools)
        text = "".join(reply)
        reply.close()
        assert isinstance(text, str)
        return reply.stats.num_prompt_tokens

    only(toolbox, "add", monkeypatch)
    plain = num_prompt_tokens(history[:1])
    assert num_prompt_tokens(history[:1], toolbox.openai_tools()) > plain + 50  # the tools are in the prompt
    assert num_prompt_tokens(history) > plain + 10  # the call and its result too
    rendered = _template_message(history[1])  # templates read arguments as a mapping (HF's convention)
    assert rendered["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2} and rendered["content"] == ""
    assert history[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1, "b": 2}'  # the conversation's own
    session = ChatSession(backend, console, tools=toolbox, settings=settings)
    assert session.ask("hello") and session.conversation.turns[-1]["role"] == "assistant"


def test_a_real_tfserve_server_makes_a_forced_call_and_takes_its_result(server, console, toolbox, monkeypatch):
    """The tiny random model, forced by tool_choice on the first request: its call runs on the toy server and the
    server accepts the conversation with the call and its result."""
    from tfserve.chat.conversation import Settings

    backend = RemoteBackend(server.url).connect()
    create, forced = backend._create, iter([{"tool_choice": {"type": "function", "function": {"name": "pick"}}}])
    monkeypatch.setattr(backend, "_create", lambda messages, kwargs: create(messages, {**kwargs, **next(forced, {})}))

    only(toolbox, "pick", monkeypatch)
    session = ChatSession(backend, console, tools=toolbox, settings=Settings(temperature=0.0, max_tokens=64),
                          auto_approve=True)
    out = run_keys(session, "pick a colour\r/exit\r")
    user, assistant, tool = session.conversation.turns[:3]
    (call,) = assistant["tool_calls"]
    assert call["function"]["name"] == "pick" and json.loads(call["function"]["arguments"])["color"] in ("red", "blue")
    assert tool == {"role": "tool", "tool_call_id": call["id"],
                    "content": f"picked {json.loads(call['function']['arguments'])['color']}"}
    assert "pick · toy" in out and session.stats.num_errors == 0 and session.stats.num_replies >= 2
