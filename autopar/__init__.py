"""autopar: an automatic parallelism compiler for PyTorch.

Capture a model as an FX graph, score every way to split it over a device mesh with
cost models of the target GPUs, let an ILP pick the fastest plan that fits in memory,
and run it with PyTorch's own distributed stack::

    model = autopar.parallelize(model, example_inputs)       # inside torchrun
    plan = autopar.plan(model, example_inputs, cluster=autopar.Cluster("h100-sxm", nodes=2))
    print(plan.summary())
"""

from autopar.api import detect_cluster, estimate, parallelize, plan
from autopar.cluster import Cluster
from autopar.compare import Comparison, compare
from autopar.errors import (AutoparError, CaptureError, CheckpointError, ConfigError,
                            LoweringError, NoFeasiblePlanError, PlanFormatError, RankError,
                            UnsupportedOpError)
from autopar.plans import ModulePlan, Plan
from autopar.spec import Spec

__version__ = "0.1.0"

__all__ = ["Cluster", "Plan", "ModulePlan", "Spec", "Comparison", "plan", "estimate", "compare",
           "parallelize", "detect_cluster", "AutoparError", "CaptureError", "ConfigError",
           "LoweringError", "NoFeasiblePlanError", "PlanFormatError", "UnsupportedOpError",
           "CheckpointError", "RankError", "ParallelModel", "save", "load", "Checkpointer"]


def __getattr__(name: str):
    if name == "ParallelModel":
        from autopar.runtime import ParallelModel

        return ParallelModel
    if name in ("save", "load", "Checkpointer"):
        from autopar.runtime import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")
