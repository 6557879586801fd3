"""``rlk consistency`` comes from rlk-integrations through the entry-point group
``rlk.commands`` (and ``rlk bench``'s e2e family through ``rlk.bench``). The command checks its
arguments before it builds a model: a usage error is one line, ``rlk: error: ...``, with exit
status 2 and no traceback."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import rlk_cli  # noqa: E402
import rlk_commands  # noqa: E402
from rlk import bench, cli  # noqa: E402


def test_the_command_and_the_family_are_registered():
    import rlk_integrations_cli
    from rlk_integrations.tools import e2e_bench

    assert rlk_commands.plugin_commands()["consistency"] is rlk_integrations_cli.CONSISTENCY
    assert bench.available() == list(bench.FAMILIES)
    assert bench.family_module("e2e") is e2e_bench
    assert bench.family_module("e2e-long") is e2e_bench.LONG
    assert bench.family_module("e2e-heldout") is e2e_bench.HELDOUT_FAMILY


def test_help_lists_the_command(capsys):
    """(That --help imports no torch is checked for every installed plugin command by
    rlk-api's tests.)"""
    for argv in (["--help"], ["consistency", "--help"]):
        with pytest.raises(SystemExit) as e:
            rlk_cli.main(argv)
        assert e.value.code == 0
    out = capsys.readouterr().out
    assert "rollout vs training log-prob mismatch" in out
    assert "--rollout-tp ROLLOUT_TP" in out
    import rlk_integrations_cli
    from rlk_integrations.tools import zoo

    # The help's list of built-in models is written out (the command line imports no torch):
    # it names every model of the zoo, and only those.
    assert sorted(rlk_integrations_cli.BUILTIN_MODELS) == sorted(zoo.CONFIGS)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "nosuch"], "unknown model 'nosuch'"),
        (["--leaves", "3"], "leaves must be a power of two, got 3"),
        (["--train-tp", "2"], "train_tp > 1 needs leaves"),
        (["--rollout-tp", "2"], "rollout_tp > 1 needs leaves"),
        (["--leaves", "8", "--rollout-tp", "3"], "rollout_tp must be a power of two dividing"),
        (["--backend", "bogus"], "unknown rlk backend 'bogus'"),
        (["--prompt-len", "x"], "--prompt-len must be MIN:MAX"),
        (["--prompt-len", "9:3"], "prompt_len must be MIN:MAX with 1 <= MIN <= MAX"),
        (["--prompts", "0"], "prompts must be an int >= 1"),
        (["--micro-batch", "0"], "micro_batch must be an int >= 1"),
        (["--temperature", "-1"], "temperature must be a finite number >= 0"),
        (["--device", "nodevice"], "device 'nodevice' is not a torch device"),
    ],
)
def test_usage_errors_are_one_line(argv, message, capsys, monkeypatch):
    from rlk_integrations.tools import consistency

    def must_not_run(*args, **kwargs):
        raise AssertionError("a model was built before the arguments were checked")

    monkeypatch.setattr(consistency, "_run", must_not_run)
    rc = cli.main(["consistency", *argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("rlk: error: ") and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_cuda_without_a_gpu_is_a_usage_error(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["consistency", "--device", "cuda"]) == 2
    assert "sees no CUDA/ROCm GPU" in capsys.readouterr().err


def test_tp_larger_than_the_gpus_is_a_usage_error(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert cli.main(["consistency", "--device", "cuda", "--leaves", "8", "--train-tp", "2"]) == 2
    assert "tensor-parallel size 2 needs 2 GPUs, this machine has 1" in capsys.readouterr().err


def test_the_config_is_checked_where_it_is_built_and_passed_whole(monkeypatch):
    import dataclasses

    from rlk_integrations.tools import consistency

    with pytest.raises(consistency.UsageError, match="leaves must be a power of two, got 3"):
        consistency.ConsistencyConfig.of("tiny", leaves=3)
    with pytest.raises(consistency.UsageError, match="page_size must be an int >= 1"):
        consistency.ConsistencyConfig.of("tiny", page_size=0)
    config = consistency.ConsistencyConfig.of("tiny", page_size=8, leaves=8, rollout_tp=2)
    assert (config.rollout.page_size, config.leaves, config.rollout.tp) == (8, 8, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.prompts = 3
    seen = []
    monkeypatch.setattr(consistency, "_run", lambda c, progress: seen.append(c) or {})
    consistency.run(config)
    consistency.run("tiny", page_size=8, leaves=8, rollout_tp=2)
    assert seen == [config, config]  # the same settings, whichever way they came
    with pytest.raises(TypeError, match="not both"):
        consistency.run(config, prompts=3)
