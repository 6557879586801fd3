"""Helpers of test_verl.py, importable by name in the processes it spawns: a tiny checkpoint,
verl's FSDP2 engine built the way verl's workers build it, a batch in verl's layout, and the
rank worker of the two-process test.

verl has no CPU platform: the plugin registers one (``cpu``) and ``VERL_PLATFORM=cpu`` selects
it, so that verl's engine runs FSDP2 over gloo on the host.
"""

from __future__ import annotations

import os

os.environ.setdefault("VERL_PLATFORM", "cpu")
os.environ.setdefault("VERL_ENGINE_VENDOR", "rlk")

import torch  # noqa: E402

import rlk_integrations.adapters.verl as rv  # noqa: E402
from rlk_integrations.engine import rollout, training  # noqa: E402
from rlk_integrations.models import transformers as rt  # noqa: E402
from rlk_integrations.tools import zoo  # noqa: E402


def require_verl() -> None:
    """Skip the importing test module without verl :data:`~rlk_integrations.adapters.verl.
    TESTED_VERL`, unless RLK_REQUIRE_VERL=1 (stage 4 of ``nox -s tests``, which installs it):
    then fail."""
    import pytest

    try:
        rv.check_verl()
    except RuntimeError as e:
        if os.environ.get("RLK_REQUIRE_VERL") == "1":
            raise
        pytest.skip(f"verl tests need verl {rv.TESTED_VERL}: {e}", allow_module_level=True)


#: The models of the two-rank test; the one-rank test runs every architecture rlk patches.
MODELS = ("tiny", "tiny-llama", "tiny-qwen3", "tiny-qwen3-moe")
ALL_MODELS = (*MODELS, "tiny-qwen2-moe", "tiny-deepseek-v3")
VOCAB = 512
#: verl's mixed precision: bf16 compute over fp32 master weights.
MIXED = dict(param_dtype="bf16", reduce_dtype="fp32", buffer_dtype="fp32")


def checkpoint(path: str, name: str) -> str:
    """A built-in tiny model's seeded bf16 weights saved as safetensors under ``path``."""
    zoo.load_model(name, dtype=torch.bfloat16).save_pretrained(path)
    return path


def configs(path: str, *, model: dict | None = None, engine: dict | None = None):
    """verl's model, engine, optimizer and checkpoint configs of an actor on ``path``."""
    from verl.trainer.config.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig

    # external_lib: verl imports the plugin with the model config, as overrides() has it.
    model = {"external_lib": rv.PLUGIN, **(model or {})}
    mc = HFModelConfig(path=path, load_tokenizer=False, **model)
    # use_torch_compile: verl compiles its entropy on the stock path (the negative control).
    ec = FSDPEngineConfig(
        **{
            "strategy": "fsdp2",
            "use_torch_compile": False,
            "mixed_precision": MIXED,
            **(engine or {}),
        }
    )
    oc = FSDPOptimizerConfig(lr=1e-2, total_training_steps=10)
    return mc, ec, oc, CheckpointConfig()


def engine(path: str, *, stock: bool = False, **kw):
    """verl's FSDP2 actor engine on ``path``, initialised: rlk's, selected by verl's registry
    (``VERL_ENGINE_VENDOR=rlk``), or with ``stock`` verl's own log-probs on the same patched
    model (the negative control)."""
    cfgs = configs(path, **kw)
    from verl.workers.engine.base import EngineRegistry

    from rlk_integrations.adapters.verl.engine import RLKEngineWithLMHead

    cls = EngineRegistry.get_engine_cls("language_model", "fsdp2")
    assert cls is RLKEngineWithLMHead, cls
    if stock:
        cls = type("StockLogprobs", (RLKEngineWithLMHead,), {"rlk_logprobs": False})
    eng = cls(*cfgs)
    eng.initialize()
    return eng


def rollout_model(path: str) -> torch.nn.Module:
    """rlk's rollout model: the checkpoint in bf16, patched."""
    return rt.patch_model(zoo.load_model(path, dtype=torch.bfloat16))


def sample(model, prompt_lens, new_tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in prompt_lens]
    seeds = [seed * 1000 + i for i in range(len(prompts))]
    return rollout.generate(model, prompts, new_tokens, seeds=seeds).samples


