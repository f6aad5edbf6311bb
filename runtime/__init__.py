"""Runtime: lower a :class:`~autopar.plans.Plan` onto a live model and train it.

* :func:`apply_plan` lays a model out as a plan says (:mod:`.lower`: meshes,
  tensor-parallel styles, FSDP2, meta materialization) and returns a
  :class:`ParallelModel`, whose ``step(inputs, targets)`` runs one forward + backward
  of a global batch.
* With ``plan.pipeline``, :func:`apply_plan` cuts the model into stages
  (:mod:`.pipeline_split`) and runs this rank's with a ``torch.distributed.pipelining``
  schedule (:mod:`.pipeline`).
* Memory choices: recomputation (:mod:`.recompute`), ZeRO, offload and mixed precision
  through FSDP2 (:mod:`.data_parallel`); a same-precision reference (:mod:`.precision`)
  and a per-rank peak memory probe (:mod:`.memory_probe`) for comparisons.

The runtime consumes a Plan and never calls a solver. Design notes: docs/runtime.md.
"""

from autopar.runtime.lower import check_plan, lower, lower_pipeline
from autopar.runtime.memory_probe import StepMemory, measure_step_memory
from autopar.runtime.pipeline import PipelineRuntime, check_pipeline
from autopar.runtime.parallel_model import ParallelModel, apply_plan, loss_scale
from autopar.runtime.recompute import apply_ac, checkpoint_block
from autopar.runtime.tensor_parallel import TPLayout, apply_tensor_parallel, tp_layout

__all__ = ["ParallelModel", "apply_plan", "loss_scale", "lower", "check_plan", "TPLayout",
           "tp_layout", "apply_tensor_parallel",
           "lower_pipeline", "check_pipeline", "PipelineRuntime", "apply_ac", "checkpoint_block",
           "StepMemory", "measure_step_memory"]
