"""Runtime: the compiled local step as an nn.Module, meta-device initialization of local
shards, and local process launching."""

from .init import empty_local_shards, init_local_shards
from .launch import free_port, run_local
from .parallel_module import ParallelModule, PeerLostError

__all__ = [
    "ParallelModule",
    "PeerLostError",
    "empty_local_shards",
    "free_port",
    "init_local_shards",
    "run_local",
]
