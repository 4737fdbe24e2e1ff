"""Runtime: the compiled local step as an nn.Module, and local process launching."""

from .launch import free_port, run_local
from .parallel_module import ParallelModule

__all__ = ["ParallelModule", "free_port", "run_local"]
