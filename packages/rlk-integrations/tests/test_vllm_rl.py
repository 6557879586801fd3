"""rlk inside vLLM for the RL loop (the real engine, CPU build): weight updates pushed in buckets
through ``collective_rpc`` with the prefix cache reset, a bad bucket that changes nothing, the
staleness guard, ``processed_logprobs`` at temperatures other than 1 with and without top-k /
top-p, and three GRPO steps whose importance ratio is exactly 1; stock vLLM on the same
checkpoint does not give the trainer's bits.

The checkpoint has head_dim 64 (:mod:`vllm_checkpoints`: the stock control runs vLLM's own CPU
attention on it). One rlk engine serves the module (its last test leaves it dead: a refused
step ends vLLM's engine); the stock control starts its own.
"""

from __future__ import annotations

import time

import pytest
import torch
from vllm_helpers import (  # skips without vLLM
    load_trainer,
    prompts,
    rv,
    start_engine,
    write_checkpoint,
)

import rlk_integrations.adapters.vllm.worker as rvw
from rlk_integrations.adapters.vllm.loop import TransformersTrainer, as_sample, grpo_loop, sample
from rlk_integrations.engine import training
from rlk_integrations.engine.engines import Sample
from rlk_integrations.tools import zoo

pytestmark = pytest.mark.slow

NEW = 4
TEMPERATURES = (0.6, 0.7, 1.0, 1.3)
#: (top_k, top_p) of the sampling: none, top-k, top-p, both.
TRUNCATIONS = ((-1, 1.0), (20, 1.0), (-1, 0.9), (20, 0.9))
#: The GRPO steps' SGD learning rate: large enough that most bf16 weights move every step.
LR = 1.0
#: vLLM's engine arguments here, besides vllm_helpers.ENGINE's: a step holds the whole batch of
#: the temperature test (33 short requests).
ENGINE = dict(max_num_seqs=16, max_num_batched_tokens=256)


def start(path: str, **kw):
    return start_engine(path, **{**ENGINE, **kw})


def differing(trainer, samples: list[Sample], temperature: float) -> list[int]:
    """Indices of the samples whose log-probabilities are not the recompute's bits."""
    train = training.recompute_logprobs(trainer, samples, 3, temperature=temperature)
    return [i for i, (s, lp) in enumerate(zip(samples, train)) if not torch.equal(s.logprobs, lp)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-hd64"))
    write_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def llm(checkpoint):
    engine = start(checkpoint, **rv.engine_args(logprobs_mode="processed_logprobs"))
    yield engine
    engine.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def any_temperature(llm):
    """One batch: every temperature x truncation, two seeded prompts each (rows of different
    temperatures sampled together), plus one greedy request."""
    from vllm import SamplingParams

    cases = [(t, k, p) for t in TEMPERATURES for k, p in TRUNCATIONS]
    ps = prompts([5, 8] * len(cases) + [6], seed=1)
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=p, max_tokens=NEW, logprobs=0, seed=i)
        for i, (t, k, p) in enumerate(c for c in cases for _ in range(2))
    ] + [SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=0)]
    got = [s[0] for s in sample(llm, ps, params)]
    return cases, got


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_processed_logprobs_equal_the_recompute_at_any_temperature(
    checkpoint, any_temperature, temperature
):
    """``processed_logprobs``: the value of a token sampled at temperature T, with or without
    top-k / top-p, is ``recompute_logprobs(temperature=T)``'s, bit for bit."""
    trainer = load_trainer(checkpoint)
    cases, got = any_temperature
    mine = [got[2 * i + j] for i, c in enumerate(cases) if c[0] == temperature for j in (0, 1)]
    assert len(mine) == 2 * len(TRUNCATIONS)
    assert differing(trainer, mine, temperature) == []
    if temperature != 1.0:  # the temperature matters: at 1 these values are not the bits
        assert differing(trainer, mine, 1.0) == list(range(len(mine)))


def test_greedy_processed_logprobs_are_temperature_one(checkpoint, any_temperature):
    _, got = any_temperature
    assert differing(load_trainer(checkpoint), got[-1:], 1.0) == []


