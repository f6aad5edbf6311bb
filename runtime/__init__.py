"""Runtime: lower a :class:`~autopar.plans.Plan` onto a live model and train it.

* :func:`apply_plan` lays a model out as a plan says (:mod:`.lower`: meshes,
  tensor-parallel styles, FSDP2, meta materialization) and returns a
  :class:`ParallelModel`, whose ``step(inputs, targets)`` runs one forward + backward
  of a global batch.

The runtime consumes a Plan and never calls a solver.
"""

from autopar.runtime.lower import check_plan, lower
from autopar.runtime.parallel_model import ParallelModel, apply_plan
from autopar.runtime.tensor_parallel import ReplicateParallel

__all__ = ["ParallelModel", "apply_plan", "lower", "check_plan", "ReplicateParallel"]
