"""Measuring a machine for the cost models, in the order the measurements flow:

- :mod:`.grid` — which points to measure, on a GPU or a CPU;
- :mod:`.timing` — how one point is timed, and where a profile was measured;
- :mod:`.compute_bound`, :mod:`.memory_bound` — the device tables: FLOP/s and bytes/s;
- :mod:`.host_dispatch`, :mod:`.host_wrappers` — host seconds per op, checkpoint
  region, optimizer parameter, FSDP2 parameter and DTensor call;
- :mod:`.collectives`, :mod:`.fit` — collective times and their one α-β fit;
- :mod:`.run` — ``autopar profile``: all of the above into a profile JSON;
- :mod:`.cpu` — the shipped ``cpu`` profile, measured as N one-thread gloo processes.

:mod:`autopar.cost_models.hardware` reads what they write. What each measures and
counts: docs/profiling.md.
"""