def test_prompt_logprobs_are_temperature_one(llm, checkpoint):
    """``prompt_logprobs`` of a request sampled at 0.7 in processed mode: vLLM computes them
    from the raw logits, and they are the recompute's bits at temperature 1 (not at 0.7)."""
    from vllm import SamplingParams

    p = prompts([7], seed=12)[0]
    sp = SamplingParams(temperature=0.7, max_tokens=1, prompt_logprobs=0, seed=1)
    (out,) = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)
    lps = torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], p[1:])])
    prompt = Sample(p[:1], p[1:], lps)
    assert differing(load_trainer(checkpoint), [prompt], 1.0) == []
    assert differing(load_trainer(checkpoint), [prompt], 0.7) == [0]


def named_weights(model) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach().clone()) for n, p in model.named_parameters()]


def perturbed(checkpoint, seed: int):
    """The trainer with every parameter moved by seeded noise (a stand-in for a training step)."""
    model = load_trainer(checkpoint)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((torch.randn(p.shape, generator=g) * 0.05).to(p.dtype))
    return model


def test_a_weight_update_in_buckets_resets_the_prefix_cache(llm, checkpoint):
    """New weights pushed in buckets of 3 tensors (``update_weights``): the next generation reads
    no block cached with the old weights and gives the new trainer's bits. The control: the same
    push without the reset serves the prompt's cached prefix, whose values are not the new
    trainer's."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.7, max_tokens=NEW, logprobs=0, seed=3)
    long = prompts([70], seed=7)
    sample(llm, long, sp)  # the prefix cache now holds the old weights' keys and values
    new = perturbed(checkpoint, seed=1)
    llm.collective_rpc("rlk_update_weights", args=(rvw.pack(named_weights(new)),))
    (hit,) = llm.generate([{"prompt_token_ids": long[0]}], sp, use_tqdm=False)
    assert hit.num_cached_tokens >= 64
    assert differing(new, [as_sample(hit)], 0.7) == [0], "a stale cached prefix went unnoticed"

    newer = perturbed(checkpoint, seed=2)
    assert rv.update_weights(llm, named_weights(newer), bucket_size=3) == 0
    (miss,) = llm.generate([{"prompt_token_ids": long[0]}], sp, use_tqdm=False)
    assert miss.num_cached_tokens == 0
    got = [as_sample(miss)] + [s[0] for s in sample(llm, prompts([5, 9], seed=8), sp)]
    assert differing(newer, got, 0.7) == []
    assert differing(load_trainer(checkpoint), got, 0.7) == [0, 1, 2]
    rv.update_weights(llm, named_weights(load_trainer(checkpoint)))  # back to the checkpoint


def test_a_bad_bucket_changes_no_weight(llm, checkpoint):
    """A bucket with an unknown name, a wrong shape and a non-floating dtype among good tensors:
    an error naming all three, no parameter stale, and the model still the checkpoint's."""
    from vllm import SamplingParams

    good = named_weights(perturbed(checkpoint, seed=3))
    bad = good[:2] + [
        ("model.layers.9.mlp.up_proj.weight", good[0][1]),
        (good[2][0], good[2][1][:1]),
        (good[3][0], good[3][1].to(torch.int32)),
    ]
    with pytest.raises(Exception, match="no weight changed, the bucket has 3 bad entries") as e:
        llm.collective_rpc("rlk_update_weights", args=(rvw.pack(bad),))
    for named in (
        "'model.layers.9.mlp.up_proj.weight' is no parameter",
        good[2][0],
        good[3][0],
    ):
        assert named in str(e.value)
    assert llm.collective_rpc("rlk_stale_parameters") == [[]]
    sp = SamplingParams(temperature=0.7, max_tokens=NEW, logprobs=0, seed=5)
    got = [s[0] for s in sample(llm, prompts([6, 7], seed=9), sp)]
    assert differing(load_trainer(checkpoint), got, 0.7) == []


def test_a_declared_partial_update_samples_the_mix(llm, checkpoint):
    """Three tensors pushed with ``partial=True``: nothing is stale, and generation gives the
    bits of the checkpoint with those three replaced."""
    from vllm import SamplingParams

    new = named_weights(perturbed(checkpoint, seed=4))[:3]
    assert rv.update_weights(llm, new, partial=True) == 0
    mix = load_trainer(checkpoint)
    with torch.no_grad():
        params = dict(mix.named_parameters())
        for name, t in new:
            params[name].copy_(t)
    sp = SamplingParams(temperature=1.3, top_k=20, max_tokens=NEW, logprobs=0, seed=6)
    got = [s[0] for s in sample(llm, prompts([6, 9], seed=10), sp)]
    assert differing(mix, got, 1.3) == []
    assert differing(load_trainer(checkpoint), got, 1.3) == [0, 1]
    rv.update_weights(llm, named_weights(load_trainer(checkpoint)))


