"""Solvers: the intra-op ILP (:mod:`.ilp`), an exhaustive reference (:mod:`.exhaustive`)
over the same :class:`~autopar.solvers.problem.Problem`, and the outer search over
mesh shapes and micro-batch sizes (:mod:`.search`). Nothing here imports
``torch.distributed``."""
