"""rlk inside TRL's GRPOTrainer (CPU, the Triton interpreter): the sampling log-probabilities
equal TRL's old and current ones bit for bit, the importance ratio of the first iteration is
exactly 1, and stock TRL on the same model differs; unsupported options are refused by name."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from rlk_integrations.adapters.trl import (  # noqa: E402
    RLKGRPOTrainer,
    StockGRPOTrainer,
    char_tokenizer,
    rollout_seeds,
)
from rlk_integrations.tools import zoo  # noqa: E402

# Prompts of different lengths: padded batches in TRL, packed rows in rlk.
PROMPTS = ["1+2=", "13+24=", "7+1=", "20+22="]
ANSWERS = ["3", "37", "8", "42"]
MISMATCH = "sampling/sampling_logp_difference/max"


def _reward(completions, answer, **kwargs):
    """Verifiable toy reward: 1 for the right answer, plus 0.1 per digit."""
    return [
        float(c.startswith(a)) + 0.1 * sum(ch.isdigit() for ch in c)
        for c, a in zip(completions, answer)
    ]


def _config(tmp_path, **kw) -> GRPOConfig:
    base = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        num_iterations=2,
        max_steps=2,
        learning_rate=1e-2,  # large enough to move bf16 weights in one step
        bf16=False,  # the weights are bf16 already: no autocast
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        gradient_checkpointing=False,
        disable_tqdm=True,
        seed=0,
    )
    base.update(kw)
    return GRPOConfig(**base)


def _dataset() -> Dataset:
    return Dataset.from_dict({"prompt": PROMPTS, "answer": ANSWERS})


def _model() -> torch.nn.Module:
    return zoo.load_model("tiny", dtype=torch.bfloat16)


def _trainer(cls, args: GRPOConfig, model=None, **kw):
    """A trainer of ``cls`` on the toy task (the tiny model unless ``model`` is given)."""
    return cls(
        _model() if model is None else model,
        reward_funcs=_reward,
        args=args,
        train_dataset=_dataset(),
        processing_class=char_tokenizer(zoo.CONFIGS["tiny"][1]["vocab_size"]),
        **kw,
    )


class _Recording(RLKGRPOTrainer):
    """Keeps, per optimizer step, the tensors TRL's loss sees."""

    def _init_check(self) -> None:
        super()._init_check()
        self.seen: list[dict[str, torch.Tensor]] = []

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        self.seen.append(
            dict(
                mask=inputs["completion_mask"].bool(),
                sampling=inputs["sampling_per_token_logps"].clone(),
                old=inputs["old_per_token_logps"].clone(),
                current=self._rlk_current.clone(),
            )
        )
        return loss


def test_rlk_grpo_sampling_equals_training(tmp_path):
    """Two GRPO steps, num_iterations=2 (one generation, two updates on it): at the first
    iteration the sampling, old and current log-probabilities are the same bits and the ratio
    is exactly 1; at the second the weights have moved, so the ratio is not."""
    trainer = _trainer(_Recording, _config(tmp_path))
    trainer.train()
    first, second = trainer.seen
    m = first["mask"]
    assert int(m.sum()) > 0
    assert torch.equal(first["sampling"][m], first["old"][m])
    assert torch.equal(first["current"][m], first["sampling"][m])
    assert torch.equal(torch.exp(first["current"] - first["old"])[m], torch.ones(int(m.sum())))
    # The same batch in the second iteration: old and sampling unchanged, current moved.
    assert torch.equal(second["old"], first["old"])
    assert not torch.equal(second["current"][m], second["old"][m])
    # The logged comparison (old at generation, current at the first iteration) is 0.
    logged = [h[MISMATCH] for h in trainer.state.log_history if MISMATCH in h]
    assert logged == [0.0]


def test_stock_trl_mismatch_is_not_zero(tmp_path):
    """The same run with TRL's own generation and log-probabilities on the unpatched model: the
    comparison the rlk trainer holds at 0 is not 0 here (so the test above can fail)."""
    trainer = _trainer(StockGRPOTrainer, _config(tmp_path))
    trainer.train()
    logged = [h[MISMATCH] for h in trainer.state.log_history if MISMATCH in h]
    assert len(logged) == 1 and logged[0] > 0


