"""Command-line value types shared by `commref bench` and its programs: sizes in
nccl-tests' syntax, bounded integers, and Communicator options checked by the typed
options themselves (so a bad value gets the API's own message)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from commref.collectives.options import CommOptions
from commref.transports import host_limits
from commref.transports.option_types import OptionError, bounded

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from nccl-tests' size syntax: an integer with an optional K, M, G (or T)
    suffix, powers of 1024, either case; a trailing B is allowed (64M, 64MB, 1g)."""
    s = str(text).strip().upper()
    if s.endswith("IB"):
        s = s[:-2]
    elif s.endswith("B") and len(s) > 1 and not s[-2].isdigit():
        s = s[:-1]
    elif s.endswith("B") and s[:-1].isdigit():
        s = s[:-1]
    unit = s[-1] if s and s[-1] in _SUFFIX else ""
    digits = s[: len(s) - len(unit)]
    if not digits.isdigit():
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: expected an integer with an optional K, M or G suffix, such as 8, 1K, 64M or 1G"
        )
    return int(digits) * _SUFFIX[unit]


# Options that only one setting of another takes, checked alone in that setting (the
# whole combination is checked once every flag is read: CommOptions.from_kwargs).
ALONE_WITH = {"wire_paths": {"wire": "unordered"}}


def option_type(keyword: str, many: bool = False) -> Callable[[str], Any]:
    """An argparse type for Communicator option `keyword` (collectives.options.KEYWORDS):
    the value is checked by CommOptions itself, so a bad one gets the API's message.
    `many`: a comma-separated list, each item checked (bench measures them side by side)."""

    def one(text: str):
        value: Any = text.strip()
        if value.lstrip("-").isdigit():
            value = int(value)
        else:
            value = value.lower()
        try:
            CommOptions.from_kwargs(**{**ALONE_WITH.get(keyword, {}), keyword: value})
        except OptionError as e:
            raise argparse.ArgumentTypeError(str(e) + (" (comma-separated for several)" if many else "")) from None
        return value

    def parse(text: str):
        if not many:
            return one(text)
        items = [one(t) for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected one or more comma-separated values, got {text!r}")
        return list(dict.fromkeys(items))

    parse.__name__ = keyword  # argparse names the type in "invalid <type> value"
    return parse


def int_type(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """An argparse type for an integer in [low, high] (transports.option_types.bounded's
    check; argparse names the flag: "argument --np: must be >= 1, got 0")."""

    def parse(text: str) -> int:
        value: Any = text.strip()
        if value.lstrip("-").isdigit():
            value = int(value)
        try:
            return bounded(value, "value", low, high)
        except OptionError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix("value ")) from None

    parse.__name__ = "integer"
    return parse


def add_option(
    parser, flag: str, default: Any = None, help: str | None = None, *, choices=None, keyword: str = "", many=False
):
    """Flag `flag` for Communicator option `keyword` (default: the flag's name with dashes as
    underscores), typed by option_type(keyword, many); `choices`: the option's Choice, whose
    words argparse lists."""
    keyword = keyword or flag.lstrip("-").replace("-", "_")
    extra = {} if choices is None else {"choices": choices.words()}
    return parser.add_argument(flag, default=default, type=option_type(keyword, many), help=help, **extra)


def add_np(parser, help: str, *, type: Callable[[str], Any] | None = None, nodes: bool = False) -> None:
    """--np (`help`: what the ranks run as; `type`: default a whole number from 1) with
    --oversubscribe beside it (host_limits.check_ranks reads both); `nodes`: --nodes after
    them, the simulated nodes the ranks split into."""
    parser.add_argument("--np", type=type or int_type(1), default=None, help=help)
    parser.add_argument(
        "--oversubscribe",
        action="store_true",
        help=f"with --np: allow more than {host_limits.RANKS_PER_CPU} ranks per CPU (never more memory "
        "than the host has)",
    )
    if nodes:
        parser.add_argument(
            "--nodes",
            type=int_type(1),
            default=None,
            help="simulated nodes: the ranks split into this many nodes of consecutive ranks (COMMREF_NODES)",
        )


def add_timeout_and_threads(parser, threads: int) -> None:
    """A bench program's --timeout (seconds, every wait; validate_timeout checks it) and
    -t/--threads (ranks as threads when not under mpiexec, `threads` by default)."""
    parser.add_argument("--timeout", type=float, default=60.0, help="deadline of every wait, seconds (default 60)")
    parser.add_argument(
        "-t",
        "--threads",
        type=int_type(1),
        default=threads,
        help=f"ranks as threads of this process when not under mpiexec (ThreadWorld; default {threads})",
    )


def validate_timeout(args) -> None:
    """ValueError unless add_timeout_and_threads' --timeout is a positive number of seconds."""
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {args.timeout}")
