"""rlk inside verl 0.9.1 (the real release, on CPU: FSDP2 over gloo, verl's CPU platform from
the plugin): verl's actor engine selected by ``VERL_ENGINE_VENDOR=rlk`` gives the log-probs and
entropies of rlk's rollout bit for bit (bf16 over fp32 master weights, any micro-batching; five
architectures at world size 1, four at 2), verl's own log-prob path on the same engine does not
(nor does its ``rollout_probs_diff_max`` in a GRPO step), and options rlk cannot honour raise
naming them. The GRPO loop with rlk's engine runs on verl's vLLM server: test_verl_rollout.py.

Skips when verl (rlk_integrations.adapters.verl.TESTED_VERL) is not installed, unless
RLK_REQUIRE_VERL=1 (stage 4 of ``nox -s tests``, which installs it): then it fails.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
import torch

pytestmark = pytest.mark.slow  # verl's import and engines: stage 4 of nox -s tests

# verl fixes its platform once, at its first use: the CPU one before anything imports verl.
os.environ.setdefault("VERL_PLATFORM", "cpu")
os.environ.setdefault("VERL_ENGINE_VENDOR", "rlk")
pytest.importorskip("transformers")
import verl_workers as vw  # noqa: E402  (sets VERL_PLATFORM=cpu before verl is imported)

import rlk_integrations.adapters.verl as rv  # noqa: E402

vw.require_verl()


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A one-process gloo group for the module's engines (verl's engine reads the rank)."""
    import torch.distributed as dist

    init = tmp_path_factory.mktemp("pg") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each model's tiny checkpoint and rlk rollout samples of it (prompts of 3 to 7 tokens,
    6 new tokens each, saved beside it for the spawned ranks)."""
    root = tmp_path_factory.mktemp("verl")
    for name in vw.ALL_MODELS:
        path = vw.checkpoint(str(root / name), name)
        samples = vw.sample(vw.rollout_model(path), (5, 3, 7, 4), 6, seed=1)
        torch.save(samples, os.path.join(path, "samples.pt"))
    return root


def _samples(checkpoints, name):
    return torch.load(checkpoints / name / "samples.pt", weights_only=False)


def test_plugin_loads_with_verl():
    """verl loads its ``verl.plugins`` entry points at ``import verl`` and drops their errors:
    a fresh process shows the engine and the CPU platform registered by it."""
    code = (
        "import verl\n"
        "from verl.workers.engine.base import EngineRegistry as R\n"
        "from verl.plugin.platform.platform_manager import PlatformRegistry as P\n"
        "t = R._engines['language_model']\n"
        "print(sorted(k for b in ('fsdp', 'fsdp2') for k, c in t[b].items()"
        " if c.__name__ == 'RLKEngineWithLMHead'), P.get('cpu').__name__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_PLUGINS"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    keys = [(d, rv.VENDOR) for d in rv.DEVICES]
    assert out.stdout.strip().splitlines()[-1] == f"{sorted(keys * 2)} PlatformCPU"


def test_external_lib(checkpoints):
    """The plugin module is what ``actor_rollout_ref.model.external_lib`` names (verl imports it
    with its model config, errors raised)."""
    from verl.workers.config import HFModelConfig

    HFModelConfig(path=str(checkpoints / "tiny"), load_tokenizer=False, external_lib=rv.PLUGIN)
    with pytest.raises(ModuleNotFoundError):
        HFModelConfig(
            path=str(checkpoints / "tiny"), load_tokenizer=False, external_lib=rv.PLUGIN + "_x"
        )


@pytest.mark.parametrize("name", vw.ALL_MODELS)
def test_infer_batch_bitwise(group, checkpoints, name):
    """``infer_batch`` on one rank: log-probs and entropies equal rlk's rollout bit for bit, in
    micro-batches of 1, 2 and all 4 samples, and in verl's dynamic batches (at most 20 tokens,
    balanced and reordered by verl) of the samples reversed; verl's own log-probs on the same
    engine (full logits, its log-softmax under autocast) differ."""
    path = str(checkpoints / name)
    samples, model = _samples(checkpoints, name), vw.rollout_model(path)
    eng = vw.engine(path)
    for micro in (1, 2, 4):
        vw.check_equal(eng, model, samples, micro, f"{name} micro {micro}")
    vw.check_equal(eng, model, samples[::-1], -20, f"{name} dynamic, reversed")
    lp, _ = vw.infer(vw.engine(path, stock=True), samples, 2)
    assert any(not torch.equal(lp[i, : len(s.response)], s.logprobs) for i, s in enumerate(samples))


def test_fsdp_input_casting_would_reach_rlk(group, checkpoints, monkeypatch):
    """Why the engine builds FSDP2's policy without ``cast_forward_inputs``: with verl's own
    policy the fp32 rotary tables reach the layers in bf16, and rlk refuses them."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from rlk_integrations.adapters.verl import engine

    monkeypatch.setattr(engine, "_uncast_policy", MixedPrecisionPolicy)
    path = str(checkpoints / "tiny")
    with pytest.raises(RuntimeError, match="rotary tables are not rlk's"):
        vw.infer(vw.engine(path), _samples(checkpoints, "tiny")[:2], 2)


