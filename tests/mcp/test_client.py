"""`McpServers` against the toy server over stdio: listing, calls, and every way a call can go wrong ends in
an error result, never a hang or an exception."""

from __future__ import annotations

import asyncio
import time

import pytest

from tfserve.mcp.client import McpError, McpServers, McpTool
from tfserve.mcp.config import parse_mcp_config

TOY_TOOLS = ["echo", "add", "fail", "slow", "big", "crash", "grow", "header", "pick"]


def run_with(config: dict, errlog, body, **kwargs):
    """Start a manager over `{"toy": config}`, run `body(servers)`, always close it; returns body's result."""

    async def main():
        servers = McpServers(parse_mcp_config({"mcpServers": {"toy": config}}), errlog=errlog, **kwargs)
        try:
            assert await servers.start() == {}
            return await body(servers)
        finally:
            await servers.close()

    return asyncio.run(main())


def test_tools_listed_and_called_end_to_end(stdio_config, errlog):
    async def body(servers):
        tools = await servers.list_tools("toy")
        assert [t.name for t in tools] == TOY_TOOLS and isinstance(tools, tuple)
        add = tools[1]
        assert isinstance(add, McpTool) and add.description == "Add two integers."
        assert add.input_schema["properties"].keys() == {"a", "b"}
        result = await servers.call_tool("toy", "add", {"a": 2, "b": 40})
        assert (result.output, result.is_error, result.error) == ("42", False, None)
        assert (await servers.call_tool("toy", "echo", {"text": "héllo"})).output == "héllo"

    run_with(stdio_config, errlog, body)


def test_tool_error_and_bad_calls_are_error_results(stdio_config, errlog):
    async def body(servers):
        failed = await servers.call_tool("toy", "fail", {"message": "the weather is unknowable"})
        assert failed.is_error and "the weather is unknowable" in failed.error
        missing = await servers.call_tool("toy", "no_such_tool", {})
        assert missing.is_error and missing.error
        unknown = await servers.call_tool("nope", "add", {})
        assert unknown.is_error and "no MCP server named 'nope'" in unknown.error
        with pytest.raises(McpError, match="no MCP server named 'nope'"):
            await servers.list_tools("nope")
        # the server is still fine after all that
        assert (await servers.call_tool("toy", "add", {"a": 1, "b": 1})).output == "2"

    run_with(stdio_config, errlog, body)


def test_slow_tool_times_out_into_an_error_result(stdio_config, errlog):
    async def body(servers):
        start = time.monotonic()
        result = await servers.call_tool("toy", "slow", {"seconds": 30}, timeout_s=0.5)
        assert time.monotonic() - start < 2.0
        assert result.is_error and "timed out after 0.5 s" in result.error
        assert (await servers.call_tool("toy", "add", {"a": 1, "b": 2})).output == "3"  # not wedged

    run_with(stdio_config, errlog, body)


def test_huge_output_is_capped_with_a_note(stdio_config, errlog):
    async def body(servers):
        result = await servers.call_tool("toy", "big", {"num_bytes": 2_000_000}, max_output_bytes=1000)
        assert result.truncated and not result.is_error
        assert result.output.startswith("x" * 1000)
        assert result.output.endswith("[output truncated: 1000 of 2000000 bytes shown]")
        small = await servers.call_tool("toy", "big", {"num_bytes": 10}, max_output_bytes=1000)
        assert (small.output, small.truncated) == ("x" * 10, False)

    run_with(stdio_config, errlog, body)


def test_crashed_server_is_an_error_then_restarted(stdio_config, errlog, tmp_path):
    pid_file = tmp_path / "pids"
    config = {**stdio_config, "args": [*stdio_config["args"], "--pid-file", str(pid_file)]}

    async def body(servers):
        crashed = await servers.call_tool("toy", "crash", {})
        assert crashed.is_error and "closed the connection" in crashed.error
        again = await servers.call_tool("toy", "add", {"a": 3, "b": 4})
        assert (again.output, again.is_error) == ("7", False)
        assert len(pid_file.read_text().split()) == 2  # a new process answered

    run_with(config, errlog, body)


