"""vLLM as a rollout engine of :mod:`rlk_integrations.engine.engines` (``rlk consistency
--rollout-mode vllm``): :class:`VLLMRollout` runs vLLM's engine on the model's weights, rlk's model
classes (``stock=False``, the registered engine ``vllm``) or vLLM's own (``stock=True``, the stock
row).

The weights reach vLLM through a checkpoint: the first call with a model (and every call after
its parameters moved or changed in place) saves it with ``save_pretrained`` to a temporary
directory and starts an engine on it (about 20 s on 2 CPU cores). The sampled tokens are vLLM's
(its sampler, seeded per request by ``seeds[i]``), not :func:`rlk.sample`'s; the
log-probabilities are vLLM's ``processed_logprobs``: for rlk's engine those of
``softmax(logits / temperature)`` over the whole vocabulary, which the trainer recomputes with
the same temperature (stock vLLM's renormalise over the tokens top-k / top-p keep).

Engine settings: eager (no CUDA graphs: the RLK attention backend has none), prefix caching on,
a step budget that holds every prompt of the call (vLLM 0.32's CPU runner fails a seeded request
whose prefill is split over steps), ``gpu_memory_utilization`` 0.1 on CPU (there: the share of
host memory for the KV cache) and 0.3 on CUDA (the trainer's model shares the GPU).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

import rlk_integrations.adapters.vllm as rv
from rlk_integrations.engine.engines import RolloutOptions, RolloutResult, Sample

#: The head sizes vLLM 0.32's CPU attention takes (its ``CPUAttentionBackend.
#: get_supported_head_sizes()``; test_vllm.py checks the installed vLLM against this list).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def _weights_key(model: torch.nn.Module) -> tuple:
    return (id(model),) + tuple((p.data_ptr(), p._version) for p in model.parameters())


def start_llm(model: torch.nn.Module, directory: str, *, max_len: int, step_tokens: int,
              stock: bool, page_size: int = 16, leaves: int | None = None) -> Any:  # fmt: skip
    """Save ``model`` (a transformers causal LM) to ``directory`` and start a ``vllm.LLM`` on it
    with this module's engine settings: rlk's model classes
    (:func:`rlk_integrations.adapters.vllm.engine_args`, ``page_size`` tokens per KV block,
    ``leaves`` tree-ordered row-parallel linears) or, with ``stock``, vLLM's own. ``max_len``:
    the longest sequence; ``step_tokens``: the prompt tokens one step must hold."""
    from vllm import LLM  # vLLM: an optional dependency, imported where it runs

    model.save_pretrained(directory)
    on_cuda = next(model.parameters()).is_cuda
    kw: dict[str, Any] = dict(
        enforce_eager=True,
        skip_tokenizer_init=True,
        gpu_memory_utilization=0.3 if on_cuda else 0.1,
        max_model_len=max_len,
        max_num_batched_tokens=max(step_tokens, max_len, 2048),
        enable_prefix_caching=True,
        dtype=str(next(model.parameters()).dtype).replace("torch.", ""),
        seed=0,
        logprobs_mode="processed_logprobs",
    )
    if not stock:
        kw = rv.engine_args(block_size=page_size, leaves=leaves, **kw)
    elif leaves:
        raise ValueError("leaves are rlk's: stock vLLM runs its own linears")
    return LLM(model=directory, **kw)


class VLLMRollout:
    """The rollout engine ``vllm`` (``stock=False``: rlk's model classes in vLLM) or vLLM's own
    kernels (``stock=True``)."""

    def __init__(self, options: RolloutOptions | None = None, *, stock: bool = False) -> None:
        self.options = options or RolloutOptions()
        self.stock = stock
        self.name = "vllm-stock" if stock else "vllm"
        self._llm: Any = None
        self._key: tuple | None = None
        self._dir: str | None = None
        self._max_len = 0

    def unavailable(self, device: torch.device) -> str | None:
        try:
            rv.check_vllm()
        except RuntimeError as e:
            return str(e)
        if device.type not in ("cpu", "cuda"):
            return f"vLLM runs on CPU or CUDA here, not {device.type}"
        if not self.stock and self.options.tp > 1:
            return "runs unsharded rlk ops (rollout_tp = 1; leaves are served)"
        return None

    def stock_twin(self, model: torch.nn.Module, device: torch.device) -> VLLMRollout | str:
        """vLLM's own model classes and kernels (on CPU only where its attention takes the
        model's head_dim: :data:`CPU_HEAD_SIZES`)."""
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        if device.type == "cpu" and head_dim not in CPU_HEAD_SIZES:
            return f"vLLM's CPU attention takes head_dim {CPU_HEAD_SIZES}, not {head_dim}"
        return VLLMRollout(self.options, stock=True)

    def close(self) -> None:
        """Stop the engine and remove its checkpoint directory."""
        if self._llm is not None:
            self._llm.llm_engine.engine_core.shutdown()
            self._llm = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _engine(self, model: torch.nn.Module, max_len: int, step_tokens: int):
        key = _weights_key(model)
        if self._llm is not None and key == self._key and max_len <= self._max_len:
            return self._llm
        self.close()
        self._dir = tempfile.mkdtemp(prefix="rlk-vllm-")
        self._llm = start_llm(model, self._dir, max_len=max_len, step_tokens=step_tokens,
                              stock=self.stock, page_size=self.options.page_size,
                              leaves=None if self.stock else self.options.leaves)  # fmt: skip
        self._key, self._max_len = key, max_len
        return self._llm

    def generate(
        self,
        model: torch.nn.Module,
        prompts: list[list[int]],
        new_tokens: int,
        seeds: list[int],
        *,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        eos_token_id: int | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> RolloutResult:
        from vllm import SamplingParams

        if not temperature > 0:
            raise ValueError(
                f"temperature must be > 0 (vLLM samples greedily at 0), got {temperature}"
            )
        if len(seeds) != len(prompts):
            raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts")
        longest = max(len(p) for p in prompts)
        step_tokens = sum(len(p) for p in prompts) + len(prompts)
        llm = self._engine(model, max(longest + new_tokens + 1, 512), step_tokens)
        params = [
            SamplingParams(
                temperature=temperature, top_k=top_k if top_k > 0 else -1, top_p=top_p,
                max_tokens=new_tokens, logprobs=0, seed=s, ignore_eos=eos_token_id is None,
                stop_token_ids=[eos_token_id] if eos_token_id is not None else None,
            )
            for s in seeds
        ]  # fmt: skip
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        samples = []
        for p, seed, out in zip(prompts, seeds, outs):
            c = out.outputs[0]
            ids = list(c.token_ids)
            lps = torch.tensor([d[t].logprob for d, t in zip(c.logprobs, ids)], dtype=torch.float32)
            samples.append(Sample(list(p), ids, lps, seed))
        return RolloutResult(
            samples,
            seconds,
            sum(len(s.response) for s in samples),
            logits_dtype=next(model.parameters()).dtype,
        )
