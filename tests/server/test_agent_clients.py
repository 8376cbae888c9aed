"""Agent frameworks and client libraries, unmodified and used as their users use them, against one real
`tfserve serve` on the default model: openai-agents (a Chat Completions model and a Responses model, a streamed
run with a pydantic `output_type`, a tool of a local stdio MCP server), instructor (`response_model` in TOOLS and
JSON_SCHEMA modes), pydantic-ai (tool and native structured output), langchain-openai on the Responses API,
litellm (whole, streamed, `response_format`), smolagents (`OpenAIServerModel`, one `ToolCallingAgent` step) and
simonw's llm (an OpenAI-compatible model from `extra-openai-models.yaml`). Replies are held to schemas, enums or
forced tool calls, so what is asserted is what the server guarantees, not what a 135M model knows. Tracing and
telemetry are off; nothing leaves 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Literal

import pytest
from pydantic import BaseModel

from mcp_servers import toy_stdio_config
from tiny import ServeProcess

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
QUESTION = "Is it windy in Paris today?"


class Weather(BaseModel):
    """The structured answer every library asks for: an enum and a boolean, so only a constrained reply parses."""

    city: Literal["Paris", "Rome"]
    windy: bool


@pytest.fixture(scope="module")
def base_url(default_model_dir):
    """`tfserve serve` (the default model, from the session's store) in a process of its own: its /v1 URL."""
    env = {**os.environ, "TFSERVE_HOME": str(default_model_dir.parents[1])}
    with ServeProcess(["--kv-cache-memory", "256MiB"], env, timeout=300) as served:
        yield f"http://127.0.0.1:{served.port}/v1"


@pytest.fixture(scope="module")
def openai_agents():
    """openai-agents with its tracing (an upload to OpenAI) off."""
    import agents

    agents.set_tracing_disabled(True)
    return agents


def _agents_model(agents, kind: str, base_url: str):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=300)
    model_class = agents.OpenAIChatCompletionsModel if kind == "chat" else agents.OpenAIResponsesModel
    return model_class(model=MODEL, openai_client=client)


@pytest.mark.parametrize("kind", ["chat", "responses"])
def test_openai_agents_streamed_run_with_output_type(openai_agents, base_url, kind):
    """`Runner.run_streamed` with `output_type`: the schema reaches the server, the text streams as deltas, and
    the deltas joined are the JSON the agent parsed into its final output."""
    agents = openai_agents

    async def run():
        agent = agents.Agent(name="forecaster", instructions="Answer in JSON.", output_type=Weather,
                             model=_agents_model(agents, kind, base_url),
                             model_settings=agents.ModelSettings(temperature=0, max_tokens=60))
        result = agents.Runner.run_streamed(agent, QUESTION)
        deltas = [event.data.delta async for event in result.stream_events()
                  if event.type == "raw_response_event" and event.data.type == "response.output_text.delta"]
        return result, deltas

    result, deltas = asyncio.run(run())
    assert isinstance(result.final_output, Weather)
    assert len(deltas) > 1 and Weather.model_validate_json("".join(deltas)) == result.final_output


