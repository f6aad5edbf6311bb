"""The multi-process test launcher: :mod:`autopar.launch`, re-exported for the tests."""

from autopar.launch import RankFailure, free_port, run_distributed

__all__ = ["RankFailure", "run_distributed", "free_port"]