@pytest.mark.slow
def test_rlk_grpo_beta_checkpointing_and_sampling_options(tmp_path):
    """beta > 0 (a patched reference model, KL exactly 0 before the first update), gradient
    checkpointing, top-k / top-p / temperature, loss_type='grpo' and one iteration per
    generation: the comparison stays 0 at each step."""
    path = tmp_path / "model"
    _model().save_pretrained(path)  # TRL builds the reference model from the checkpoint
    model = zoo.load_model(str(path), dtype=torch.bfloat16)
    args = _config(
        tmp_path / "out", beta=0.1, num_iterations=1, gradient_checkpointing=True,
        loss_type="grpo", top_k=50, top_p=0.9, temperature=0.8, max_completion_length=6,
    )  # fmt: skip
    trainer = _trainer(RLKGRPOTrainer, args, model)
    trainer.train()
    logs = [h for h in trainer.state.log_history if MISMATCH in h]
    assert [h[MISMATCH] for h in logs] == [0.0, 0.0]
    assert logs[0]["kl"] == 0.0 and logs[1]["kl"] > 0


@pytest.mark.slow
def test_rlk_grpo_accumulation_chat_and_masked_truncation(tmp_path):
    """Gradient accumulation over a generation batch of several micro-batches, conversational
    prompts, two EOS ids, and mask_truncated_completions with every completion truncated (the
    micro-batches have no token to score and still train, with zero gradients)."""
    model = _model()
    model.generation_config.eos_token_id = [1, 20]  # "<eos>" and "1"
    tokenizer = char_tokenizer(zoo.CONFIGS["tiny"][1]["vocab_size"])
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    args = _config(
        tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        steps_per_generation=4, num_iterations=1, max_steps=1, loss_type="bnpo",
        mask_truncated_completions=True, max_completion_length=3,
    )  # fmt: skip
    chat = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": p}] for p in PROMPTS], "answer": ANSWERS}
    )
    trainer = RLKGRPOTrainer(
        model,
        reward_funcs=lambda completions, **kw: [float(len(c[0]["content"])) for c in completions],
        args=args,
        train_dataset=chat,
        processing_class=tokenizer,
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "step" in h]
    assert len(logs) == 1 and logs[0][MISMATCH] == 0.0


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (dict(use_vllm=True, vllm_mode="server"), "vllm_mode='server'"),
        (dict(use_vllm=True, vllm_enable_sleep_mode=True), "vllm_enable_sleep_mode"),
        (dict(use_vllm=True, vllm_model_impl="transformers"), "vllm_model_impl"),
        (dict(use_vllm=True, vllm_structured_outputs_regex="[0-9]+"), "structured_outputs"),
        (dict(min_p=0.1), "min_p"),
        (dict(repetition_penalty=1.1), "repetition_penalty"),
        (dict(generation_kwargs={"do_sample": True}), "generation_kwargs"),
        (dict(cache_implementation="static"), "cache_implementation"),
        (dict(cast_lm_head_to_fp32=True), "cast_lm_head_to_fp32"),
        (dict(torch_compile=True), "torch_compile"),
        (dict(use_transformers_continuous_batching=True), "use_transformers_continuous_batching"),
        (dict(bf16=True), "bf16=True over torch.float32"),
    ],
)
def test_unsupported_options_are_refused(tmp_path, options, named):
    model = zoo.load_model("tiny", dtype=torch.float32)
    with pytest.raises(ValueError, match=named):
        _trainer(RLKGRPOTrainer, _config(tmp_path, **options), model)


@pytest.mark.parametrize("argument", ["tools", "rollout_func", "environment_factory"])
def test_unsupported_trainer_arguments_are_refused(tmp_path, argument):
    with pytest.raises(ValueError, match=argument):
        _trainer(RLKGRPOTrainer, _config(tmp_path), **{argument: [lambda: None]})


def test_rollout_kwargs_checked(tmp_path):
    with pytest.raises(ValueError, match="temperature"):
        _trainer(RLKGRPOTrainer, _config(tmp_path), rollout_kwargs={"temperature": 0.5})
    with pytest.raises(ValueError, match="page_sise"):
        _trainer(RLKGRPOTrainer, _config(tmp_path), rollout_kwargs={"page_sise": 8})


