"""Imported by verl: its ``verl.plugins`` entry point (at every ``import verl``) and
``actor_rollout_ref.model.external_lib``. Registers :class:`~.engine.RLKEngineWithLMHead` under
the vendor ``rlk`` for verl's ``fsdp`` and ``fsdp2`` backends on ``cuda``, ``npu`` and ``cpu``,
and verl's ``cpu`` platform (:mod:`~.platform`, selected by ``VERL_PLATFORM=cpu`` only).
Importing it again registers nothing new."""

from __future__ import annotations

from rlk_integrations.adapters.verl import register

register()
