"""Beyond one process: tensor parallelism over torch.distributed (tensor_parallel.py, its worker ranks in
workers.py)."""
