"""``autopar --help`` answers without importing torch (0.3 s, not 3 s) and lists every
command without reStructuredText markup."""

from __future__ import annotations

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


def test_every_plan_and_compare_option_says_what_it_is():
    from autopar.cli import _build_parser

    sub = next(a for a in _build_parser()._actions if a.dest == "command")
    for name in ("plan", "compare"):
        missing = [a.option_strings[0] for a in sub.choices[name]._actions
                   if a.option_strings and not a.help]
        assert missing == [], (name, missing)