def test_server_that_cannot_start_is_an_error_result(errlog, tmp_path):
    async def main():
        servers = McpServers(parse_mcp_config({"mcpServers": {"gone": {"command": str(tmp_path / "missing")}}}),
                             errlog=errlog)
        try:
            errors = await servers.start()
            assert "failed to start" in errors["gone"]
            result = await servers.call_tool("gone", "add", {})
            assert result.is_error and "failed to start" in result.error
        finally:
            await servers.close()

    asyncio.run(main())


def test_tool_list_cached_and_refreshed_on_list_changed(stdio_config, errlog):
    async def body(servers):
        first = await servers.list_tools("toy")
        assert await servers.list_tools("toy") is first  # cached
        assert (await servers.call_tool("toy", "grow", {"name": "newt"})).output == "grown"
        for _ in range(100):  # the change arrives as its own message, just after the call returns
            tools = await servers.list_tools("toy")
            if "newt" in [t.name for t in tools]:
                break
            await asyncio.sleep(0.02)
        assert [t.name for t in tools] == [*TOY_TOOLS, "newt"]
        assert (await servers.list_tools("toy", refresh=True)) == tools

    run_with(stdio_config, errlog, body)


def test_close_stops_the_stdio_process(stdio_config, errlog, tmp_path):
    import os

    pid_file = tmp_path / "pids"
    config = {**stdio_config, "args": [*stdio_config["args"], "--pid-file", str(pid_file)]}

    async def body(servers):
        await servers.list_tools("toy")
        return int(pid_file.read_text().split()[0])

    pid = run_with(config, errlog, body)
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.02)
    else:
        pytest.fail(f"stdio server {pid} still runs after close()")


def test_server_that_died_while_idle_is_restarted_by_the_next_call(stdio_config, errlog, tmp_path):
    import os
    import signal

    pid_file = tmp_path / "pids"
    config = {**stdio_config, "args": [*stdio_config["args"], "--pid-file", str(pid_file)]}

    async def body(servers):
        await servers.list_tools("toy")
        assert servers.status() == {"toy": "running"}
        os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)
        for _ in range(250):  # the transport notices its stdout ended
            if servers.status() == {"toy": "stopped"}:
                break
            await asyncio.sleep(0.02)
        assert servers.status() == {"toy": "stopped"}
        result = await servers.call_tool("toy", "add", {"a": 1, "b": 2})
        assert (result.output, result.is_error) == ("3", False)
        assert len(pid_file.read_text().split()) == 2

    run_with(config, errlog, body)


def test_server_that_never_answers_times_out_at_connect(errlog):
    import sys

    async def main():
        mute = {"command": sys.executable, "args": ["-c", "import time; time.sleep(60)"]}
        servers = McpServers(parse_mcp_config({"mcpServers": {"mute": mute}}), errlog=errlog, connect_timeout_s=1)
        try:
            start = time.monotonic()
            result = await servers.call_tool("mute", "add", {})
            assert result.is_error and "did not answer within 1 s" in result.error
            assert time.monotonic() - start < 8  # 1 s, then the SDK's bounded stop of the process
        finally:
            await servers.close()

    asyncio.run(main())


def test_concurrent_calls_share_one_server(stdio_config, errlog):
    async def body(servers):
        results = await asyncio.gather(
            servers.call_tool("toy", "slow", {"seconds": 30}, timeout_s=0.5),
            *(servers.call_tool("toy", "add", {"a": i, "b": i}) for i in range(8)),
        )
        assert results[0].is_error and "timed out" in results[0].error
        assert [r.output for r in results[1:]] == [str(2 * i) for i in range(8)]

    run_with(stdio_config, errlog, body)
