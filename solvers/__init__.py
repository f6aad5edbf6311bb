"""Solvers, from the inside out:

* :mod:`.problem` — the intra-op problem as plain numbers, and its objective;
* :mod:`.intra_op_ilp` — the intra-op ILP: one strategy per node under memory;
* :mod:`.exhaustive` — exhaustive references over the same problems, for tests;
* :mod:`.schedule_sim` — a pipeline schedule's time and memory, simulated;
* :mod:`.units` — the pieces pipeline stages are made of, and their costs;
* :mod:`.stage_split`, :mod:`.stage_split_search` — the units split into stages;
* :mod:`.pipelined_candidate` — one pipelined candidate: the ILP, then the stage split;
* :mod:`.bounds` — cheap lower bounds that prune the outer search;
* :mod:`.outer_search` — the search over pp × dp × tp, micro-batches, ZeRO, schedules.

The formulas, one section per module: docs/solvers.md. Nothing here imports
``torch.distributed``.
"""
