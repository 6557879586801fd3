"""vLLM worker extension for weight updates of rlk's vLLM models (``llm.collective_rpc``).

:func:`rlk_integrations.adapters.vllm.engine_args` names :class:`RLKWorkerExtension` as vLLM's
``worker_extension_cls``, so every vLLM worker has these methods; call them from the process
that owns the ``LLM`` (or ``AsyncLLM``), which sends them to every worker::

    llm.collective_rpc("rlk_update_weights", args=(bucket,))   # [(name, tensor), ...]
    llm.collective_rpc("rlk_stale_parameters")                 # per worker: [names]
    llm.reset_prefix_cache()

:func:`rlk_integrations.adapters.vllm.update_weights` does the pushes and the prefix-cache reset
in one call. The methods' names start with ``rlk_`` because vLLM's ``Worker`` already has an
``update_weights`` (its weight-transfer API: ``start_weight_update`` / ``update_weights`` /
``finish_weight_update``, whose ``ipc`` and ``nccl`` engines need CUDA; they too end in the
model's :meth:`~rlk_integrations.adapters.vllm.model.RLKForCausalLM.load_weights`).
"""

from __future__ import annotations

from typing import Any

import torch


class RLKWorkerExtension:
    """Mixed into vLLM's worker class by vLLM (``worker_extension_cls``); ``self`` is the
    worker, whose ``model_runner.model`` is the rlk model."""

    def _rlk_model(self) -> Any:
        model = self.model_runner.model  # type: ignore[attr-defined]
        if not hasattr(model, "stale_parameters"):
            raise TypeError(
                f"the engine's model is {type(model).__name__}, not one of rlk's vLLM models "
                "(start it with rlk_integrations.adapters.vllm.engine_args())"
            )
        return model

    def rlk_update_weights(
        self, bucket: bytes | list[tuple[str, torch.Tensor]], partial: bool = False
    ) -> int:
        """Load one bucket into the model (checkpoint names; see
        :meth:`~rlk_integrations.adapters.vllm.model.RLKForCausalLM.load_weights`): the bytes of
        a safetensors file (:func:`pack`; what goes through vLLM's message queues, which turn
        a bare tensor into a list), or ``[(name, tensor)]`` where the call stays in one
        process. ``partial=True``: the update ends here even if some parameters were not
        pushed. Returns how many tensors are stale after the bucket (0: complete)."""
        model = self._rlk_model()
        model.load_weights(unpack(bucket))
        if partial:
            model.declare_partial_update()
        return len(model.stale_parameters())

    def rlk_stale_parameters(self) -> list[str]:
        """The checkpoint tensors not pushed since an incomplete update began (``[]``: none)."""
        return self._rlk_model().stale_parameters()

    def rlk_declare_partial_update(self) -> int:
        """Accept the incomplete update on purpose; returns how many tensors stayed stale."""
        return self._rlk_model().declare_partial_update()


def pack(named_tensors: list[tuple[str, torch.Tensor]]) -> bytes:
    """A bucket as the bytes of a safetensors file (names unique; any dtype, bf16 included)."""
    from safetensors.torch import save

    names = [n for n, _ in named_tensors]
    if len(set(names)) != len(names):
        raise ValueError(
            f"a bucket names a tensor twice: {sorted({n for n in names if names.count(n) > 1})}"
        )
    # A copy of each: safetensors refuses tensors that share memory (a tied head, a view).
    return save({n: t.detach().cpu().clone() for n, t in named_tensors})


def unpack(bucket: Any) -> list[tuple[str, Any]]:
    """:func:`pack`'s bytes, or ``[(name, tensor)]``, as a list of pairs; ``TypeError`` for
    anything else (a tensor that a message queue turned into a list is named)."""
    if isinstance(bucket, (bytes, bytearray, memoryview)):
        from safetensors.torch import load

        return list(load(bytes(bucket)).items())
    if not isinstance(bucket, (list, tuple)):
        raise TypeError(
            "bucket must be safetensors bytes or a list of (name, tensor), got "
            f"{type(bucket).__name__}"
        )
    pairs = []
    for item in bucket:
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(f"bucket entries must be (name, tensor) pairs, got {item!r:.80}")
        if not isinstance(item[1], torch.Tensor):
            raise TypeError(
                f"{item[0]}: a {type(item[1]).__name__}, not a torch.Tensor (vLLM's message "
                "queues do not carry bare tensors: send pack(bucket), as "
                "rlk_integrations.adapters.vllm.update_weights does)"
            )
        pairs.append((item[0], item[1]))
    return pairs