class _Engines(RLKGRPOTrainer):
    """Records the rollout engine of each generation round and the completions' mask and
    sampling log-probabilities of each optimizer step."""

    def _init_check(self) -> None:
        super()._init_check()
        self.engines: list[object] = []
        self.seen: list[dict[str, torch.Tensor]] = []

    def _compute_loss(self, model, inputs):
        mask, sampling = inputs["completion_mask"].bool(), inputs["sampling_per_token_logps"]
        self.seen.append(dict(mask=mask, sampling=sampling.clone()))
        return super()._compute_loss(model, inputs)

    def _generate_single_turn(self, *args, **kwargs):
        out = super()._generate_single_turn(*args, **kwargs)
        self.engines.append(self._rlk_engine)
        return out


@pytest.mark.slow
def test_kept_rollout_engine_gives_a_fresh_engines_bits(tmp_path):
    """Two generation rounds with an optimizer step between them: the kept engine is built
    once, and its completions and sampling log-probabilities are the bits of a fresh engine per
    round (so the kept one samples from the updated weights)."""
    runs = {}
    for keep in (True, False):
        t = _trainer(_Engines, _config(tmp_path, num_iterations=1), keep_rollout_engine=keep)
        t.train()
        runs[keep] = t
    kept, fresh = runs[True], runs[False]
    assert len(kept.engines) == 2 and kept.engines[0] is kept.engines[1] is not None
    assert fresh.engines == [None, None]
    assert len(kept.seen) == len(fresh.seen) == 2
    for a, b in zip(kept.seen, fresh.seen):
        assert torch.equal(a["mask"], b["mask"])
        assert torch.equal(a["sampling"], b["sampling"])
    assert not torch.equal(kept.seen[0]["sampling"], kept.seen[1]["sampling"])


def test_kept_rollout_engine_grows_for_longer_prompts(tmp_path):
    trainer = _trainer(RLKGRPOTrainer, _config(tmp_path))
    sampling = dict(temperature=1.0, top_k=0, top_p=1.0)
    first = trainer._rollout_engine(trainer.model, [[1] * 10, [2] * 64], sampling, {})
    assert first.max_len == 64 + 8  # room for prompts: a power of two, at least 64
    assert trainer._rollout_engine(trainer.model, [[3] * 5], sampling, {}) is first
    grown = trainer._rollout_engine(trainer.model, [[1] * 65], sampling, {"page_size": 8})
    assert grown is not first and grown.max_len == 128 + 8 and grown.page_size == 8
    with pytest.raises(TypeError, match="keep_rollout_engine"):
        _trainer(RLKGRPOTrainer, _config(tmp_path), keep_rollout_engine=1)


def test_rollout_seeds():
    a = rollout_seeds(0, 0, 0, 8)
    assert a == rollout_seeds(0, 0, 0, 8)  # deterministic
    assert len(set(a + rollout_seeds(0, 1, 0, 8) + rollout_seeds(0, 0, 1, 8))) == 24
    assert all(0 <= s < 2**63 for s in a)
    with pytest.raises(ValueError, match="round_"):
        rollout_seeds(0, -1, 0, 8)


def test_char_tokenizer_round_trip():
    tok = char_tokenizer(512)
    ids = tok("13+24=")["input_ids"]
    assert tok.decode(ids) == "13+24="
    assert tok.decode([*ids, tok.eos_token_id], skip_special_tokens=True) == "13+24="
    assert len(tok) == 512


def test_graph_logprobs_gives_the_eager_bits(tmp_path):
    """graph_logprobs=True (on CPU the bucket runs eagerly, the same padded pass the graphs
    replay): every log-probability TRL's loss sees, and the trained weights, are the eager
    trainer's bits; the buckets are powers of two that hold every micro-batch."""
    runs = []
    for graphs in (False, True):
        trainer = _trainer(_Recording, _config(tmp_path / str(graphs)), graph_logprobs=graphs)
        trainer.train()
        runs.append(trainer)
    eager, graphed = runs
    assert len(eager.seen) == len(graphed.seen) == 2
    for a, b in zip(eager.seen, graphed.seen, strict=True):
        for k in ("old", "current"):
            assert torch.equal(a[k], b[k]), k
    for (n, p), q in zip(eager.model.named_parameters(), graphed.model.parameters(), strict=True):
        assert torch.equal(p, q), n
    assert not eager._rlk_graphs and graphed._rlk_graphs
    for g in graphed._rlk_graphs.values():
        assert all(v & (v - 1) == 0 for v in g.bucket.values()), g.bucket


def test_graph_logprobs_must_be_a_bool(tmp_path):
    with pytest.raises(TypeError, match="graph_logprobs"):
        _trainer(RLKGRPOTrainer, _config(tmp_path), graph_logprobs=1)