def test_infer_batch_two_ranks(checkpoints, tmp_path):
    """The same at world size 2 (two spawned processes, gloo): each rank's half of the batch
    gives rlk's rollout bits, on every model."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(
        vw.rank_worker,
        args=(2, str(tmp_path / "pg"), str(checkpoints)),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + 900
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the two ranks did not finish in 900 s")


def test_grpo_step_with_verls_own_logprobs_differs(group, checkpoints):
    """The GRPO loop's negative control: a step of verl's pieces with verl's own log-probs on
    the same engine gives a non-zero ``rollout_probs_diff_max`` against rlk's rollout (the loop
    with rlk's engine, 0 at every step, runs on verl's vLLM server: test_verl_rollout.py)."""
    assert vw.grpo(str(checkpoints / "tiny"), 1, stock=True)[0] > 0


REFUSED = [
    ("engine", {"ulysses_sequence_parallel_size": 2}, "ulysses_sequence_parallel_size=2"),
    ("engine", {"strategy": "fsdp"}, "strategy='fsdp'"),
    ("model", {"use_remove_padding": False}, "use_remove_padding=False"),
    ("model", {"lora_rank": 8}, "lora_rank=8"),
    ("model", {"use_liger": True}, "use_liger=True"),
    ("model", {"tiled_mlp": {"enabled": True, "num_shards": 4}}, "tiled_mlp.enabled=True"),
    (
        "model",
        {"use_fused_kernels": True, "fused_kernel_options": {"impl_backend": "triton"}},
        "impl_backend='triton'",
    ),
]


@pytest.mark.parametrize("where, option, named", REFUSED, ids=[r[2] for r in REFUSED])
def test_engine_refuses_by_name(checkpoints, where, option, named):
    """An option rlk's engine cannot honour is a ``NotImplementedError`` naming it, raised when
    verl builds the engine, before any weight is loaded (no process group is needed)."""
    from rlk_integrations.adapters.verl.engine import RLKEngineWithLMHead

    cfgs = vw.configs(str(checkpoints / "tiny"), **{where: option})
    with pytest.raises(NotImplementedError, match=re.escape(named)):
        RLKEngineWithLMHead(*cfgs)


def test_engine_refuses_architecture_and_release(tmp_path, checkpoints, monkeypatch):
    """An architecture rlk does not cover, and another verl release, raise before any work."""
    from transformers import MistralConfig

    from rlk_integrations.adapters.verl import release
    from rlk_integrations.adapters.verl.engine import RLKEngineWithLMHead

    MistralConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=512,
        architectures=["MistralForCausalLM"],
    ).save_pretrained(tmp_path)
    with pytest.raises(NotImplementedError, match="model_type='mistral'"):
        RLKEngineWithLMHead(*vw.configs(str(tmp_path)))
    monkeypatch.setattr(release, "installed_verl", lambda: "0.9.2")
    with pytest.raises(RuntimeError, match="verl 0.9.1 only.*found 0.9.2"):
        RLKEngineWithLMHead(*vw.configs(str(checkpoints / "tiny")))


def test_engine_names_a_trl_without_the_value_head_model(checkpoints, monkeypatch):
    """A TRL that lacks ``AutoModelForCausalLMWithValueHead`` (1.16, say) makes verl 0.9.1's
    every model build fail inside its monkey patch: the engine names the cause first, and
    ``rlk info`` marks verl not ok."""
    import types

    from rlk.cli import info_dict
    from rlk_integrations.adapters.verl.engine import RLKEngineWithLMHead
    from rlk_integrations.adapters.verl.release import trl_conflict

    fake = types.ModuleType("trl")
    fake.__version__ = "1.16.0"
    monkeypatch.setitem(sys.modules, "trl", fake)
    with pytest.raises(RuntimeError, match="installed trl 1.16.0 has none.*pip uninstall trl"):
        RLKEngineWithLMHead(*vw.configs(str(checkpoints / "tiny")))
    found = {i["name"]: i for i in info_dict()["integrations"]}
    assert found["verl"]["ok"] is False and "pip uninstall trl" in found["verl"]["note"]
    fake.AutoModelForCausalLMWithValueHead = object  # a TRL that has it passes the check
    assert trl_conflict() is None


def _main_ppo_config(extra: list[str]):
    """verl's own ``ppo_trainer`` Hydra config with ``overrides()`` and ``extra`` applied."""
    import verl.trainer.config as cfg_pkg
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(os.path.dirname(cfg_pkg.__file__), version_base=None):
        return compose("ppo_trainer", overrides=rv.overrides("Qwen3ForCausalLM") + extra)


