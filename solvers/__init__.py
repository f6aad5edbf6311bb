"""Solvers, from the inside out:

* :mod:`.problem` — the intra-op problem as plain numbers, and its objective;
* :mod:`.intra_op_ilp` — the intra-op ILP: one strategy per node under memory;
* :mod:`.exhaustive` — exhaustive references over the same
  :class:`~autopar.solvers.problem.Problem` and the outer search's space, for tests;
* :mod:`.schedule_sim` — a pipeline schedule's time and memory, simulated;
* :mod:`.units` — the pieces pipeline stages are made of, and their costs;
* :mod:`.stage_split` — the split of the units into stages (Alpa's inter-operator
  level), with its searches in :mod:`.stage_split_search`;
* :mod:`.pipelined_candidate` — one pipelined candidate scored: the intra-op ILP on the
  stage mesh, then the stage split;
* :mod:`.bounds` — cheap lower bounds that prune the outer search;
* :mod:`.outer_search` — the outer search over pp × dp × tp, micro-batch sizes, ZeRO
  stages and pipeline schedules.

Nothing here imports ``torch.distributed``."""
