"""The ``rlk`` command's arguments, parsed without importing torch (or rlk, which imports torch),
so that ``rlk --help``, ``rlk <command> --help``, ``rlk --version`` and argparse's usage errors
answer at once; :func:`parse` is what both ``rlk_cli.main`` (the command's entry point) and
``rlk.cli.main`` call before the command runs in :mod:`rlk.cli`.

Other distributions add commands through the entry-point group ``rlk.commands``: each entry point
names a :class:`Command` (rlk-integrations adds ``rlk consistency``), so that rlk itself imports
no kernel package and no engine. (``rlk_cli.Command`` is this class.)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

#: The entry-point group of the commands other distributions add.
COMMAND_GROUP = "rlk.commands"

#: The commands of rlk itself (run by :mod:`rlk.cli`); a plugin of the same name is not used.
BUILTIN_COMMANDS = ("info", "conformance", "bench")

#: Commands of other distributions, by name: the distribution and the install that bring it.
#: ``rlk <name>`` without it is an error saying so.
KNOWN_COMMANDS = {
    "consistency": ("rlk-integrations", 'pip install "rlk[transformers]"'),
}


@dataclass(frozen=True)
class Command:
    """A command another distribution adds to ``rlk`` (entry-point group ``rlk.commands``).

    ``add_arguments(parser)`` declares its arguments and must not import torch (``rlk --help``
    loads it); ``run(args)`` runs it and returns the exit status (it may import anything; an
    ``rlk.BackendError`` it raises is reported as a one-line error with exit status 2).

    Example (in the distribution's ``pyproject.toml``)::

        [project.entry-points."rlk.commands"]
        consistency = "rlk_integrations_cli:CONSISTENCY"
    """

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def plugin_commands() -> dict[str, Command | str]:
    """The commands of the group ``rlk.commands``, by name: the :class:`Command`, or why its
    entry point cannot be used (the reason is reported when the command is run)."""
    from importlib.metadata import entry_points

    found: dict[str, Command | str] = {}
    for ep in sorted(entry_points(group=COMMAND_GROUP), key=lambda e: e.name):
        if ep.name in BUILTIN_COMMANDS:
            continue
        if ep.name in found:
            found[ep.name] = f"more than one installed distribution declares `rlk {ep.name}`"
            continue
        try:
            cmd = ep.load()
        except Exception as e:  # a broken plugin must not break the other commands
            found[ep.name] = f"its entry point {ep.value} failed to load ({type(e).__name__}: {e})"
            continue
        if not isinstance(cmd, Command):
            found[ep.name] = f"its entry point {ep.value} is not an rlk_cli.Command"
            continue
        found[ep.name] = cmd
    return found


def _add_plugin_commands(sub: argparse._SubParsersAction) -> None:
    """One subcommand per plugin command, and a stub per known command that is not installed
    (or is broken): the stub takes any arguments and makes :func:`main` say what is wrong."""
    found = plugin_commands()
    for name in sorted(set(found) | set(KNOWN_COMMANDS)):
        cmd = found.get(name)
        if isinstance(cmd, Command):
            p = sub.add_parser(name, help=cmd.help)
            cmd.add_arguments(p)
            p.set_defaults(command=cmd)
            continue
        if cmd is None:
            dist, how = KNOWN_COMMANDS[name]
            why = f"`rlk {name}` comes with {dist}, which is not installed: {how}"
            short = f"(needs {dist}: {how})"
        else:
            why, short = f"`rlk {name}` cannot run: {cmd}", "(broken: run it to see why)"
        p = sub.add_parser(name, help=short, add_help=False)
        p.set_defaults(unusable=why)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rlk")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return "unknown"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rlk", description="Deterministic, batch-invariant ops for RL."
    )
    p.add_argument("--version", action="version", version=f"rlk {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True)
    pi = sub.add_parser("info", help="installed backends, availability, selection, versions")
    pi.add_argument("--json", action="store_true", help="machine-readable output")
    pc = sub.add_parser("conformance", help="check a backend against the numerics contract")
    pc.add_argument("--backend", default=None, help="backend name (default: the selected one)")
    pc.add_argument("--ops", default=None, help="comma-separated ops (default: all)")
    pc.add_argument("--device", default=None, help="torch device (default: cuda if present)")
    pc.add_argument("--json", default=None, metavar="FILE", help="also write the report as JSON")
    pc.add_argument("--full", action="store_true", help="real shapes (GPU) instead of quick ones")
    pc.add_argument("--quiet", action="store_true", help="no progress lines")
    _add_plugin_commands(sub)
    pb = sub.add_parser("bench", help="time every op family against the strongest peer on this GPU")
    pb.add_argument(
        "--only", default=None, help="comma-separated families (default: all): gemm, attention, "
        "norm, logprobs, sampling, moe, e2e, e2e-long, e2e-heldout, e2e-train-long (the e2e "
        "ones: with rlk-integrations)",
    )  # fmt: skip
    pb.add_argument("--quick", action="store_true", help="one or two shapes per family")
    pb.add_argument(
        "--json", default=None, nargs="?", const="", metavar="FILE",
        help="also write the report as JSON; without FILE, merged into this GPU kind's record, "
        "docs/benchmarks/<kind>.json (h100.json on an H100)",
    )  # fmt: skip
    pb.add_argument(
        "--markdown", default=None, nargs="?", const="", metavar="FILE",
        help="also write the tables as Markdown; without FILE, docs/benchmarks/<kind>.md",
    )  # fmt: skip
    pb.add_argument(
        "--render", default=None, nargs="+", metavar="JSON",
        help="measure nothing: turn earlier --json reports (several: parts of one run, e.g. one "
        "per GPU, merged) into Markdown (stdout or --markdown) and, with --json, one report",
    )  # fmt: skip
    pb.add_argument(
        "--mixed-commits", action="store_true",
        help="with --render: merge parts measured at different commits (each part keeps its "
        "commit, and the report names the parts measured at another commit than the first)",
    )  # fmt: skip
    return p


def parse(argv: list[str] | None = None) -> argparse.Namespace | int:
    """The command and its arguments from ``argv`` (default: ``sys.argv[1:]``), or exit status 2
    for a command that cannot run here (not installed, or broken: the reason is printed).
    ``--help``, ``--version`` and usage errors exit here, as argparse does."""
    p = parser()
    # parse_known_args: a stub of a command that is not installed takes any arguments.
    args, extra = p.parse_known_args(argv)
    if getattr(args, "unusable", None):
        print(f"rlk: error: {args.unusable}", file=sys.stderr)
        return 2
    if extra:
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    return args
