"""Sharding strategies: per-op rules, their enumeration on a mesh, and the cost tables
the solvers read (see :func:`autopar.strategies.build.build_problem`)."""
