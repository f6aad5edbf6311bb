"""Run several emitted programs, one after another, on the ranks of one ``torchrun``
job: ``torchrun --nproc-per-node N tests/program_runner.py JOBS.json`` (see
:func:`tests.test_codegen.torchrun_outputs`).

Starting a torchrun job costs more than most emitted programs spend training: each of
its processes imports torch and the distributed packages. Each rank of this job imports
them once, then forks one child per program, which runs the program's file as
``python PROGRAM ARGS...`` would (``__main__``, ``sys.argv``, its folder first on
``sys.path``) in a process that has run nothing else: no program sees what an earlier
one left behind. Each program gets its own rendezvous (``MASTER_PORT``, chosen by the
caller, and a store of its own rather than the agent's), as it would under a torchrun
job of its own. What rank ``r`` printed for program ``k`` goes to ``OUT_DIR/k.r.out``
and ``.err``; the first program that fails ends the job, its error printed.

JOBS.json: ``{"out_dir": DIR, "jobs": [{"program": PATH, "args": [...], "port": P}]}``.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback

import torch  # noqa: F401  (imported once, before the forks: what the children share)
import torch.distributed  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.pipelining  # noqa: F401
import torch.distributed.tensor  # noqa: F401
import torch.utils.checkpoint  # noqa: F401


def run_program(program: str, args: list[str], port: int, out: str) -> None:
    """Body of the child: run ``program`` as ``__main__`` with its output in ``out``.*;
    never returns."""
    code = 0
    try:
        for stream, suffix in ((1, ".out"), (2, ".err")):
            fd = os.open(out + suffix, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, stream)
            os.close(fd)
        os.environ["MASTER_PORT"] = str(port)
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # a store of its own
        sys.argv = [program, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(program))
        runpy.run_path(program, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    """Run each job of ``sys.argv[1]`` in a fresh fork; stop at the first failure."""
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    rank = os.environ["RANK"]
    for k, job in enumerate(spec["jobs"]):
        out = os.path.join(spec["out_dir"], f"{k}.{rank}")
        pid = os.fork()
        if pid == 0:
            run_program(job["program"], job["args"], job["port"], out)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if code != 0:
            with open(out + ".err") as f:  # on stdout, whose tail the caller shows first
                print(f"program {k} ({job['program']}) failed on rank {rank} with status "
                      f"{code}:\n{f.read()[-3000:]}", flush=True)
            sys.exit(1)


if __name__ == "__main__":
    main()
