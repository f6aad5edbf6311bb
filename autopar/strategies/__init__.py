"""Sharding strategies: per-op rules and their enumeration on a mesh
(:mod:`autopar.strategies.enumeration`); :func:`autopar.solvers.problem_build.build_problem`
prices them into the problem the solvers read. The rules: docs/strategies.md."""
