"""The rlk modules of Megatron's layer spec: column/row-parallel linears on :func:`rlk.linear`
(TP = 1) or :mod:`rlk.parallel`'s tree-ordered linears (``rlk_leaves``), RMSNorm on
:func:`rlk.rms_norm`, core attention on :func:`rlk.attention` (``thd`` packed sequences or
``sbhd``), self-attention with rotary on :func:`rlk.apply_rotary`, and the MLP on
:func:`rlk.silu_and_mul`. The Megatron subclasses are built lazily, so that importing this
module needs no Megatron. Version-sensitive spots are marked "mcore API".

Example::

    col_cls, row_cls = _make_linears()
    norm = RlkRMSNorm(config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

import rlk
import rlk.parallel


def _tp_world(module: nn.Module) -> tuple[Any, int]:
    group = getattr(module, "tp_group", None)  # mcore API: an attribute since 0.13
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
    return group, torch.distributed.get_world_size(group)


def _column_parallel_base():
    from megatron.core.tensor_parallel import ColumnParallelLinear

    return ColumnParallelLinear


def _row_parallel_base():
    from megatron.core.tensor_parallel import RowParallelLinear

    return RowParallelLinear


def _make_linears():
    """The rlk linear classes (subclasses of Megatron's, so checkpoints and sharded state dicts
    see the same parameters); built lazily so that importing this module needs no Megatron."""
    col_base, row_base = _column_parallel_base(), _row_parallel_base()

    class RlkColumnParallelLinear(col_base):
        """``ColumnParallelLinear`` on rlk: :func:`rlk.linear` at TP=1 without ``rlk_leaves``;
        :func:`rlk.parallel.column_parallel_linear` otherwise (the forward bits are those of
        ``rlk.linear``'s N-slice; dX reduces N by the ``rlk_leaves`` tree)."""

        def __init__(self, *args: Any, rlk_leaves: int | None = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.rlk_leaves = rlk_leaves

        def forward(self, input_, weight=None, runtime_gather_output=None):
            if self.sequence_parallel:
                raise NotImplementedError("rlk ColumnParallelLinear: no sequence parallelism")
            w = self.weight if weight is None else weight
            bias = None if self.skip_bias_add else self.bias
            gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
            group, world = _tp_world(self)
            x = input_.contiguous()
            if self.rlk_leaves is None:
                if world != 1:
                    raise ValueError("tensor parallelism > 1 needs rlk_leaves (see layer_spec)")
                y = rlk.linear(x, w, bias)
            else:
                y = rlk.parallel.column_parallel_linear(
                    x, w, bias, leaves=self.rlk_leaves, gather_output=bool(gather), group=group
                )
            return y, (self.bias if self.skip_bias_add else None)

    class RlkRowParallelLinear(row_base):
        """``RowParallelLinear`` on rlk: :func:`rlk.linear` at TP=1 without ``rlk_leaves``;
        :func:`rlk.parallel.row_parallel_linear` otherwise (K reduced by the fixed
        ``rlk_leaves`` tree whatever the TP size: the bits of ``rlk.parallel.tree_linear``)."""

        def __init__(self, *args: Any, rlk_leaves: int | None = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.rlk_leaves = rlk_leaves

        def forward(self, input_):
            if self.sequence_parallel:
                raise NotImplementedError("rlk RowParallelLinear: no sequence parallelism")
            if not self.input_is_parallel:
                raise NotImplementedError("rlk RowParallelLinear needs input_is_parallel=True")
            bias = None if self.skip_bias_add else self.bias
            group, world = _tp_world(self)
            x = input_.contiguous()
            if self.rlk_leaves is None:
                if world != 1:
                    raise ValueError("tensor parallelism > 1 needs rlk_leaves (see layer_spec)")
                y = rlk.linear(x, self.weight, bias)
            else:
                y = rlk.parallel.row_parallel_linear(
                    x, self.weight, bias, leaves=self.rlk_leaves, group=group
                )
            return y, (self.bias if self.skip_bias_add else None)

    return RlkColumnParallelLinear, RlkRowParallelLinear


class RlkRMSNorm(nn.Module):
    """RMSNorm on :func:`rlk.rms_norm`; the constructor takes Megatron's norm arguments."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> None:
        super().__init__()
        if getattr(config, "layernorm_zero_centered_gamma", False):
            raise NotImplementedError("zero-centred gamma is not supported")
        self.eps = eps
        device = "cpu" if getattr(config, "use_cpu_initialization", False) else None
        self.weight = nn.Parameter(
            torch.ones(hidden_size, dtype=config.params_dtype, device=device)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rlk.rms_norm(x.contiguous(), self.weight, self.eps)


class RlkCoreAttention(nn.Module):
    """Causal core attention on :func:`rlk.attention`, in Megatron's layouts.

    ``query [S, B, Hq, D]``, ``key``/``value [S, B, Hk, D]`` (one sequence per batch row) or,
    with ``packed_seq_params``, ``[T, H, D]`` packed sequences (``cu_seqlens_q/kv``). Returns
    ``[S, B, Hq * D]`` (or ``[T, Hq * D]``).
    """

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        if getattr(config, "attention_dropout", 0.0):
            raise NotImplementedError("rlk attention has no dropout")
        scale = kwargs.get("softmax_scale") or config.softmax_scale
        self.scale = scale if scale is not None else config.kv_channels**-0.5

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any = None,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise NotImplementedError("rlk attention takes no attention_bias")
        if packed_seq_params is not None:
            cu_q = packed_seq_params.cu_seqlens_q.to(torch.int32)
            cu_k = packed_seq_params.cu_seqlens_kv.to(torch.int32)
            out = rlk.attention(
                query.contiguous(), key.contiguous(), value.contiguous(), cu_q, cu_k,
                causal=True, scale=self.scale,
            )  # fmt: skip
            return out.reshape(out.shape[0], -1)
        s, b, hq, d = query.shape

        def rows(t: torch.Tensor) -> torch.Tensor:  # [S, B, H, D] -> [B * S, H, D]
            return t.transpose(0, 1).reshape(b * t.shape[0], t.shape[2], d)

        cu_q = torch.arange(b + 1, dtype=torch.int32, device=query.device) * s
        cu_k = torch.arange(b + 1, dtype=torch.int32, device=query.device) * key.shape[0]
        out = rlk.attention(rows(query), rows(key), rows(value), cu_q, cu_k, scale=self.scale)
        return out.reshape(b, s, hq * d).transpose(0, 1).contiguous()


def _positions(packed_seq_params: Any, s: int, b: int, device: torch.device) -> torch.Tensor:
    """Per-token positions in the flattened token order of the attention's tensors."""
    if packed_seq_params is not None:
        cu = packed_seq_params.cu_seqlens_q.to(device=device, dtype=torch.int64)
        lengths = cu[1:] - cu[:-1]
        start = torch.repeat_interleave(cu[:-1], lengths)
        return torch.arange(int(cu[-1]), device=device) - start
    return torch.arange(s, device=device).repeat_interleave(b)  # [S, B] order


def _make_self_attention():
    from megatron.core.transformer.attention import SelfAttention

    class RlkSelfAttention(SelfAttention):
        """Megatron's ``SelfAttention`` with rotary on :func:`rlk.apply_rotary` (cos/sin from
        ``rlk_rotary``, positions restarting per packed sequence) and rlk core attention.
        Megatron's own ``rotary_pos_emb`` argument is ignored (the model has none)."""

        def __init__(self, *args: Any, rlk_rotary: Any = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if rlk_rotary is None:
                raise ValueError("RlkSelfAttention needs rlk_rotary (see rotary_table)")
            if getattr(self.config, "attention_output_gate", False):
                raise NotImplementedError("gated attention output is not supported")
            self.rlk_rotary = rlk_rotary

        def forward(
            self,
            hidden_states: torch.Tensor,
            attention_mask: Any = None,
            key_value_states: Any = None,
            inference_context: Any = None,
            rotary_pos_emb: Any = None,
            *args: Any,
            packed_seq_params: Any = None,
            **kwargs: Any,
        ):
            if inference_context is not None or kwargs.get("inference_params") is not None:
                raise NotImplementedError("rlk SelfAttention: no Megatron inference context")
            if key_value_states is not None:
                raise NotImplementedError("rlk SelfAttention: self-attention only")
            # mcore API: positional (hidden_states, key_value_states) works on 0.16 and 0.19.
            q, k, v = self.get_query_key_value_tensors(hidden_states, None)
            s, b = hidden_states.shape[:2]
            if packed_seq_params is not None:
                if b != 1:
                    raise ValueError(f"packed sequences take one [T, 1, H] row, got batch {b}")
                q, k, v = q[:, 0], k[:, 0], v[:, 0]
            d = q.shape[-1]
            cos, sin = self.rlk_rotary.gather(
                _positions(packed_seq_params, s, b, hidden_states.device)
            )
            shape_q, shape_k = q.shape, k.shape
            q, k = rlk.apply_rotary(
                q.reshape(-1, shape_q[-2], d).contiguous(),
                cos,
                sin,
                k=k.reshape(-1, shape_k[-2], d).contiguous(),
            )
            out = self.core_attention(
                q.reshape(shape_q),
                k.reshape(shape_k),
                v,
                attention_mask,
                packed_seq_params=packed_seq_params,
            )
            if packed_seq_params is not None:
                out = out.unsqueeze(1)  # [T, 1, Hq * D]
            return self.linear_proj(out)

    return RlkSelfAttention


def _make_mlp():
    from megatron.core.transformer.mlp import MLP

    class RlkMLP(MLP):
        """Megatron's ``MLP`` with the gated activation on :func:`rlk.silu_and_mul` (fc1's
        output is ``[gate | up]`` on each rank, Megatron's own layout).

        mcore API: see :func:`_mlp_spec` for how the layer builds it (0.16 vs 0.19)."""

        def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any):
            h, bias = self.linear_fc1(hidden_states)
            if bias is not None:
                raise NotImplementedError("rlk MLP: no fc1 bias")
            out, out_bias = self.linear_fc2(rlk.silu_and_mul(h))
            return out, out_bias

    return RlkMLP


def _mlp_spec(mlp_cls: type, submodules: Any) -> Any:
    """The ``mlp`` entry of a ``TransformerLayerSubmodules`` for an ``MLP`` subclass.

    mcore API: 0.16 builds a ``ModuleSpec`` (passing ``tp_group`` only to the exact ``MLP``
    class, so the subclass takes the default TP group); 0.19 calls the entry with
    ``pg_collection=`` and wants ``functools.partial(cls.as_mlp_submodule, submodules=...)``
    (a ``ModuleSpec`` of a subclass would get ``pg_collection`` in ``MLP.__init__``)."""
    if hasattr(mlp_cls, "as_mlp_submodule"):
        return functools.partial(mlp_cls.as_mlp_submodule, submodules=submodules)
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=mlp_cls, submodules=submodules)
