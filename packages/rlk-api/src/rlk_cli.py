"""The ``rlk`` command's entry point (``[project.scripts] rlk = "rlk_cli:main"``).

:func:`main` parses the arguments first (:mod:`rlk_commands`, which imports neither torch nor
rlk), so ``rlk --help`` and usage errors answer at once, and only then imports :mod:`rlk.cli`,
where the command runs. Nothing in rlk imports this module: ``rlk.cli.main`` is the same
command for a process that has imported rlk already.

Other distributions' commands are :class:`Command` records (``rlk_commands.Command``) named by
entry points of the group ``rlk.commands``.
"""

from __future__ import annotations

import sys

from rlk_commands import Command, parse  # noqa: F401  (Command: see above)


def main(argv: list[str] | None = None) -> int:
    """Run ``rlk`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    args = parse(argv)
    if isinstance(args, int):
        return args
    from rlk import cli  # (imports torch: only once the arguments parsed)

    return cli.run(args, argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
