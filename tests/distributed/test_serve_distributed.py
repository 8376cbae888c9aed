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

from tiny import ServeProcess

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

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TFSERVE_HOME": str(default_model_dir.parent.parent)}
    with ServeProcess(["--tensor-parallel-size", "2", "--distributed-timeout", "20", "--kv-cache-memory", "64MiB"],
                      env, timeout=180) as server:
        client = server.client()
        reply = client.chat.completions.create(
            model="smollm2-135m-instruct", temperature=0, max_tokens=20,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in reply.choices[0].message.content

        (worker,) = _worker_pids(server.process.pid)
        os.kill(worker, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(openai.APIError) as failed:
            client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=20,
                                           messages=[{"role": "user", "content": "hi"}])
        assert "rank 1" in str(failed.value)
        output, _ = server.process.communicate(timeout=60)  # it stops by itself
        assert time.monotonic() - start < 60
    assert server.process.returncode != 0
    assert "Error: tensor-parallel rank 1 (killed by SIGKILL) failed" in output
    assert "Traceback" not in output


def test_two_nodes_each_run_their_rank_and_stop_with_the_first(tmp_path):
    """`--nnodes 2`: node 0 serves as rank 0, node 1 only runs rank 1; stopping node 0 ends node 1 too."""
    from tiny import save_model

    from tfserve.engine.parallel.workers import free_init_method

    path = save_model(tmp_path / "tiny", "LlamaForCausalLM", heads=4, kv_heads=2, vocab=320, tie=False)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TFSERVE_HOME": str(tmp_path / "home")}
    common = ["--model", str(path), "-tp", "2", "--nnodes", "2", "--distributed-init-method", free_init_method(),
              "--kv-cache-memory", "8MiB"]
    second = subprocess.Popen([sys.executable, "-m", "tfserve", "serve", *common, "--node-rank", "1"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with ServeProcess([*common, "--node-rank", "0"], env) as first:
            reply = first.client().completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=5, temperature=0)
            assert reply.usage.completion_tokens == 5
            outputs = [first.stop(), second.communicate(timeout=60)[0]]
    finally:
        if second.poll() is None:
            second.kill()
    assert [first.process.returncode, second.returncode] == [0, 0], outputs


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


def test_a_local_ray_cluster_with_two_replicas_serves_a_streamed_chat(tmp_path):
    """`--data-parallel-size 2 --ray local`: replica 1 is a Ray actor; it streams a chat completion and gives the
    same greedy tokens as one engine in this process; /metrics labels each replica's. (Replicas in processes:
    test_replicas.py.)"""
    pytest.importorskip("ray")
    from tiny import build_llama, build_tokenizer

    from tfserve import Engine, SamplingParams

    tokenizer = build_tokenizer()
    path = tmp_path / "tiny-chat"
    build_llama(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TFSERVE_HOME": str(tmp_path / "home"), "RAY_ADDRESS": ""}
    with ServeProcess(["--model", str(path), "-dp", "2", "--ray", "local", "--kv-cache-memory", "8MiB"], env,
                      timeout=180) as server:
        client = server.client()
        client.completions.create(model="tiny-chat", prompt=[5] * 16, max_tokens=2)  # replica 0 takes the first
        stream = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=5, stream=True)  # a new prefix: the actor's turn
        chunks = list(stream)
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        prompts = [[60] * 8 + [9], [70] * 8 + [9]]  # new prefixes again: replica 0, then the actor
        texts = [client.completions.create(model="tiny-chat", prompt=p, max_tokens=8, temperature=0).choices[0].text
                 for p in prompts]
        metrics = server.get("/metrics")
        output = server.stop()
    assert server.process.returncode == 0, output
    assert 'tfserve_replica_num_routed{replica="0"} 2.0' in metrics
    assert 'tfserve_replica_num_routed{replica="1"} 2.0' in metrics
    assert 'tfserve_replica_kv_cache_blocks_total{replica="1"}' in metrics
    whole = Engine.from_pretrained(str(path)).generate_batch(prompts, SamplingParams(max_tokens=8, temperature=0))
    assert texts == [o.text for o in whole.values()]  # the actor's tokens are one engine's


def test_torchrun_starts_every_rank_and_rank_0_serves(tmp_path):
    """`torchrun --nproc-per-node 2 -m tfserve serve -tp 2`: tfserve takes its rank from torchrun's environment."""
    from tiny import free_port, save_model, wait_healthy

    from tfserve.engine.parallel.workers import free_init_method

    path = save_model(tmp_path / "tiny", "LlamaForCausalLM", heads=4, kv_heads=2, vocab=320, tie=False)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TFSERVE_HOME": str(tmp_path / "home")}
    port, master_port = free_port(), free_init_method().rsplit(":", 1)[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", master_port,
         "-m", "tfserve", "serve", "--model", str(path), "-tp", "2", "--port", str(port), "--kv-cache-memory", "8MiB"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_healthy(port, [process])
        import openai

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        reply = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=5, temperature=0)
        assert reply.usage.completion_tokens == 5
    finally:
        os.killpg(process.pid, signal.SIGINT)  # Ctrl+C reaches the whole group, as in a terminal
        try:
            process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
