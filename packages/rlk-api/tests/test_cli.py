"""The ``rlk`` command's entry point: it answers ``--help`` without importing torch, and the
commands of other distributions (entry-point group ``rlk.commands``) come in as
``rlk_cli.Command`` records; a known one that is not installed, or is broken, is a one-line
error saying why."""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys

import pytest

import rlk_cli
import rlk_commands


def test_help_and_version_do_not_import_torch():
    """The entry point parses without importing torch, so --help and --version answer at once;
    so does the --help of every installed plugin command (``rlk consistency`` with
    rlk-integrations)."""
    code = (
        "import sys, rlk_cli, rlk_commands\n"
        "plugins = [[name, '--help'] for name in rlk_commands.plugin_commands()]\n"
        "own = [['--help'], ['--version'], ['info', '--help'], ['bench', '--help']]\n"
        "for argv in own + plugins:\n"
        "    try:\n"
        "        rlk_cli.main(argv)\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, e.code\n"
        "assert 'torch' not in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def _entry_points(monkeypatch, *eps):
    monkeypatch.setattr(
        importlib.metadata, "entry_points", lambda group: [e for e in eps if e.group == group]
    )


def test_a_known_command_not_installed_says_what_to_install(capsys, monkeypatch):
    _entry_points(monkeypatch)
    assert "consistency" in rlk_commands.parser().format_help()
    for argv in (["consistency"], ["consistency", "--model", "tiny"], ["consistency", "-h"]):
        assert rlk_cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err == (
            "rlk: error: `rlk consistency` comes with rlk-integrations, which is not installed: "
            'pip install "rlk[transformers]"\n'
        )


def test_a_broken_command_is_reported_by_name(capsys, monkeypatch):
    """An entry point that fails to load, or names something else than a Command, makes its
    command an error; the other commands keep working."""
    ep = importlib.metadata.EntryPoint
    _entry_points(
        monkeypatch,
        ep("consistency", "rlk_no_such_module:CMD", "rlk.commands"),
        ep("other", "argparse:ArgumentParser", "rlk.commands"),
    )
    assert rlk_cli.main(["consistency", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "`rlk consistency` cannot run: its entry point rlk_no_such_module:CMD failed to " in err
    assert "ModuleNotFoundError" in err and err.count("\n") == 1
    assert rlk_cli.main(["other"]) == 2
    assert "argparse:ArgumentParser is not an rlk_cli.Command" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        rlk_cli.main(["info", "--nosuch"])
    assert e.value.code == 2
    assert "unrecognized arguments: --nosuch" in capsys.readouterr().err


def test_a_plugin_command_runs_and_its_backend_errors_are_one_line(capsys, monkeypatch):
    from rlk.plugins import BackendError

    seen = {}

    def add_arguments(p: argparse.ArgumentParser) -> None:
        p.add_argument("--backend")

    def run(args: argparse.Namespace) -> int:
        seen["backend"] = args.backend
        if args.backend == "bogus":
            raise BackendError("unknown rlk backend 'bogus'")
        return 0

    cmd = rlk_cli.Command(help="a test command", add_arguments=add_arguments, run=run)
    monkeypatch.setattr(rlk_commands, "plugin_commands", lambda: {"probe": cmd})
    assert "a test command" in rlk_commands.parser().format_help()
    assert rlk_cli.main(["probe", "--backend", "triton"]) == 0 and seen == {"backend": "triton"}
    assert rlk_cli.main(["probe", "--backend", "bogus"]) == 2
    assert capsys.readouterr().err == "rlk: error: unknown rlk backend 'bogus'\n"


def _framework_ok():
    return {"name": "fw", "tested": "1.0", "installed": "1.0", "ok": True, "note": "selected"}


def test_info_shows_the_integrations_checks(capsys, monkeypatch):
    """``rlk info`` lists each check of the ``rlk.info`` group (an integration's framework
    release); one whose import fails is listed by name as not usable, and the command goes on."""
    import types

    from rlk import cli

    monkeypatch.setitem(sys.modules, "rlk_info_probe", types.SimpleNamespace(info=_framework_ok))
    ep = importlib.metadata.EntryPoint
    _entry_points(
        monkeypatch,
        ep("fw", "rlk_info_probe:info", "rlk.info"),
        ep("gone", "rlk_no_such_module:info", "rlk.info"),
    )
    found = {i["name"]: i for i in cli.info_dict()["integrations"]}
    assert found["fw"] == _framework_ok()
    assert found["gone"]["ok"] is False and "ModuleNotFoundError" in found["gone"]["note"]
    cli._print_info(cli.info_dict())
    out = capsys.readouterr().out
    assert "   fw         tested 1.0, installed 1.0: ok (selected)" in out
    assert "   gone       not usable (broken: ModuleNotFoundError" in out
