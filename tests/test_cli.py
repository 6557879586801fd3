"""``rlk consistency`` checks its arguments before it builds a model: a usage error is one line,
``rlk: error: ...``, with exit status 2 and no traceback."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from rlk import cli  # noqa: E402


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
    from rlk import consistency

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


def test_help_and_version_do_not_import_torch():
    """The entry point parses without importing torch, so --help and --version answer at once."""
    import subprocess
    import sys

    code = (
        "import sys, rlk_cli\n"
        "for argv in (['--help'], ['--version'], ['consistency', '--help']):\n"
        "    try:\n"
        "        rlk_cli.main(argv)\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, e.code\n"
        "assert 'torch' not in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_tp_larger_than_the_gpus_is_a_usage_error(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert cli.main(["consistency", "--device", "cuda", "--leaves", "8", "--train-tp", "2"]) == 2
    assert "tensor-parallel size 2 needs 2 GPUs, this machine has 1" in capsys.readouterr().err