def test_overrides_apply_to_verls_config():
    """The overrides compose onto verl's own ``main_ppo`` config: the plugin is its
    ``external_lib``, vLLM gets rlk's model class as a dict, and ``check_config`` passes."""
    cfg = _main_ppo_config([])
    arr = cfg.actor_rollout_ref
    assert arr.model.external_lib == rv.PLUGIN
    assert dict(arr.rollout.engine_kwargs.vllm.hf_overrides) == {
        "architectures": ["RLKQwen3ForCausalLM"]
    }
    rv.check_config(cfg)
    # The tempered log-probabilities: any rollout temperature.
    rv.check_config(_main_ppo_config(["actor_rollout_ref.rollout.temperature=0.7"]))
    with pytest.raises(NotImplementedError, match="rlk's rollout serves"):
        rv.overrides("MistralForCausalLM")


CONFIG_REFUSED = [
    (
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        "ulysses_sequence_parallel_size=2",
    ),
    ("actor_rollout_ref.model.use_remove_padding=False", "use_remove_padding=False"),
    ("actor_rollout_ref.model.lora_rank=16", "lora_rank=16"),
    ("actor_rollout_ref.model.use_liger=True", "use_liger=True"),
    ("actor_rollout_ref.model.tiled_mlp.enabled=True", "tiled_mlp.enabled=True"),
    ("actor_rollout_ref.actor.use_prefix_grouper=True", "use_prefix_grouper=True"),
    ("actor_rollout_ref.rollout.name=sglang", "rollout.name='sglang'"),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size=2", "tensor_model_parallel_size=2"),
    (
        "actor_rollout_ref.rollout.logprobs_mode=raw_logprobs"
        " actor_rollout_ref.rollout.temperature=0.7",
        "temperature=0.7 with logprobs_mode='raw_logprobs'",
    ),
    (
        "actor_rollout_ref.rollout.logprobs_mode=processed_logits",
        "logprobs_mode='processed_logits'",
    ),
]


@pytest.mark.parametrize("line, named", CONFIG_REFUSED, ids=[c[1] for c in CONFIG_REFUSED])
def test_check_config_refuses_by_name(line, named):
    """``check_config`` on a ``main_ppo`` config names each option rlk cannot honour."""
    with pytest.raises(NotImplementedError, match=re.escape(named)):
        rv.check_config(_main_ppo_config(line.split()))


def test_rlk_info_shows_the_verl_release():
    """``rlk info`` (its ``rlk.info`` entry point) shows the release rlk's engine is written for
    and the installed one."""
    from rlk.cli import info_dict

    found = {i["name"]: i for i in info_dict()["integrations"]}
    assert found["verl"]["tested"] == found["verl"]["installed"] == rv.TESTED_VERL
    assert found["verl"]["ok"] is True


def test_example_command_line_composes():
    """``examples/verl_grpo.sh``'s ``main_ppo`` arguments, with ``overrides()`` where the script
    puts them, compose onto verl's own config and pass ``check_config`` (the script itself is
    not run: it wants GPUs)."""
    import shlex
    from pathlib import Path

    script = (Path(__file__).resolve().parents[3] / "examples" / "verl_grpo.sh").read_text()
    command = script[script.index("python -m verl.trainer.main_ppo") :]
    args = shlex.split(command.replace("\\\n", " "), comments=False)[3:]
    args = [a for a in args if not a.startswith("$")]  # "${RLK_OVERRIDES[@]}" and "$@"
    assert len(args) > 30 and all("=" in a for a in args), args
    cfg = _main_ppo_config([a.replace("$DATA", "/data").replace("$MODEL", "m") for a in args])
    assert cfg.algorithm.adv_estimator == "grpo"
    rv.check_config(cfg)
