"""Rotary cos/sin tables whose bits do not depend on the device, the process or how many
positions were asked for: the transformers rollout, the transformers training recompute and
Megatron's layers all rotate with the same table.

Example::

    table = RotaryTable.for_config(model.config)
    cos, sin = table.gather(position_ids)    # fp32 [B, S, D] each
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rlk_integrations.models.architectures import architecture

#: Positions per chunk of the table: a chunk is always computed with this shape, so the cos/sin
#: of a position are the same bits whatever the longest sequence seen so far.
ROTARY_CHUNK = 1024


class RotaryTable:
    """fp32 cos/sin rows by position, built by a CPU twin of the model's rotary module in fixed
    chunks of :data:`ROTARY_CHUNK` positions, then copied to the device asked for.

    On the CPU because transformers computes ``inv_freq`` (a ``pow``) on the device the model
    is created on, and a GPU's ``pow`` may differ from the CPU's in the last bit: a model built
    on the GPU and one built on the CPU and moved (or Megatron's rotary) would rotate
    differently. The twin is built from the config alone, so every engine, device and process
    gets the same table.

    Shapes: ``position_ids [B, S]`` (int) -> ``(cos, sin)``, fp32 ``[B, S, D]`` each, on the
    device of ``position_ids``.
    """

    def __init__(self, rotary_cls: type[nn.Module], config: Any) -> None:
        with torch.device("cpu"):
            self.twin = rotary_cls(config=config)
        self.cpu: tuple[torch.Tensor, torch.Tensor] | None = None
        self.on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def for_module(cls, rotary: nn.Module) -> RotaryTable:
        """The table of a model's rotary module (its class and config, not its values)."""
        return cls(type(rotary), rotary.config)

    @classmethod
    def for_config(cls, config: Any) -> RotaryTable:
        """The table of a supported transformers config (Llama, Qwen2, Qwen3)."""
        return cls(architecture(config).cls("rotary"), config)

    @torch.no_grad()
    def gather(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of ``position_ids``, extending the table first if needed (reads the
        largest position: a device sync). While a CUDA graph is being captured nothing can be
        read: the table must already hold the positions (:meth:`reserve`), and one it does not
        hold fails the indexing's device-side bounds check. The same while ``torch.compile``
        traces (a host read would break the graph): the positions reserved before count, and
        one beyond them fails the compiled indexing's bounds check (Inductor's
        ``assert_indirect_indexing``)."""
        if torch.compiler.is_compiling() or (
            position_ids.is_cuda and torch.cuda.is_current_stream_capturing()
        ):
            if self.cpu is None:
                raise RuntimeError(
                    "the rotary table is empty: reserve() it before a capture or torch.compile"
                )
            return self.lookup(position_ids)
        need = int(position_ids.max()) + 1 if position_ids.numel() else 1
        self.reserve(need)
        return self.lookup(position_ids)

    @torch.no_grad()
    def reserve(self, need: int) -> None:
        """Extend the table to hold positions ``[0, need)`` (host work only)."""
        have = 0 if self.cpu is None else self.cpu[0].shape[0]
        if have < need:
            chunks = [] if self.cpu is None else [self.cpu]
            dummy = torch.empty(1, dtype=torch.float32)
            while have < need:
                pos = torch.arange(have, have + ROTARY_CHUNK)[None, :]
                cos, sin = self.twin(dummy, pos)
                chunks.append((cos[0].float(), sin[0].float()))
                have += ROTARY_CHUNK
            self.cpu = (torch.cat([c for c, _ in chunks]), torch.cat([s for _, s in chunks]))
            self.on.clear()

    def lookup(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of positions the table already holds (no device read, unlike gather)."""
        device = position_ids.device
        if device not in self.on:
            self.on[device] = (self.cpu[0].to(device), self.cpu[1].to(device))
        cos, sin = self.on[device]
        return cos[position_ids], sin[position_ids]
