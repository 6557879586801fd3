"""rlk inside vLLM (the real engine, CPU build): the log-probability vLLM reports for each sampled
token equals the training recompute on the same tokens bit for bit, through prefix-cache hits,
chunked prefill, staggered arrivals and n > 1; stock vLLM on the same checkpoint does not
(test_consistency_vllm_row_is_exact here, and test_vllm_rl.py's control at head_dim 64).

Skips, saying why, when vLLM (rlk_integrations.adapters.vllm.TESTED_VLLM) is not installed, and when
its engine cannot start on this machine unless RLK_REQUIRE_VLLM=1 (``nox -s tests`` sets it: there a
start failure fails). One engine per module: starting one takes about 20 s on 2 cores.
"""

from __future__ import annotations

import pytest
import torch
from vllm_helpers import VOCAB, load_trainer, prompts, rv, start_engine  # skips without vLLM

from rlk_integrations.engine import training
from rlk_integrations.engine.engines import Sample
from rlk_integrations.tools import zoo

# Starting vLLM's engine takes about 20 s on 2 cores: stage 2 of nox -s tests (and stage 4, with
# vLLM installed).
pytestmark = pytest.mark.slow

NEW = 4
#: vLLM's engine arguments of every engine here, besides vllm_helpers.ENGINE's (blocks of 16
#: tokens, prefix caching): small steps, so that a prompt of 100 tokens fills blocks and is
#: prefilled in chunks. vLLM 0.32's CPU runner fails
#: a seeded request whose prefill is chunked (it rewinds the request's generator by an offset,
#: which a CPU generator does not have: "CPU Generator does not use offset"), so the seeded
#: requests here are short and the long prompt is sampled greedily.
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, enable_chunked_prefill=True)


def write_checkpoint(path: str, name: str = "tiny") -> None:
    """A built-in tiny model (head_dim 32, which vLLM's CPU attention takes too), seeded random
    bf16 weights, saved as safetensors."""
    zoo.load_model(name, dtype=torch.bfloat16).save_pretrained(path)


def start(path: str, **kw):
    return start_engine(path, **{**ENGINE, **kw})


def run(llm, prompt_list, seeds, n=1, max_tokens=NEW):
    """Generate (a seed of None: greedy); returns per prompt the list of ``n`` :class:`Sample`
    (vLLM's logprobs) and the request outputs."""
    from vllm import SamplingParams

    params = [
        SamplingParams(temperature=1.0, max_tokens=max_tokens, logprobs=0, seed=s, n=n)
        if s is not None
        else SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0)
        for s in seeds
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_list], params, use_tqdm=False)
    return [[_sample(o.prompt_token_ids, c) for c in o.outputs] for o in outs], outs


def _sample(prompt, completion) -> Sample:
    ids = list(completion.token_ids)
    lps = [d[t].logprob for d, t in zip(completion.logprobs, ids)]
    return Sample(list(prompt), ids, torch.tensor(lps, dtype=torch.float32))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-vllm"))
    write_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def trainer(checkpoint):
    return load_trainer(checkpoint)


@pytest.fixture(scope="module")
def llm(checkpoint):
    engine = start(checkpoint, **rv.engine_args())
    yield engine
    engine.llm_engine.engine_core.shutdown()


def assert_trainer_equal(trainer, samples: list[Sample]) -> None:
    """vLLM's log-probabilities == the packed training recompute (temperature 1: vLLM's raw
    log-probabilities), bit for bit, in micro-batches of another composition."""
    order = list(reversed(range(len(samples))))
    train = training.recompute_logprobs(trainer, samples, 2, order=order, temperature=1.0)
    for s, lp in zip(samples, train):
        assert len(s.response) == len(s.logprobs) > 0
        assert torch.equal(s.logprobs, lp), (s.logprobs, lp)


@pytest.fixture(scope="module")
def base(llm):
    """Three seeded requests of 5, 9 and 11 tokens, sampled together."""
    ps = prompts([5, 9, 11])
    got, _ = run(llm, ps, seeds=[1, 2, 3])
    return ps, [g[0] for g in got]