def padded(samples) -> dict[str, torch.Tensor]:
    """verl's rollout batch of ``samples``: left-padded prompts, right-padded responses, the
    masks, positions and the rollout's log-probs (``rollout_log_probs``)."""
    b = len(samples)
    p = max(len(s.prompt) for s in samples)
    r = max(len(s.response) for s in samples)
    prompts = torch.zeros(b, p, dtype=torch.long)
    responses = torch.zeros(b, r, dtype=torch.long)
    mask = torch.zeros(b, p + r, dtype=torch.long)
    response_mask = torch.zeros(b, r, dtype=torch.long)
    rollout_lp = torch.zeros(b, r)
    for i, s in enumerate(samples):
        n, m = len(s.prompt), len(s.response)
        prompts[i, p - n :] = torch.tensor(s.prompt)
        responses[i, :m] = torch.tensor(s.response)
        mask[i, p - n : p + m] = 1
        response_mask[i, :m] = 1
        rollout_lp[i, :m] = s.logprobs
    return dict(
        prompts=prompts,
        responses=responses,
        input_ids=torch.cat([prompts, responses], 1),
        attention_mask=mask,
        response_mask=response_mask,
        position_ids=(mask.cumsum(1) - 1).clamp(min=0),
        rollout_log_probs=rollout_lp,
    )


def no_padding(batch: dict[str, torch.Tensor], **meta):
    """``batch`` as verl's actor receives it (``left_right_2_no_padding``), with ``meta`` and
    the engine keys verl's training worker adds."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    td = left_right_2_no_padding(TensorDict(dict(batch), batch_size=[len(batch["prompts"])]))
    keys = dict(use_remove_padding=True, temperature=1.0)
    tu.assign_non_tensor(td, **{**keys, **meta})
    return td


def micro(size: int) -> dict:
    """verl's micro-batching keys: ``size`` samples each, or with a negative ``size`` verl's
    dynamic batches of at most ``-size`` tokens (which it balances and reorders)."""
    if size < 0:
        return dict(use_dynamic_bsz=True, max_token_len_per_gpu=-size)
    return dict(use_dynamic_bsz=False, micro_batch_size_per_gpu=size)


def infer(eng, samples, micro_batch_size: int, temperature: float = 1.0):
    """``infer_batch``'s log-probs and entropies of the responses, ``[B, R]`` float32 each, as
    verl's trainer computes ``old_log_probs`` (``_compute_old_log_prob``) at the rollout's
    ``temperature``; micro-batches as :func:`micro` says."""
    from verl.workers.utils.padding import no_padding_2_padding

    td = no_padding(
        padded(samples),
        calculate_entropy=True,
        compute_loss=False,
        temperature=temperature,
        **micro(micro_batch_size),
    )
    with eng.eval_mode():
        out = eng.infer_batch(td)["model_output"]
    return (
        no_padding_2_padding(out["log_probs"], td).float(),
        no_padding_2_padding(out["entropy"], td).float(),
    )


def reference(model, samples):
    """rlk's own log-probs (the rollout's) and entropies of each sample's response."""
    with torch.no_grad():
        return training.packed_logprobs(model, samples, return_entropy=True)


def check_equal(eng, model, samples, micro_batch_size: int, tag: str) -> None:
    lp, ent = infer(eng, samples, micro_batch_size)
    _, ref_ent = reference(model, samples)
    for i, s in enumerate(samples):
        m = len(s.response)
        assert torch.equal(lp[i, :m], s.logprobs), f"{tag}: sample {i} log-probs"
        assert torch.equal(ent[i, :m], ref_ent[i]), f"{tag}: sample {i} entropy"


