"""The generation helpers of :class:`~rlk_integrations.adapters.trl.RLKGRPOTrainer`: each
row's sampling seed (:func:`rollout_seeds`) and the cut at the first EOS id for rlk's paged
rollout; and, for ``use_vllm`` (colocate), the hook that has TRL build its ``vllm.LLM`` on
rlk's model classes and the accessor of that engine's model."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import trl

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def rollout_seeds(seed: int, round_: int, rank: int, n: int) -> list[int]:
    """The ``n`` sampling seeds of one generation round: row ``i`` gets a SplitMix64 hash of
    ``(seed, round_, rank, i)`` in ``[0, 2**63)``.

    Each completion of a group (TRL repeats a prompt ``num_generations`` times) gets its own
    seed, each round and each process new ones, and a run with the same ``args.seed`` draws the
    same completions again. Example: ``rollout_seeds(42, 0, 0, 4)`` -> four distinct ints.
    """
    for name, v in (("seed", seed), ("round_", round_), ("rank", rank), ("n", n)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    out = []
    for i in range(n):
        h = 0
        for part in (seed, round_, rank, i):
            h = _splitmix64(h ^ (part & _MASK64))
        out.append(h >> 1)
    return out


def _first_eos(tokens: list[int], eos: Sequence[int]) -> int:
    """The length of ``tokens`` up to and including the first of ``eos`` (all if none)."""
    stops = set(eos)
    return next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))


@contextlib.contextmanager
def _llm_built_by(build: Callable[[Callable[..., Any], dict[str, Any]], Any]):
    """While in the block, the ``vllm.LLM`` that TRL's colocated generation
    (``trl.generation.vllm_generation``) builds is ``build(vllm.LLM, its_kwargs)``: TRL 1.16 has
    no argument for more engine arguments."""
    from trl.generation import vllm_generation

    stock = vllm_generation.LLM
    built = []

    def llm(**kwargs: Any) -> Any:
        built.append(True)
        return build(stock, kwargs)

    vllm_generation.LLM = llm
    try:
        yield
    finally:
        vllm_generation.LLM = stock
    if not built:  # else TRL would sample on vLLM's own model classes
        raise RuntimeError(
            "TRL built no vllm.LLM through trl.generation.vllm_generation.LLM, so rlk could not "
            f"put it on rlk's model classes (TRL {trl.__version__}; tested: TRL 1.16)"
        )


def _vllm_model(llm: Any) -> Any:
    """The model of a colocated ``vllm.LLM`` (one process, ``external_launcher``), where TRL's
    weight sync calls ``load_weights`` one parameter at a time."""
    return llm.llm_engine.model_executor.driver_worker.model_runner.model