@pytest.fixture(scope="module")
def long(llm):
    """A 100-token prompt, prefilled in chunks (64 + 36 tokens), greedy; then the same prompt
    again, its first 6 blocks of 16 now a prefix-cache hit."""
    p = prompts([100], seed=2)
    miss, miss_out = run(llm, p, seeds=[None])
    hit, hit_out = run(llm, p, seeds=[None])
    return miss[0][0], miss_out[0], hit[0][0], hit_out[0]


def test_logprobs_equal_training_recompute(trainer, base):
    _, samples = base
    assert_trainer_equal(trainer, samples)


def test_chunked_prefill_of_a_long_prompt(trainer, long):
    miss, miss_out, _, _ = long
    assert miss_out.num_cached_tokens == 0
    assert_trainer_equal(trainer, [miss])


def test_prefix_cache_hit_gives_the_bits_of_the_miss(long):
    miss, _, hit, hit_out = long
    assert hit_out.num_cached_tokens >= 96, hit_out.num_cached_tokens
    assert hit.response == miss.response
    assert torch.equal(hit.logprobs, miss.logprobs)


def test_staggered_arrivals(llm, trainer, base):
    """Requests join a running batch at different steps; each gets the bits it got in the batch
    of :func:`base`, and the newcomer the trainer's."""
    from vllm import SamplingParams

    ps, samples = base
    engine = llm.llm_engine
    extra = prompts([7], seed=1)[0]
    arrivals = {0: ("a", ps[0], 1), 2: ("b", ps[2], 3), 3: ("c", extra, 9)}
    done, step = {}, 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        if step in arrivals:
            rid, p, seed = arrivals[step]
            sp = SamplingParams(temperature=1.0, max_tokens=NEW, logprobs=0, seed=seed)
            engine.add_request(rid, {"prompt_token_ids": p}, sp)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
    for rid, ref in (("a", samples[0]), ("b", samples[2])):
        got = _sample(done[rid].prompt_token_ids, done[rid].outputs[0])
        assert got.response == ref.response and torch.equal(got.logprobs, ref.logprobs)
    assert_trainer_equal(trainer, [_sample(done["c"].prompt_token_ids, done["c"].outputs[0])])


def test_n_samples_per_prompt(llm, trainer):
    got, _ = run(llm, prompts([7], seed=3), seeds=[5], n=3)
    assert len(got[0]) == 3
    assert len({tuple(s.response) for s in got[0]}) > 1  # n different samples
    assert_trainer_equal(trainer, got[0])


def test_raw_logprobs_are_temperature_one_at_any_temperature(llm, trainer):
    """``raw_logprobs`` (this engine's mode): sampled at 0.6, 0.7 and 1.3, with and without
    top-k / top-p, the values are ``log_softmax(logits)``'s, the recompute at temperature 1; the
    control: recomputed at the sampling temperature they differ."""
    from vllm import SamplingParams

    temps = [(0.6, -1, 1.0), (0.7, 20, 0.9), (1.3, -1, 0.9)]
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=p, max_tokens=NEW, logprobs=0, seed=i)
        for i, (t, k, p) in enumerate(temps)
    ]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts([5, 8, 6], seed=6)], params, use_tqdm=False
    )
    samples = [_sample(o.prompt_token_ids, o.outputs[0]) for o in outs]
    assert_trainer_equal(trainer, samples)
    for s, (t, _, _) in zip(samples, temps):
        (lp,) = training.recompute_logprobs(trainer, [s], 1, temperature=t)
        assert not torch.equal(s.logprobs, lp)


def test_full_vocabulary_logprobs_are_refused_before_the_engine(llm):
    """``logprobs=-1`` (vLLM turns it into the vocabulary size before the sampler runs) and a
    count as large as the vocabulary: a ValueError naming them, in the caller's process."""
    from vllm import SamplingParams

    for field, k in (("logprobs", -1), ("logprobs", VOCAB), ("prompt_logprobs", -1)):
        with pytest.raises(ValueError, match=f"do not serve {field}={k}"):
            llm.generate(
                [{"prompt_token_ids": [1, 2, 3]}],
                SamplingParams(max_tokens=1, **{field: k}),
                use_tqdm=False,
            )


