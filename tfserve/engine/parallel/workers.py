"""The ranks past 0 of a tensor-parallel engine: processes that load the model, keep their shard and their
slice of the KV cache, and run every step rank 0 broadcasts until it says stop.

On one machine rank 0 spawns them (`spawn_workers`). Across machines every node runs the same `tfserve serve`
command with its `--node-rank` (and `--nnodes`, `--distributed-init-method tcp://FIRST_NODE:PORT`): the first
serves HTTP as rank 0 and spawns its other ranks, the others spawn theirs (`run_node`). Under torchrun (RANK and
WORLD_SIZE set) each process is one rank: rank 0 serves, the others run `worker_main`.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("tfserve.engine")


@dataclass
class WorkerSpec:
    """What a worker needs to load the same model and split it the same way."""

    model: str
    load_kwargs: dict[str, Any]  # load_model's keywords: dtype, device, quantization, ...
    config: Any  # the EngineConfig (num_blocks comes from rank 0 once it has sized its cache)
    world_size: int
    init_method: str
    timeout_s: float
    env: dict[str, str] = field(default_factory=dict)


def free_init_method() -> str:
    """A tcp:// rendezvous on a free local port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


class Workers:
    """The worker processes rank 0 started on this machine."""

    def __init__(self, processes: list, ranks: list[int]) -> None:
        self.processes, self.ranks = processes, ranks

    def dead(self, wait_s: float = 1.0) -> list[str]:
        """The ranks whose process has exited (given `wait_s` to finish exiting), as "rank N (how)"."""
        for process in self.processes:
            process.join(wait_s / max(len(self.processes), 1))
        return [f"rank {rank} ({exit_reason(p.exitcode)})" for rank, p in zip(self.ranks, self.processes)
                if p.exitcode is not None]

    def stop(self, timeout: float = 10.0) -> None:
        for process in self.processes:
            process.join(timeout)
        for process in self.processes:
            end_process(process, 0)


def end_process(process, timeout: float) -> None:
    """Wait `timeout` s for `process` to exit, then SIGTERM it, then SIGKILL it: it is gone on return (a busy
    machine can take seconds to end one that holds a model)."""
    process.join(timeout)
    for signal_it, wait_s in ((process.terminate, 5), (process.kill, 60)):
        if not process.is_alive():
            return
        signal_it()
        # SIGKILL cannot be refused, but the kernel's teardown of a process that held a model (its mappings, its
        # threads) took longer than 5 s once on a loaded CI machine: wait for it rather than leave it behind
        process.join(wait_s)


def exit_reason(code: int | None) -> str:
    """How a process ended, in words: `killed by SIGKILL`, `exit code 1`."""
    if code is None:
        return "still running"
    if code < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def torchrun_rank() -> int | None:
    """This process's rank when torchrun (or any launcher setting RANK and WORLD_SIZE) started it, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"])
    return None


def local_ranks(spec: WorkerSpec, node_rank: int) -> list[int]:
    """The ranks node `node_rank` runs itself: its run of `world_size / nnodes`; under torchrun only its own."""
    if spec.init_method == "env://" or torchrun_rank() is not None:
        return [torchrun_rank() or 0]
    per_node = spec.world_size // spec.config.nnodes
    return list(range(node_rank * per_node, (node_rank + 1) * per_node))


def run_node(spec: WorkerSpec, node_rank: int) -> int:
    """A node past the first: run its ranks (here, when torchrun started this process as one; else as spawned
    processes) until rank 0 stops them. Returns the exit status: 0, or 1 when a rank failed (said in one line)."""
    if torchrun_rank() is not None:
        worker_main(spec, torchrun_rank())  # exits with 1 on failure
        return 0
    started = spawn_workers(spec, local_ranks(spec, node_rank))
    for process in started.processes:
        process.join()
    failed = [p for p in started.processes if p.exitcode]
    return 1 if failed else 0


def spawn_workers(spec: WorkerSpec, ranks: list[int]) -> Workers:
    """Start ranks `ranks` of `spec` as processes here (spawned: a fresh interpreter each, no forked threads)."""
    context = multiprocessing.get_context("spawn")
    processes = []
    for rank in ranks:
        process = context.Process(target=worker_main, args=(spec, rank), name=f"tfserve-tp-rank{rank}", daemon=True)
        process.start()
        processes.append(process)
    return Workers(processes, list(ranks))


def worker_main(spec: WorkerSpec, rank: int) -> None:
    """A worker process: exits 0 when rank 0 says stop, 1 with one line on stderr when anything fails."""
    os.environ.update(spec.env)
    logging.basicConfig(level=logging.WARNING, format=f"tfserve rank {rank}: %(message)s")
    try:
        run_worker(spec, rank)
    except KeyboardInterrupt:
        sys.exit(1)
    except Exception as exc:  # one readable line: rank 0 reports the failure of the whole engine
        print(f"tfserve: tensor-parallel rank {rank} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
    # done, the process group destroyed: end without the interpreter's teardown, where a C++ thread of torch's
    # still joinable now and then aborted the process ("terminate called without an active exception", -6),
    # and a node past the first then exited 1 after a clean stop
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_worker(spec: WorkerSpec, rank: int) -> None:
    import torch

    from tfserve.engine import attention
    from tfserve.engine.parallel import tensor_parallel
    from tfserve.engine.runner import ModelRunner
    from tfserve.models.loading import load_model

    torch.set_num_threads(tensor_parallel.torch_threads(spec.world_size, spec.config.nnodes))
    tensor_parallel.init_process_group(rank, spec.world_size, spec.init_method, spec.timeout_s)
    loaded = load_model(spec.model, **spec.load_kwargs)
    tp = tensor_parallel.shard(loaded.model, rank, spec.world_size)
    num_blocks = tensor_parallel.receive_step(tp)  # rank 0 sized its cache: every rank holds as many blocks
    runner = ModelRunner(loaded.model, dataclasses.replace(spec.config, num_blocks=num_blocks), tp)
    tensor_parallel.connect_shared_memory(tp, runner.cpu_ops, tensor_parallel.one_machine(spec.config),
                                          spec.timeout_s)
    forward = runner.forward
    with torch.inference_mode():
        while (step := tensor_parallel.receive_step(tp)) is not None:
            input_ids, positions, logits_index, meta, extra = step
            attention.set_metadata(dataclasses.replace(meta, kv_caches=runner.kv_caches, cpu_ops=runner.cpu_ops))
            try:
                forward(input_ids, positions, logits_index, **extra)
            finally:
                attention.set_metadata(None)
    torch.distributed.destroy_process_group()
