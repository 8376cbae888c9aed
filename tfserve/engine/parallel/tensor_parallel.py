"""Tensor parallelism over torch.distributed: one model split across ranks, each running its shard of every step.

Rank 0 is the engine: it owns the scheduler, the block pool and the sampler. Every step it broadcasts the packed
batch (token ids, positions, the attention metadata: slot mapping, block tables, key lengths) and every rank
runs the same lean forward over its shard (`engine/backends/lean.py`, told its `TensorParallel`):

- attention by KV-head groups: rank r holds a contiguous run of KV heads and the query heads that read them
  (q/k/v projections split by output rows, o_proj by input columns), and its slice of the paged KV cache. Runs
  may be uneven (SmolLM2-135M has 3 KV heads: 2 + 1 on two ranks);
- MLP column- then row-parallel (gate/up by rows, down by columns);
- one all-reduce after o_proj and one after down_proj (each rank's partial sums of the residual);
- embeddings and LM head vocab-parallel: each rank looks up the ids in its run of the vocabulary (zeros
  elsewhere, then an all-reduce) and computes the logits of its run (gathered, every rank getting them all).

Collectives run through shared memory between the ranks of one machine and on gloo otherwise, each with a
timeout, so a rank that dies fails the step within that time instead of hanging it. The model is split in
place after loading, from transformers' own module layout (the same split as its `base_model_tp_plan` for
these architectures: colwise q/k/v/gate/up, rowwise o/down).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from tfserve.errors import EngineFailedError

logger = logging.getLogger("tfserve.engine")

DEFAULT_TIMEOUT_S = 60.0


class TensorParallelError(EngineFailedError):
    """A rank failed, or a collective timed out: the engine cannot go on."""


def split(total: int, parts: int) -> list[tuple[int, int]]:
    """`total` items in `parts` contiguous runs, as even as can be (the first ones one longer): [(start, end)]."""
    base, extra = divmod(total, parts)
    bounds, start = [], 0
    for part in range(parts):
        end = start + base + (part < extra)
        bounds.append((start, end))
        start = end
    return bounds


@dataclass
class TensorParallel:
    """One rank's share of a split model, and the collectives of the step."""

    rank: int
    world_size: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # key/value heads on this rank
    vocab_start: int  # this rank's run of the vocabulary: [vocab_start, vocab_start + vocab_per), padded
    vocab_per: int  # rows of every rank's run (the last one padded with zero rows)
    vocab_size: int
    group: Any = None  # the process group; None: the default one
    shm: SharedMemory | None = None  # the ranks share a machine: collectives through shared memory
    # rank 0: one step's collectives at a time (a step's broadcast and its all-reduces, or a keep-alive)
    lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)
    last_sent: float = dataclasses.field(default_factory=time.monotonic)  # when rank 0 last broadcast
    stopped: bool = False  # rank 0 sent stop: no keep-alive after it

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.shm is not None and self.shm.fits(x):
            self.shm.all_reduce_(x)
        else:
            _collective(torch.distributed.all_reduce, x, group=self.group)
        return x

    def embed(self, embedding: torch.nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of `input_ids` from every rank's run of the vocabulary: [num_tokens, hidden]."""
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_per)
        x = embedding(local.masked_fill(outside, 0))
        x.masked_fill_(outside[:, None], 0.0)
        return self.all_reduce(x)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's logits [num_samples, vocab_per] side by side, the padding cut: [num_samples, vocab]."""
        local = local.contiguous()
        if self.shm is not None and self.shm.fits(local):
            return self.shm.all_gather(local)[:, :self.vocab_size]
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        _collective(torch.distributed.all_gather, parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[:, :self.vocab_size]


class SharedMemory:
    """Buffers in /dev/shm that the ranks of one machine map, for the CPU kernels' collectives (csrc/shm.h):
    a flag per rank, and two alternating buffers of a slot per rank, `capacity` floats each."""

    def __init__(self, path: str, world_size: int, rank: int, capacity: int, ops, timeout_s: float) -> None:
        size = 8 * world_size + 4 * 2 * world_size * capacity
        buffer = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        self.flags = buffer[:8 * world_size].view(torch.int64)
        self.data = buffer[8 * world_size:].view(torch.float32).view(2, world_size, capacity)
        self.rank, self.capacity, self.ops, self.timeout_s = rank, capacity, ops, timeout_s
        self.seq = 0  # calls made; every rank makes the same ones in the same order

    def fits(self, x: torch.Tensor) -> bool:  # the same answer on every rank: they hold the same shapes
        return x.dtype == torch.float32 and x.is_contiguous() and x.numel() <= self.capacity

    def all_reduce_(self, x: torch.Tensor) -> None:
        self.seq += 1
        _collective(self.ops.shm_all_reduce_, x, self.flags, self.data, self.rank, self.seq, self.timeout_s)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self.seq += 1
        return _collective(self.ops.shm_all_gather, x, self.flags, self.data, self.rank, self.seq, self.timeout_s)


SHM_CAPACITY = 4 << 20  # floats a rank puts in one shared-memory collective (larger ones go through gloo)


def connect_shared_memory(tp: TensorParallel, ops, same_machine: bool, timeout_s: float) -> None:
    """Every rank calls this once, before the first step, with its runner's CPU kernels (`ops`, or None): where
    the ranks share one machine and have the kernels, rank 0 makes the buffers and the others map them;
    elsewhere the collectives stay on gloo."""
    import tempfile

    import torch.distributed as dist

    has_kernels = ops is not None and hasattr(ops, "shm_all_reduce_")
    box: list[Any] = [None]
    if tp.rank == 0 and same_machine and has_kernels:
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
        handle, box[0] = tempfile.mkstemp(prefix="tfserve-tp-", dir=directory)
        os.close(handle)
    _collective(dist.broadcast_object_list, box, src=0, group=tp.group)
    path = box[0]
    if path is None:
        return
    if not has_kernels:
        raise TensorParallelError(f"rank {tp.rank} has no CPU kernels, which rank 0 uses for its collectives")
    tp.shm = SharedMemory(path, tp.world_size, tp.rank, SHM_CAPACITY, ops, timeout_s)
    _collective(dist.barrier, group=tp.group)  # every rank has mapped it: the name can go
    if tp.rank == 0:
        os.unlink(path)


def _collective(fn, *args, **kwargs) -> Any:
    try:
        return fn(*args, **kwargs)
    except RuntimeError as exc:  # a peer closed its connection (gloo), or the timeout passed (gloo, shared memory)
        raise TensorParallelError(f"a tensor-parallel collective failed (a worker rank died or hung): {exc}") from exc


def why_not(model: torch.nn.Module, world_size: int) -> str | None:
    """Why `model` cannot be split `world_size` ways, or None."""
    from tfserve.engine.backends.lean import LeanForward

    reason = LeanForward.why_not(model)
    if reason is not None:
        return f"tensor parallelism runs on the lean forward, which cannot run this model: {reason}"
    config = model.config
    if getattr(config, "num_experts", 0):  # shard() splits dense MLPs only
        return "tensor parallelism does not split a mixture of experts yet"
    if config.num_key_value_heads < world_size:
        return (f"the model has {config.num_key_value_heads} key/value heads, fewer than "
                f"--tensor-parallel-size {world_size}")
    if config.intermediate_size % world_size:
        return f"its MLP width {config.intermediate_size} does not split {world_size} ways"
    return None


@torch.no_grad()
def shard(model: torch.nn.Module, rank: int, world_size: int, group: Any = None) -> TensorParallel:
    """Split `model` (a Llama-family causal LM) in place, keeping rank `rank`'s share of each weight; the
    model's forward is not usable afterwards, the lean forward given the returned `TensorParallel` is."""
    config = model.config
    reason = why_not(model, world_size)
    if reason is not None:
        raise ValueError(reason)
    head_dim = model.model.layers[0].self_attn.head_dim
    group_size = config.num_attention_heads // config.num_key_value_heads  # query heads per KV head
    kv_start, kv_end = split(config.num_key_value_heads, world_size)[rank]
    q_rows = slice(kv_start * group_size * head_dim, kv_end * group_size * head_dim)
    kv_rows = slice(kv_start * head_dim, kv_end * head_dim)
    mlp_rows = slice(*split(config.intermediate_size, world_size)[rank])
    q_size, kv_size = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if hasattr(attn, "qkv_proj"):  # Phi-3: q, k and v stacked in one layer, gate and up in another
            _keep_rows(attn.qkv_proj, torch.cat([_range(q_rows), q_size + _range(kv_rows),
                                                 q_size + kv_size + _range(kv_rows)]))
            _keep_rows(mlp.gate_up_proj, torch.cat([_range(mlp_rows), config.intermediate_size + _range(mlp_rows)]))
        else:
            _keep_rows(attn.q_proj, q_rows)
            _keep_rows(attn.k_proj, kv_rows)
            _keep_rows(attn.v_proj, kv_rows)
            _keep_rows(mlp.gate_proj, mlp_rows)
            _keep_rows(mlp.up_proj, mlp_rows)
        _keep_columns(attn.o_proj, q_rows, keep_bias=rank == 0)
        _keep_columns(mlp.down_proj, mlp_rows, keep_bias=rank == 0)
    vocab_size = model.lm_head.out_features
    vocab_per = -(-vocab_size // world_size)
    start = rank * vocab_per
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    embedding = _vocab_rows(model.model.embed_tokens.weight, start, vocab_per)
    model.model.embed_tokens.weight = embedding
    model.model.embed_tokens.num_embeddings = vocab_per
    head = embedding if tied else _vocab_rows(model.lm_head.weight, start, vocab_per)
    model.lm_head.weight, model.lm_head.out_features = head, vocab_per
    if model.lm_head.bias is not None:
        model.lm_head.bias = _vocab_rows(model.lm_head.bias[:, None], start, vocab_per)[:, 0]
    return TensorParallel(rank, world_size, (kv_end - kv_start) * group_size, kv_end - kv_start, start, vocab_per,
                          vocab_size, group)


def _range(rows: slice) -> torch.Tensor:
    return torch.arange(rows.start, rows.stop)


def _keep_rows(linear: torch.nn.Linear, rows: slice | torch.Tensor) -> None:
    linear.weight = torch.nn.Parameter(linear.weight[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(linear.bias[rows].clone(), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _keep_columns(linear: torch.nn.Linear, columns: slice, keep_bias: bool) -> None:
    linear.weight = torch.nn.Parameter(linear.weight[:, columns].clone(), requires_grad=False)
    if linear.bias is not None and not keep_bias:  # added once, by rank 0, before the all-reduce sums
        linear.bias = torch.nn.Parameter(torch.zeros_like(linear.bias), requires_grad=False)
    linear.in_features = linear.weight.shape[1]


def _vocab_rows(weight: torch.Tensor, start: int, rows: int) -> torch.nn.Parameter:
    """Rows [start, start + rows) of `weight`, zero past its end."""
    out = torch.zeros(rows, *weight.shape[1:], dtype=weight.dtype, device=weight.device)
    mine = weight[start:start + rows]
    out[:len(mine)] = mine
    return torch.nn.Parameter(out, requires_grad=False)


# -- the step, broadcast by rank 0 -----------------------------------------------------------------------------


class BroadcastForward:
    """Rank 0's forward backend: sends each step's inputs to the other ranks, then runs its own shard."""

    def __init__(self, inner, tp: TensorParallel) -> None:
        self.inner, self.tp = inner, tp
        self.name = f"{inner.name}, tensor-parallel x{tp.world_size}"

    def __getattr__(self, name: str) -> Any:  # weight_formats and the like: the inner backend's
        return getattr(self.inner, name)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_index: torch.Tensor,
                 **extra: Any) -> torch.Tensor:
        from tfserve.engine import attention

        meta = dataclasses.replace(attention.get_metadata(), kv_caches=None, cpu_ops=None, flash_layout=None)
        with self.tp.lock:  # the broadcast and the step's all-reduces, with no keep-alive between them
            send_step((input_ids, positions, logits_index, meta, extra), self.tp)
            return self.inner(input_ids, positions, logits_index, **extra)


KEEP_ALIVE = "keep-alive"  # what rank 0 sends when it has had no step to send for a while


def send_step(step: Any, tp: TensorParallel) -> None:
    """Rank 0: hand `step` (None: stop) to every other rank."""
    with tp.lock:
        tp.stopped = tp.stopped or step is None
        _collective(torch.distributed.broadcast_object_list, [step], src=0, group=tp.group)
        tp.last_sent = time.monotonic()


def keep_alive(tp: TensorParallel, timeout_s: float) -> threading.Thread:
    """Rank 0: while no step comes (an idle server), tell the other ranks every quarter of the collectives'
    timeout that it is there: they wait for the next step in a broadcast that would otherwise time out (an idle
    server's ranks all failed after `--distributed-timeout`, 60 s)."""
    interval = max(0.05, min(timeout_s / 4, 10.0))

    def run() -> None:
        while not tp.stopped:
            time.sleep(interval / 2)
            with tp.lock:
                if tp.stopped or time.monotonic() - tp.last_sent < interval:
                    continue
                try:
                    send_step(KEEP_ALIVE, tp)
                except TensorParallelError:  # a rank died: the next step fails and says so
                    return

    thread = threading.Thread(target=run, name="tfserve-tp-keep-alive", daemon=True)
    thread.start()
    return thread


def receive_step(tp: TensorParallel) -> Any:
    """The next step rank 0 sends (None: stop), past its keep-alives."""
    while True:
        box = [None]
        _collective(torch.distributed.broadcast_object_list, box, src=0, group=tp.group)
        if box[0] != KEEP_ALIVE:
            return box[0]


_joined = False  # this process joined a process group (an interpreter teardown after it may abort: cli.main)


def joined() -> bool:
    """Whether this process ever joined a process group."""
    return _joined


def init_process_group(rank: int, world_size: int, init_method: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the group (gloo); every later collective fails after `timeout_s`."""
    import torch.distributed as dist

    global _joined
    _joined = True

    backend = "gloo"  # CPU ranks (Engine.from_pretrained refuses CUDA ones for now; they would take "nccl")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def one_machine(config) -> bool:
    """Whether every rank runs on this machine (no --nnodes, and torchrun, if it started us, ran them all here)."""
    world = config.tensor_parallel_size
    return config.nnodes == 1 and int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world


def torch_threads(world_size: int, nnodes: int = 1) -> int:
    """Threads each rank runs torch on: the machine's cores shared among the ranks on it (torchrun's
    LOCAL_WORLD_SIZE, else an even share of the world)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or max(1, world_size // nnodes)
    return max(1, (os.cpu_count() or 1) // local)
