"""The rollout engines by name: the one list that ``rlk consistency`` (its ``--rollout-mode``
choices), ``rlk bench``'s e2e family and :func:`rlk_integrations.engine.engines.create` read.

Imports nothing, so the command line module (``rlk_integrations_cli``) lists the names without
importing torch; :func:`~rlk_integrations.engine.engines.create` imports an engine's module
only when the engine is asked for. Each value is ``"module:Class"`` of a class implementing
:class:`~rlk_integrations.engine.engines.RolloutEngine`, and what it is (one line for
``rlk consistency --help``). The vLLM engine is named by its module path alone: the registry
does not import the adapter (vLLM is an optional dependency).

Example::

    module, _, cls = ROLLOUT_ENGINES["paged"][0].partition(":")
"""

from __future__ import annotations

ROLLOUT_ENGINES: dict[str, tuple[str, str]] = {
    "padded": ("rlk_integrations.engine.rollout:PaddedRollout", "left-padded batch, KV cache"),
    "paged": ("rlk_integrations.engine.paged:PagedRollout", "paged KV cache, continuous batching"),
    "vllm": (
        "rlk_integrations.adapters.vllm.engine:VLLMRollout",
        "rlk's models inside vLLM (rlk[vllm]; temperature 1; adds a stock-vLLM row)",
    ),
}

__all__ = ["ROLLOUT_ENGINES"]