def rank_worker(rank: int, world: int, init_file: str, root: str) -> None:
    """One rank of the two-process test: each model's engine sharded over ``world`` ranks;
    this rank's half of the samples (as verl's dispatch splits a batch) gives rlk's rollout
    log-probs and entropies bit for bit."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for name in MODELS:
            path = os.path.join(root, name)
            samples = torch.load(os.path.join(path, "samples.pt"), weights_only=False)
            eng = engine(path)
            mine = samples[rank::world]
            check_equal(eng, rollout_model(path), mine, 2, f"rank {rank}/{world} {name}")
            del eng
    finally:
        dist.destroy_process_group()


def own_rollout(path: str):
    """rlk's own rollout for :func:`grpo`: ``(generate, push)``. ``generate(prompt_lens,
    seed)`` samples 6 new tokens per prompt with rlk's rollout model (bf16, patched);
    ``push(eng)`` copies the engine's ``get_per_tensor_param`` into it (bf16, as FSDP's mixed
    precision casts them)."""
    model = rollout_model(path)
    params = dict(model.named_parameters(remove_duplicate=False))

    def generate(lens: list[int], seed: int):
        return sample(model, lens, 6, seed=seed)

    def push(eng) -> None:
        weights, _ = eng.get_per_tensor_param()
        with torch.no_grad():
            for name, w in weights:
                params[name].copy_(w)

    return generate, push


def grpo(
    path: str,
    steps: int,
    *,
    stock: bool = False,
    group: int = 2,
    eng=None,
    rollout=None,
    temperature: float = 1.0,
) -> list[float]:
    """``steps`` GRPO steps from verl's own pieces: the rollout (``(generate, push)``,
    :func:`own_rollout` by default, or verl's vLLM server: :func:`server_rollout`) samples
    ``group`` responses per prompt at ``temperature``; verl's engine (``eng``, else a new one
    on ``path``, verl's stock log-probs with ``stock``) recomputes ``old_log_probs``
    (``infer_batch``); verl's ``calculate_debug_metrics`` compares them with the rollout's;
    ``core_algos``' GRPO advantage of a toy reward (the share of even tokens); the engine's
    ``train_batch`` with verl's ``ppo_loss`` (vanilla clipped policy loss); then the engine's
    weights are pushed into the rollout. Returns verl's ``training/rollout_probs_diff_max`` of
    each step; asserts the engine's weights moved."""
    import functools

    import numpy as np
    from verl import DataProto
    from verl.trainer.ppo import core_algos
    from verl.utils.debug.metrics import calculate_debug_metrics
    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss

    eng = eng if eng is not None else engine(path, stock=stock)
    generate, push = rollout if rollout is not None else own_rollout(path)
    actor = FSDPActorConfig(
        strategy="fsdp2", ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=2, rollout_n=group
    )
    loss = functools.partial(ppo_loss, actor)
    start = {k: w.clone() for k, w in eng.get_per_tensor_param()[0]}
    diffs = []
    for step in range(steps):
        samples = generate([n for n in (5, 3) for _ in range(group)], 10 + step)
        uid = np.array([i // group for i in range(len(samples))], dtype=object)
        batch = padded(samples)
        old, _ = infer(eng, samples, 2, temperature)
        metrics = calculate_debug_metrics(
            DataProto.from_dict(
                tensors={k: batch[k] for k in ("rollout_log_probs", "response_mask", "responses")}
                | {"old_log_probs": old}
            )
        )
        diffs.append(metrics["training/rollout_probs_diff_max"])
        mask = batch["response_mask"]
        score = ((batch["responses"] % 2 == 0) * mask).sum(1) / mask.sum(1)
        rewards = torch.zeros_like(old)
        rewards[torch.arange(len(samples)), mask.sum(1) - 1] = score
        adv, _ = core_algos.compute_grpo_outcome_advantage(
            token_level_rewards=rewards, response_mask=mask, index=uid
        )
        td = no_padding(
            dict(batch, old_log_probs=old, advantages=adv),
            calculate_entropy=False,
            compute_loss=True,
            global_batch_size=len(samples),
            temperature=temperature,
            **micro(2),
        )
        with eng.train_mode():
            eng.train_batch(td, loss_function=loss)
        push(eng)
    end = dict(eng.get_per_tensor_param()[0])
    assert any(not torch.equal(w, end[k]) for k, w in start.items()), "no weight moved"
    return diffs


# verl's vLLM rollout (test_verl_rollout.py): its server, vLLMHttpServer, as the named Ray actor
# verl's replica would start, without the GPU placement; weights pushed by its ServerAdapter.
#: The rollout's sampling (vLLM's SamplingParams), and the temperature the engine recomputes.
TEMPERATURE = 0.7


def rollout_configs(path: str, *, rlk: bool = True):
    """verl's rollout and model configs for a vLLM server on ``path``: ``overrides()``' engine
    arguments (rlk's model class by ``hf_overrides``, ``processed_logprobs``) and verl's
    ``load_format=dummy`` (the weights come from the trainer); with ``rlk`` False vLLM's own
    model, loading the checkpoint itself (stock vLLM's CPU layers cannot take a weight push:
    their repacking at load drops the parameters' ``weight_loader``). Sized for the CPU
    (eager, no sleep mode: it needs CUDA)."""
    from verl.workers.config import HFModelConfig, RolloutConfig
    from verl.workers.config.rollout import CheckpointEngineConfig

    from rlk_integrations.adapters.vllm import hf_overrides

    # The KV cache's size on the CPU (else a share of the host's memory, which a busy host
    # may not have free).
    vllm = {"block_size": 32, "kv_cache_memory_bytes": 64 << 20}  # vLLM CPU attention: 32s
    if rlk:
        vllm["hf_overrides"] = hf_overrides(path)
    config = RolloutConfig(
        name="vllm",
        tensor_model_parallel_size=1,
        temperature=TEMPERATURE,
        logprobs_mode="processed_logprobs",
        calculate_log_probs=True,
        enforce_eager=True,
        enable_sleep_mode=False,
        free_cache_engine=False,
        max_model_len=64,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        prompt_length=16,
        response_length=6,
        engine_kwargs={"vllm": vllm},
        checkpoint_engine=CheckpointEngineConfig(update_weights_bucket_megabytes=1),
        load_format="dummy" if rlk else "auto",
    )
    return config, HFModelConfig(path=path, external_lib=rv.PLUGIN)


def start_server(path: str, replica: int, *, rlk: bool = True):
    """verl's ``vLLMHttpServer`` as the Ray actor ``vllm_server_<replica>_0`` (the name verl's
    ``ServerAdapter`` looks up), its ``launch_server`` begun: returns (actor, launch ref)."""
    import ray
    from verl.workers.rollout.replica import RolloutMode
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    config, model = rollout_configs(path, rlk=rlk)
    actor = (
        ray.remote(vLLMHttpServer)
        .options(name=f"vllm_server_{replica}_0", num_cpus=0)
        .remote(config, model, RolloutMode.HYBRID, [], replica, 0, 1, 1, "")
    )
    return actor, actor.launch_server.remote()


def push_weights(eng, path: str, replica: int) -> None:
    """The trainer's weight sync as verl's worker does it (``update_weights``):
    ``get_per_tensor_param`` of the engine into verl's ``ServerAdapter.update_weights``, which
    streams them through its bucketed transfer (shared memory: the CPU has no IPC) into verl's
    worker extension in the vLLM worker, ``model.load_weights`` per bucket."""
    import asyncio

    from verl.workers.rollout.vllm_rollout import ServerAdapter

    config, model = rollout_configs(path)
    adapter = ServerAdapter(config, model, None, replica_rank=replica)
    params, peft = eng.get_per_tensor_param(layered_summon=False, base_sync_done=True)
    # Bounded: verl's sender waits on its socket for ever if the receiving worker died.
    sync = adapter.update_weights(params, peft_config=peft, base_sync_done=True)
    asyncio.run(asyncio.wait_for(sync, timeout=300))


def served(actor, prompts: list[list[int]], seed: int):
    """Each prompt's response from the server's ``generate`` (what verl's agent loop calls),
    with the log-probs it returns, as :class:`~rlk_integrations.engine.engines.Sample`."""
    import ray

    from rlk_integrations.engine.engines import Sample

    params = dict(temperature=TEMPERATURE, logprobs=True)
    refs = [
        actor.generate.remote(p, dict(params, seed=seed + i), f"r{i}")
        for i, p in enumerate(prompts)
    ]
    out = ray.get(refs, timeout=600)
    return [
        Sample(prompt=p, response=o.token_ids, logprobs=torch.tensor(o.log_probs))
        for p, o in zip(prompts, out)
    ]


def server_rollout(actor, path: str, replica: int):
    """verl's vLLM server (:func:`start_server`) as :func:`grpo`'s rollout: ``generate``
    samples seeded random prompts of the given lengths (:func:`served`, 6 new tokens at
    :data:`TEMPERATURE`), ``push`` is verl's weight sync (:func:`push_weights`)."""

    def generate(lens: list[int], seed: int):
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lens]
        return served(actor, prompts, seed)

    def push(eng) -> None:
        push_weights(eng, path, replica)

    return generate, push