@pytest.mark.parametrize("kind", ["chat", "responses"])
def test_openai_agents_calls_a_stdio_mcp_tool(openai_agents, base_url, kind):
    """An agent with a local stdio MCP server: a required tool choice makes the model call its tool, the MCP
    server runs it, and its answer ends the run."""
    agents = openai_agents
    from agents.mcp import MCPServerStdio, create_static_tool_filter

    async def run():
        async with MCPServerStdio(params=toy_stdio_config(), name="toy",
                                  tool_filter=create_static_tool_filter(allowed_tool_names=["pick"])) as toy:
            settings = agents.ModelSettings(temperature=0, max_tokens=100, tool_choice="required",
                                            parallel_tool_calls=False)
            agent = agents.Agent(name="picker", instructions="Use the tools.", mcp_servers=[toy],
                                 model=_agents_model(agents, kind, base_url), model_settings=settings,
                                 tool_use_behavior="stop_on_first_tool")
            return await agents.Runner.run(agent, "Pick a colour.")

    result = asyncio.run(run())
    calls = [item.raw_item for item in result.new_items if item.type == "tool_call_item"]
    outputs = [item.output for item in result.new_items if item.type == "tool_call_output_item"]
    assert [call.name for call in calls] == ["pick"] and len(outputs) == 1
    color = json.loads(calls[0].arguments)["color"]
    assert color in ("red", "blue") and f"picked {color}" in str(outputs[0])  # only the MCP server writes this
    assert f"picked {color}" in result.final_output  # the tool's answer ended the run


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_response_model(base_url, mode):
    """instructor's `response_model`, as a forced tool call (TOOLS) or a JSON-schema response format."""
    import instructor
    from openai import OpenAI

    client = instructor.from_openai(OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=300),
                                    mode=getattr(instructor.Mode, mode))
    weather, completion = client.chat.completions.create_with_completion(
        model=MODEL, response_model=Weather, messages=[{"role": "user", "content": QUESTION}], temperature=0,
        max_tokens=100, max_retries=0)
    assert isinstance(weather, Weather)
    message = completion.choices[0].message
    if mode == "TOOLS":
        assert [call.function.name for call in message.tool_calls] == ["Weather"]
        assert json.loads(message.tool_calls[0].function.arguments) == weather.model_dump()
    else:
        assert json.loads(message.content) == weather.model_dump()


@pytest.mark.parametrize("kind", ["chat", "responses"])
def test_pydantic_ai_agent_output_type(base_url, kind):
    """pydantic-ai's Agent over `OpenAIProvider(base_url=...)`: the Chat model's output tool (forced) and the
    Responses model's native JSON-schema output both parse into the output type."""
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=base_url, api_key="x")
    if kind == "chat":
        agent = Agent(OpenAIChatModel(MODEL, provider=provider), output_type=Weather)
    else:
        agent = Agent(OpenAIResponsesModel(MODEL, provider=provider), output_type=NativeOutput(Weather))
    result = agent.run_sync(QUESTION, model_settings={"temperature": 0, "max_tokens": 100})
    assert isinstance(result.output, Weather)
    replies = [message for message in result.all_messages() if isinstance(message, ModelResponse)]
    assert len(replies) == 1  # one request: the first reply already had the output
    parts = replies[0].parts
    if kind == "chat":
        assert [type(part) for part in parts] == [ToolCallPart] and parts[0].tool_name == "final_result"
    else:
        assert [type(part) for part in parts] == [TextPart]
        assert Weather.model_validate_json(parts[0].content) == result.output


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_responses_api_structured_output(base_url, method):
    """langchain-openai's `ChatOpenAI(use_responses_api=True)`: `with_structured_output` as a JSON-schema text
    format or a forced function call, parsed without error."""
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=MODEL, base_url=base_url, api_key="x", use_responses_api=True, temperature=0,
                      max_tokens=100, max_retries=0)
    reply = chat.with_structured_output(Weather, method=method, include_raw=True).invoke(QUESTION)
    assert reply["parsing_error"] is None and isinstance(reply["parsed"], Weather)
    raw = reply["raw"]
    assert raw.response_metadata["status"] == "completed"
    if method == "function_calling":
        assert [call["name"] for call in raw.tool_calls] == ["Weather"]
        assert raw.tool_calls[0]["args"] == reply["parsed"].model_dump()
    else:
        assert json.loads(raw.text) == reply["parsed"].model_dump()


def test_langchain_responses_api_stream(base_url):
    """`ChatOpenAI(use_responses_api=True).stream`: text chunks that add up to the whole reply, and its usage."""
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=MODEL, base_url=base_url, api_key="x", use_responses_api=True, temperature=0,
                      max_tokens=5, max_retries=0)
    whole = chat.invoke("Say hello.")
    assert whole.usage_metadata["output_tokens"] == 5
    assert whole.response_metadata["incomplete_details"] == {"reason": "max_output_tokens"}
    chunks = list(chat.stream("Say hello."))
    assert len([chunk for chunk in chunks if chunk.text]) > 1
    assert "".join(chunk.text for chunk in chunks) == whole.text


