"""TRL's ``use_vllm=True`` (colocate) on rlk's model in vLLM (the real CPU build): TRL builds
the engine (``external_launcher``, one process), pushes the trainer's weights into rlk's
``load_weights`` before every generation, and the ``sampling/sampling_logp_difference/max`` it
logs is 0 at every step at temperature 0.7. The negative control runs vLLM's own model classes
in the same TRL run: the metric is not 0.

vLLM 0.32's CPU build packs each linear layer's weight for its GEMM at load and leaves an empty
parameter behind, so a stock model cannot take TRL's weight sync at all (``AttributeError:
'Parameter' object has no attribute 'weight_loader'``): the control trains at learning rate 0
and skips the sync (the engine keeps the checkpoint's weights, which are the trainer's).
"""

from __future__ import annotations

import os

import pytest
import torch
from vllm_helpers import VOCAB, write_checkpoint  # skips without vLLM

if os.environ.get("RLK_REQUIRE_VLLM") != "1":
    pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from rlk_integrations.adapters import trl as rtrl  # noqa: E402
from rlk_integrations.adapters.trl import generation as trl_generation  # noqa: E402
from rlk_integrations.tools import zoo  # noqa: E402

pytestmark = pytest.mark.slow

MISMATCH = "sampling/sampling_logp_difference/max"
STEPS = 3


def _reward(completions, **kwargs):
    """Any reward that varies within a group (so the weights move): 0.1 per digit."""
    return [0.1 * sum(ch.isdigit() for ch in c) for c in completions]


@pytest.fixture(scope="module", autouse=True)
def _environment():
    """TRL's colocated engine sets RANK, WORLD_SIZE, MASTER_ADDR/PORT and vLLM's
    VLLM_ENABLE_V1_MULTIPROCESSING=0 (external_launcher) in this process: undone for the tests
    that run after these."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The head_dim-64 tiny Qwen2 (stock vLLM's CPU attention takes it) with the character
    tokenizer: TRL's engine loads both from the model's ``name_or_path``."""
    path = str(tmp_path_factory.mktemp("tiny-trl-vllm"))
    write_checkpoint(path)
    rtrl.char_tokenizer(VOCAB).save_pretrained(path)
    return path


def _config(tmp_path, **kw) -> GRPOConfig:
    return GRPOConfig(
        **dict(
            output_dir=str(tmp_path),
            per_device_train_batch_size=4,
            num_generations=2,
            max_completion_length=4,
            max_steps=STEPS,
            learning_rate=1e-2,  # large enough to move bf16 weights every step
            bf16=False,  # the weights are bf16 already
            use_cpu=True,
            report_to=[],
            logging_steps=1,
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
            temperature=0.7,
            use_vllm=True,
            vllm_mode="colocate",
            vllm_importance_sampling_correction=True,  # TRL logs the metric with it
            vllm_gpu_memory_utilization=0.1,  # on CPU: the host memory share of the KV cache
            vllm_max_model_length=64,
        )
        | kw
    )


def _train(cls, checkpoint, args, **kw):
    trainer = cls(
        zoo.load_model(checkpoint, dtype=torch.bfloat16),
        reward_funcs=_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["1+2=", "13+24=", "7+1=", "20+22="]}),
        processing_class=rtrl.char_tokenizer(VOCAB),
        **kw,
    )
    try:
        trainer.train()
    finally:  # one engine per process at a time
        trainer.vllm_generation.llm.llm_engine.engine_core.shutdown()
    return [h for h in trainer.state.log_history if "loss" in h], trainer


class _Recording(rtrl.RLKGRPOTrainer):
    """Records, at each generation, what TRL's weight sync did to the engine's model."""

    def _init_check(self):
        super()._init_check()
        self.seen = []
        self.start = {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def _generate_single_turn(self, *args, **kwargs):
        engine_model = trl_generation._vllm_model(self.vllm_generation.llm)
        calls = []
        stock_load = engine_model.load_weights

        def load_weights(weights):
            calls.append(1)
            return stock_load(weights)

        engine_model.load_weights = load_weights
        try:
            out = super()._generate_single_turn(*args, **kwargs)
        finally:
            del engine_model.load_weights
        mine = dict(self.model.named_parameters())
        served = dict(engine_model.named_parameters())
        self.seen.append(
            dict(
                engine=type(engine_model).__name__,
                loads=len(calls),
                params=len(mine),
                same=sorted(served) == sorted(mine)
                and all(torch.equal(served[n], p) for n, p in mine.items()),
                moved=not all(torch.equal(self.start[n], p) for n, p in mine.items()),
            )
        )
        return out


def test_trl_vllm_colocate_samples_through_rlk(checkpoint, tmp_path):
    """Three steps: each generation follows TRL's push of every parameter into rlk's model
    (the engine then holds the trainer's bits, which have moved from the checkpoint's after
    the first step), and TRL's logged difference is 0 with the importance ratio exactly 1."""
    logs, trainer = _train(_Recording, checkpoint, _config(tmp_path))
    assert [h[MISMATCH] for h in logs] == [0.0] * STEPS
    for key in ("min", "max"):
        assert [h[f"sampling/importance_sampling_ratio/{key}"] for h in logs] == [1.0] * STEPS
    seen = trainer.seen
    assert [s["engine"] for s in seen] == ["RLKQwen2ForCausalLM"] * STEPS
    assert all(s["loads"] == s["params"] and s["same"] for s in seen)
    assert [s["moved"] for s in seen] == [False] + [True] * (STEPS - 1)


def test_stock_vllm_in_trl_differs(checkpoint, tmp_path):
    """The negative control: vLLM's own Qwen2 in the same TRL run (learning rate 0, no weight
    sync: see the module) logs a non-zero difference at every step."""

    class Stock(rtrl.RLKGRPOTrainer):
        def _build_vllm(self, make_llm, trl_kwargs):
            llm = make_llm(**trl_kwargs, enforce_eager=True, dtype="bfloat16")
            self.engine = type(trl_generation._vllm_model(llm)).__name__
            return llm

        def _generate_single_turn(self, *args, **kwargs):
            self._last_loaded_step = self.state.global_step  # TRL skips its sync
            return super()._generate_single_turn(*args, **kwargs)

    args = _config(tmp_path, learning_rate=0.0)
    logs, trainer = _train(Stock, checkpoint, args, check_logprobs=False)
    assert trainer.engine == "Qwen2ForCausalLM"
    assert len(logs) == STEPS and all(h[MISMATCH] > 0 for h in logs)


def test_the_engine_hook_fails_closed():
    """The hook on TRL's ``vllm.LLM`` passes TRL's arguments on and puts the class back; a TRL
    that builds no engine through it (so would sample on vLLM's own model) is an error."""
    from trl.generation import vllm_generation

    stock = vllm_generation.LLM
    seen = []
    with trl_generation._llm_built_by(lambda make, kwargs: seen.append((make, kwargs)) or "engine"):
        assert vllm_generation.LLM(model="ckpt", seed=0) == "engine"
    assert seen == [(stock, {"model": "ckpt", "seed": 0})]
    assert vllm_generation.LLM is stock
    with (
        pytest.raises(RuntimeError, match="built no vllm.LLM"),
        trl_generation._llm_built_by(lambda make, kwargs: None),
    ):
        pass
    assert vllm_generation.LLM is stock
