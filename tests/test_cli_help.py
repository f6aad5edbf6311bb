"""``autopar --help`` answers without importing torch (0.2 s from a fresh interpreter,
not 3 s), lists every command without reStructuredText markup, and every option says
what it is and what leaving it out means."""

from __future__ import annotations

import re
import subprocess
import sys


def test_help_lists_every_command_without_importing_torch():
    code = ("import sys, contextlib, io\n"
            "from autopar.cli import _build_parser\n"
            "out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n"
            "    _build_parser().print_help()\n"
            "print(out.getvalue())\n"
            "print('torch imported:', 'torch' in sys.modules)\n")
    text = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout
    assert "torch imported: False" in text
    for command in ("plan", "compare", "models", "demo", "codegen", "profile"):
        assert command in text
    assert "``" not in text


def test_version_and_train_help_say_what_they_are() -> None:
    """``--version`` names the package; ``train --help`` shows a default once, and none
    where leaving the option out means something the help says."""
    from autopar import __version__
    from autopar.cli import _build_parser

    description = _build_parser().description
    for command in ("plan", "compare", "codegen", "train", "checkpoint", "profile", "demo",
                    "models"):
        assert re.search(rf"\b{command}\b", description), command
    version = subprocess.run([sys.executable, "-c", "from autopar.cli import main; "
                              "main(['--version'])"], capture_output=True, text=True)
    assert version.stdout.strip() == f"autopar {__version__}", version.stderr
    text = subprocess.run([sys.executable, "-c", "from autopar.cli import main; "
                           "main(['train', '--help'])"], capture_output=True, text=True).stdout
    assert "(default: None)" not in text and "(default: the model's)" in text
    assert text.count("(default: 0.003)") == 1


def test_every_plan_and_compare_option_says_what_it_is():
    from autopar.cli import _build_parser

    sub = next(a for a in _build_parser()._actions if a.dest == "command")
    for name in ("plan", "compare"):
        missing = [a.option_strings[0] for a in sub.choices[name]._actions
                   if a.option_strings and not a.help]
        assert missing == [], (name, missing)


def test_help_answers_fast_in_a_fresh_interpreter():
    """``autopar --help`` and ``autopar plan --help`` in a new process, interpreter start
    included: about 0.2 s here (torch alone takes 2-3 s to import)."""
    import time

    for argv in (["--help"], ["plan", "--help"]):
        code = f"from autopar.cli import main; main({argv!r})"
        start = time.perf_counter()
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        took = time.perf_counter() - start
        assert run.returncode == 0 and "usage: autopar" in run.stdout, run.stderr
        assert took < 2.0, (argv, took)


def test_every_option_shows_its_default():
    """Each optional option of plan, compare, demo, codegen and profile says what
    leaving it out means."""
    from autopar.cli import _build_parser

    sub = next(a for a in _build_parser()._actions if a.dest == "command")
    for name in ("plan", "compare", "demo", "codegen", "profile"):
        missing = [a.option_strings[0] for a in sub.choices[name]._actions
                   if a.option_strings and a.dest != "help" and not a.required
                   and "default" not in (a.help or "")]
        assert missing == [], (name, missing)


def test_search_progress_shows_time_left_on_a_terminal_only(monkeypatch) -> None:
    """The search's progress line appears after a second, on a terminal only, with the
    time spent and an estimate of the time left."""
    import io

    from autopar import cli

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert cli._progress_line(io.StringIO()) is None  # a log or a pipe: no progress
    clock = iter([100.0, 100.5, 102.0])
    monkeypatch.setattr(cli.time, "perf_counter", lambda: next(clock))
    out = Tty()
    show = cli._progress_line(out)
    show(1, 10, None)  # at 0.5 s: too early to show
    assert out.getvalue() == ""
    show(4, 10, 0.0125)  # at 2 s: 0.5 s a configuration, 6 to go
    assert out.getvalue().strip() == ("searching: 4/10 configurations, best 12.50 ms per "
                                      "step, 2 s, about 3 s left")
