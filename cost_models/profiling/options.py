"""The options of ``autopar profile``, apart from the profiler so that the command
line can list them without importing torch."""

from __future__ import annotations

import argparse


def build_parser(ap: argparse.ArgumentParser | None = None,
                 description: str | None = None) -> argparse.ArgumentParser:
    """The profile options, on ``ap`` (a CLI sub-parser) or a new parser described by
    ``description``."""
    ap = ap or argparse.ArgumentParser(prog="autopar profile", description=description,
                                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="a smaller grid: about 35 s on an H100, minutes on a CPU (default: "
                         "the full grid)")
    ap.add_argument("--out", default="profile.json",
                    help="the profile JSON to write (default: %(default)s)")
    ap.add_argument("--resume", action="store_true",
                    help="skip the points already in OUT.partial.jsonl (default: measure "
                         "all)")
    ap.add_argument("--device", choices=["cuda", "cpu"],
                    help="the device to measure (default: cuda if present, else cpu; a CPU "
                         "profile plans CPU runs only)")
    ap.add_argument("--time-limit-s", "--time-limit", type=float, metavar="S",
                    dest="time_limit_s",
                    help="stop starting new points after S seconds, then --resume "
                         "(default: no limit)")
    return ap