@pytest.fixture(scope="module")
def litellm():
    """litellm with its bundled model cost map (no fetch from GitHub) and no telemetry."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # read when litellm is imported
        import litellm

        patch.setattr(litellm, "telemetry", False, raising=False)
        yield litellm


def test_litellm_completion_whole_and_streamed(litellm, base_url):
    """`completion(model="openai/<name>", api_base=...)`: usage and a length finish; streamed, the same text."""
    kwargs = {"model": f"openai/{MODEL}", "api_base": base_url, "api_key": "x", "temperature": 0, "max_tokens": 5,
              "messages": [{"role": "user", "content": "Say hello."}]}
    whole = litellm.completion(**kwargs)
    assert whole.choices[0].finish_reason == "length" and whole.choices[0].message.content
    assert whole.usage.completion_tokens == 5 and whole.usage.prompt_tokens > 5
    chunks = list(litellm.completion(**kwargs, stream=True))
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_litellm_response_format(litellm, base_url):
    """A pydantic `response_format` (litellm sends its JSON schema): the reply validates."""
    reply = litellm.completion(model=f"openai/{MODEL}", api_base=base_url, api_key="x", temperature=0,
                               max_tokens=60, messages=[{"role": "user", "content": QUESTION}],
                               response_format=Weather)
    assert isinstance(Weather.model_validate_json(reply.choices[0].message.content), Weather)


def test_smolagents_server_model_generates(base_url):
    """smolagents' `OpenAIServerModel.generate`: a reply of max_tokens tokens, counted."""
    from smolagents import OpenAIServerModel

    model = OpenAIServerModel(model_id=MODEL, api_base=base_url, api_key="x", temperature=0, max_tokens=8)
    message = model.generate([{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}])
    assert message.content and message.token_usage.output_tokens == 8


def test_smolagents_tool_calling_agent_step(base_url):
    """One step of smolagents' `ToolCallingAgent` (it forces a tool call): the model calls the Python tool,
    which runs."""
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool
    from smolagents.memory import ActionStep

    @tool
    def pick(color: Literal["red", "blue"]) -> str:
        """Pick a colour.

        Args:
            color: the colour to pick.
        """
        return f"picked {color}"

    model = OpenAIServerModel(model_id=MODEL, api_base=base_url, api_key="x", temperature=0, max_tokens=100)
    agent = ToolCallingAgent(tools=[pick], model=model, max_steps=1, verbosity_level=0)
    events = []
    for event in agent.run("Pick a colour.", stream=True):  # stopped after the step: no final-answer call
        events.append(event)
        if isinstance(event, ActionStep):
            break
    step = events[-1]
    assert isinstance(step, ActionStep) and step.error is None
    assert step.tool_calls and {call.name for call in step.tool_calls} == {"pick"}
    colors = [call.arguments["color"] for call in step.tool_calls]
    assert step.observations == "\n".join(f"picked {color}" for color in colors)


@pytest.fixture
def llm_user_path(tmp_path, monkeypatch, base_url):
    """simonw's llm with a user directory of its own whose extra-openai-models.yaml names the server's model."""
    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path))
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: tfserve\n  model_name: {MODEL}\n  api_base: \"{base_url}\"\n  supports_schema: true\n")
    return tmp_path


def test_llm_prompt_stream_and_schema(llm_user_path):
    """llm's Python API on the model from extra-openai-models.yaml: a prompt, the same one streamed, a schema."""
    import llm

    model = llm.get_model("tfserve")
    whole = model.prompt("Say hello.", key="x", temperature=0, max_tokens=5)
    assert whole.text() and whole.usage().output == 5
    streamed = list(model.prompt("Say hello.", key="x", temperature=0, max_tokens=5, stream=True))
    assert len(streamed) > 1 and "".join(streamed) == whole.text()
    shaped = model.prompt(QUESTION, key="x", schema=Weather, temperature=0, max_tokens=60)
    assert isinstance(Weather.model_validate_json(shaped.text()), Weather)