def test_an_architecture_rlk_does_not_cover_is_refused_at_start(tmp_path):
    from transformers import MistralConfig
    from vllm import LLM

    cfg = MistralConfig(hidden_size=128, num_attention_heads=4, num_hidden_layers=1)
    cfg.architectures = ["MistralForCausalLM"]
    cfg.save_pretrained(tmp_path)
    with pytest.raises(NotImplementedError, match="not the checkpoint's 'MistralForCausalLM'"):
        LLM(model=str(tmp_path), **{**ENGINE, **rv.engine_args()})


def test_consistency_vllm_row_is_exact(tmp_path):
    """``rlk consistency --rollout-engine vllm --temperature 0.7`` on a tiny Qwen2 of head_dim 64
    (:mod:`vllm_checkpoints`): the rlk-in-vLLM row shows no mismatch; both stock rows (the padded
    torch rollout, and stock vLLM's own model and kernels) differ from stock transformers'
    recompute, by rounding only."""
    from vllm_helpers import write_checkpoint as write_hd64

    from rlk_integrations.tools import consistency

    write_hd64(str(tmp_path))
    report = consistency.run(
        str(tmp_path), prompts=3, new_tokens=4, temperature=0.7, rollout_modes=("vllm",)
    )
    rows = {(r["side"], r["rollout_mode"]): r for r in report["rows"]}
    assert set(rows) == {("stock", "padded"), ("stock", "vllm-stock"), ("rlk", "vllm")}
    assert "vllm-stock" not in report["rollout_skipped"]
    assert consistency.ok(report) and rows[("rlk", "vllm")]["tokens"] == 12
    for mode in ("padded", "vllm-stock"):
        stock = rows[("stock", mode)]
        assert stock["tokens"] == 12 and stock["frac_differ"] > 0, stock
        assert 0 < stock["max_abs_dlogp"] < 0.1, stock
    assert "vllm-stock row: vLLM's own model classes" in consistency.format_table(report)


def test_cpu_head_sizes_are_the_installed_vllms():
    """The stock-vLLM row's head_dim check (``VLLMRollout.stock_twin``) uses vLLM's own list."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from rlk_integrations.adapters.vllm.engine import CPU_HEAD_SIZES

    assert list(CPU_HEAD_SIZES) == CPUAttentionBackend.get_supported_head_sizes()


def test_preempted_requests_keep_the_bits(checkpoint, trainer):
    """A KV cache of 6 usable blocks (96 tokens; vLLM keeps one more) for four requests of
    10 + 20 tokens: vLLM preempts some and recomputes their prefix later; every
    log-probability is still the trainer's."""
    small = dict(max_model_len=64, num_gpu_blocks_override=7, disable_log_stats=False)
    llm = start(checkpoint, **small, **rv.engine_args())
    try:
        got, _ = run(llm, prompts([10, 10, 10, 10], seed=4), seeds=[None] * 4, max_tokens=20)
        preempted = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert preempted > 0, "the small cache forced no preemption"
    assert_trainer_equal(trainer, [g[0] for g in got])


def test_top_k_logprobs_are_rlk_values(llm, trainer):
    """``logprobs=2``: every returned value (the sampled token's and the top two) is the
    trainer's log-probability of that token after the same tokens."""
    from vllm import SamplingParams

    p = prompts([6], seed=5)[0]
    sp = SamplingParams(temperature=1.0, max_tokens=2, logprobs=2, seed=4)
    out = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0]
    asked = []
    for j, d in enumerate(out.logprobs):
        context = p + list(out.token_ids[:j])
        assert len(d) >= 2
        asked += [(Sample(context, [t], torch.tensor([v.logprob])), t) for t, v in d.items()]
    train = training.recompute_logprobs(trainer, [s for s, _ in asked], 4, temperature=1.0)
    for (s, _), lp in zip(asked, train):
        assert torch.equal(s.logprobs, lp), (s.logprobs, lp)