def test_grpo_loop_importance_ratio_is_one_at_every_step(llm, checkpoint):
    """Three GRPO steps (``loop.grpo_loop``): vLLM samples (temperature 0.7, n = 4), the trainer
    on rlk recomputes the log-probabilities and updates, the new weights go into vLLM
    (``update_weights``, buckets of 8). The recompute equals the rollout's log-probabilities bit
    for bit at every step (importance ratio exactly 1), and the weights did change."""
    trainer = TransformersTrainer(load_trainer(checkpoint), lr=LR)
    start_weights = named_weights(trainer.model)
    try:
        steps = list(grpo_loop(llm, trainer, prompts([5, 7], seed=11), 3, new_tokens=NEW,
                               seed=1))  # fmt: skip
        assert [s.max_abs_dlogp for s in steps] == [0.0, 0.0, 0.0]
        assert all(len(s.samples) == 8 for s in steps)
        moved = [
            n
            for (n, a), (_, b) in zip(start_weights, named_weights(trainer.model))
            if not torch.equal(a, b)
        ]
        assert len(moved) > len(start_weights) // 2, moved
    finally:
        rv.update_weights(llm, start_weights)


@pytest.fixture(scope="module")
def stock(checkpoint):
    """Stock vLLM (its model class, CPU attention and sampler) on the same checkpoint."""
    engine = start(checkpoint, logprobs_mode="processed_logprobs", block_size=32)
    yield engine
    engine.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_stock_vllm_differs(stock, checkpoint, temperature):
    """The negative control: stock vLLM's processed log-probabilities (no truncation; at
    temperature 1 they are its raw ones) are not the recompute's bits, so a GRPO step on them
    has an importance ratio other than 1; by rounding only."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=temperature, n=4, max_tokens=NEW, logprobs=0, seed=100)
    samples = [s for group in sample(stock, prompts([5, 7], seed=11), sp) for s in group]
    trainer = load_trainer(checkpoint)
    assert len(differing(trainer, samples, temperature)) == len(samples)
    train = training.recompute_logprobs(trainer, samples, 3, temperature=temperature)
    assert all(torch.allclose(s.logprobs, lp, atol=0.1) for s, lp in zip(samples, train))


def test_qwen3_moe_routes_as_the_trainer(tmp_path):
    """Qwen3-MoE (``tiny-qwen3-moe``: 16 experts, 4 per token) on rlk in vLLM: the checkpoint's
    per-expert tensors load into the fused experts, and the processed log-probabilities at
    temperature 0.7 are the trainer's bits (a token routed to other experts would not be)."""
    from vllm import SamplingParams

    zoo.load_model("tiny-qwen3-moe", dtype=torch.bfloat16).save_pretrained(tmp_path)
    engine = start(str(tmp_path), **rv.engine_args(logprobs_mode="processed_logprobs"))
    try:
        params = [
            SamplingParams(temperature=0.7, max_tokens=6, logprobs=0, seed=i) for i in range(3)
        ]
        got = [s[0] for s in sample(engine, prompts([5, 9, 12], seed=2), params)]
    finally:
        engine.llm_engine.engine_core.shutdown()
    trainer = load_trainer(str(tmp_path))
    assert differing(trainer, got, 0.7) == []
    assert differing(trainer, got, 1.0) == [0, 1, 2]


def test_an_incomplete_update_refuses_to_generate(llm, checkpoint):
    """One bucket of three tensors and no more: the worker refuses the next step (its log names
    how many tensors are stale; test_vllm_options.py checks the message), and the call ends with
    vLLM's EngineDeadError at once, not a hang. The engine is dead after it: this is the
    module's last use of ``llm``."""
    from vllm import SamplingParams
    from vllm.v1.engine.exceptions import EngineDeadError

    new = named_weights(perturbed(checkpoint, seed=5))
    bucket = rvw.pack(new[:3])
    assert llm.collective_rpc("rlk_update_weights", args=(bucket,)) == [len(new) - 3]
    assert len(llm.collective_rpc("rlk_stale_parameters")[0]) == len(new) - 3
    start_time = time.monotonic()
    with pytest.raises(EngineDeadError):
        llm.generate(
            [{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False
        )
    assert time.monotonic() - start_time < 60
