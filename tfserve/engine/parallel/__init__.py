"""Tensor parallelism below the engine's interface: a model split across ranks over torch.distributed
(tensor_parallel.py) and the ranks past 0 that run its shards (workers.py)."""
