"""Runtime: lower a :class:`~autopar.plans.Plan` onto a live model (:mod:`.lower`) and
train it (:class:`~autopar.runtime.parallel_model.ParallelModel`). Never calls a solver."""

from autopar.runtime.parallel_model import ParallelModel, apply_plan

__all__ = ["ParallelModel", "apply_plan"]
