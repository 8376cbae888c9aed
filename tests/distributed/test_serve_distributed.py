"""`tfserve serve --tensor-parallel-size 2` on the default model: it answers the openai SDK, and a killed worker
rank makes the server fail cleanly (the request gets an error naming the rank, the process exits non-zero with
one line) within a bounded time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tiny import free_port, wait_healthy

pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _worker_pids(pid: int) -> list[int]:
    """The server's spawned rank processes (not the resource tracker)."""
    found = []
    for child in _children(pid):
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                found.append(child)
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="finds the worker rank through /proc")
def test_served_split_in_two_answers_and_a_dead_rank_stops_it_cleanly(default_model_dir, tmp_path):
    import openai

    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TFSERVE_HOME": str(default_model_dir.parent.parent)}
    process = subprocess.Popen(
        [sys.executable, "-c", "from tfserve.cli import main; main()", "serve", "--port", str(port),
         "--tensor-parallel-size", "2", "--distributed-timeout", "20", "--kv-cache-memory", "64MiB"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(port, [process], timeout=180)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        reply = client.chat.completions.create(
            model="smollm2-135m-instruct", temperature=0, max_tokens=20,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in reply.choices[0].message.content

        (worker,) = _worker_pids(process.pid)
        os.kill(worker, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(openai.APIError) as failed:
            client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=20,
                                           messages=[{"role": "user", "content": "hi"}])
        assert "rank 1" in str(failed.value)
        output, _ = process.communicate(timeout=60)
        assert time.monotonic() - start < 60
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode != 0
    assert "Error: tensor-parallel rank 1 (killed by SIGKILL) failed" in output
    assert "Traceback" not in output


def test_two_nodes_each_run_their_rank_and_stop_with_the_first(tmp_path):
    """`--nnodes 2`: node 0 serves as rank 0, node 1 only runs rank 1; stopping node 0 ends node 1 too."""
    import openai

    from test_tensor_parallel import save_model
    from tfserve.distributed.workers import free_init_method

    path = save_model(tmp_path / "tiny", "LlamaForCausalLM", heads=4, kv_heads=2, vocab=320, tie=False)
    port, init = free_port(), free_init_method()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TFSERVE_HOME": str(tmp_path / "home")}
    common = ["--model", str(path), "-tp", "2", "--nnodes", "2", "--distributed-init-method", init,
              "--kv-cache-memory", "8MiB"]
    nodes = [subprocess.Popen([sys.executable, "-m", "tfserve", "serve", *common, "--node-rank", str(rank),
                               "--port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for rank in (0, 1)]
    try:
        wait_healthy(port, nodes)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        reply = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=5, temperature=0)
        assert reply.usage.completion_tokens == 5
        nodes[0].send_signal(signal.SIGINT)
        outputs = [node.communicate(timeout=60)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert [node.returncode for node in nodes] == [0, 0], outputs


@pytest.mark.parametrize("flags,message", [
    (["-tp", "2", "--nnodes", "3"], "--nnodes must divide tensor-parallel-size 2"),
    (["-tp", "2", "--nnodes", "2"], "--distributed-init-method must be given"),
    (["-tp", "2", "--nnodes", "2", "--node-rank", "2", "--distributed-init-method", "tcp://127.0.0.1:1"],
     "--node-rank must be below --nnodes 2"),
])
def test_bad_distributed_flags_are_one_line(flags, message):
    from typer.testing import CliRunner

    from tfserve.cli import app

    result = CliRunner().invoke(app, ["serve", *flags], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code != 0 and message in result.output, result.output
    assert "Traceback" not in result.output


def test_two_replicas_serve_a_stream_and_label_their_metrics(tmp_path):
    """`--data-parallel-size 2`: a streamed chat completion through the openai SDK; /metrics by replica."""
    import httpx2
    import openai

    from test_tensor_parallel import save_model

    path = save_model(tmp_path / "tiny", "LlamaForCausalLM", heads=4, kv_heads=2, vocab=320, tie=False)
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TFSERVE_HOME": str(tmp_path / "home")}
    process = subprocess.Popen([sys.executable, "-m", "tfserve", "serve", "--model", str(path), "-dp", "2",
                                "--port", str(port), "--kv-cache-memory", "8MiB"],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(port, [process])
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        for first in (5, 50):  # two prefixes: one replica each
            chunks = list(client.completions.create(model="tiny", prompt=[first] * 16 + [7], max_tokens=5,
                                                    temperature=0, stream=True))
            assert chunks[-1].choices[0].finish_reason == "length"
        metrics = httpx2.get(f"http://127.0.0.1:{port}/metrics").text
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    assert 'tfserve_replica_num_routed{replica="0"} 1.0' in metrics
    assert 'tfserve_replica_num_routed{replica="1"} 1.0' in metrics
    assert 'tfserve_replica_kv_cache_blocks_total{replica="1"}' in metrics
