"""Workers of the expert-parallel tests (test_ep.py, test_megatron_moe_ep.py), importable by
name for torch.multiprocessing.

:func:`spawn` runs a worker in ``world`` gloo processes (bounded timeouts) and returns every
rank's result; :func:`cases_worker` runs several cases, each on an expert-parallel group of the
first ranks. :func:`op_worker` runs ``rlk.parallel.expert_parallel_moe_experts`` forward and
backward on its share of a batch; :func:`model_worker` shards tiny-qwen3-moe with
``shard_ep`` and runs a padded rollout and a training recompute (forward and backward) of its
own prompts. :func:`arrival_order_combine` is the deliberately wrong combine the tests must
catch: a token's expert outputs added in the order their rows arrive, not in rank order.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import types

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import rlk.parallel as P

#: Seconds a collective may wait before the ranks fail (a hang fails the test instead).
TIMEOUT_S = 120


def _entry(rank, world, tmp, fn, args):
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(tmp, 'rendezvous')}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    try:
        torch.save(fn(rank, world, *args), os.path.join(tmp, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def spawn(fn, world: int, *args) -> list:
    """``fn(rank, world, *args)`` in ``world`` gloo processes; every rank's result, in rank
    order."""
    if fn.__module__.rsplit(".", 1)[-1].startswith("test_"):
        # pytest imports test files by path (importlib mode): a child process cannot.
        raise ValueError(
            f"fn: {fn.__qualname__} is defined in a test file; move it to a workers module"
        )
    with tempfile.TemporaryDirectory(prefix="rlk-ep-") as tmp:
        mp.spawn(_entry, args=(world, tmp, fn, args), nprocs=world, join=True)
        # (the results hold rollout records: this process's own files, read as pickles)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False)
                for r in range(world)]  # fmt: skip


def arrival_order_combine(real):
    """A combine that adds each token's terms in the order their rows came back (grouped by
    the rank that computed them), the bug expert parallelism must not have."""

    def combine(table, plan, y, indices, weights, out):
        T, k = indices.shape
        arrived = plan.inv.view(T, k)
        first = torch.sort(arrived, dim=1).indices
        plan = types.SimpleNamespace(inv=arrived.gather(1, first).reshape(-1),
                                     experts=plan.experts)  # fmt: skip
        w = None if weights is None else weights.gather(1, first)
        real(table, plan, y, indices.gather(1, first), w, out)

    return combine


def bounds(tokens: int, world: int) -> list[int]:
    """Uneven shares of ``tokens``, growing with the rank (rank 0 may get none): rank r's
    tokens are ``bounds[r] .. bounds[r + 1]``."""
    return [tokens * r * (r + 1) // (world * (world + 1)) for r in range(world)] + [tokens]


def op_worker(rank, world, inputs, mode="exact", group=None):
    """Forward and backward of this rank's tokens with its experts: ``(out, dx, dweights,
    dgate_up, ddown)``. ``mode``: ``"exact"`` (rlk-triton), ``"arrival"`` (rlk-triton with
    :func:`arrival_order_combine`) or ``"reference"`` (the float64 backend)."""
    import rlk
    from rlk_triton import moe

    real = moe._combine
    if mode == "arrival":
        moe._combine = arrival_order_combine(real)
    try:
        with rlk.use_backend("reference" if mode == "reference" else "triton"):
            x, indices, weights, gate_up, down, grad = inputs
            b = bounds(x.shape[0], world)
            mine = slice(b[rank], b[rank + 1])
            x = x[mine].clone().requires_grad_()
            w = weights[mine].clone().requires_grad_()
            gu = P.shard(gate_up, 0, rank=rank, world_size=world).requires_grad_()
            dn = P.shard(down, 0, rank=rank, world_size=world).requires_grad_()
            out = P.expert_parallel_moe_experts(x, indices[mine], w, gu, dn, group=group)
            (out.float() * grad[mine]).sum().backward()
    finally:
        moe._combine = real
    return out.detach(), x.grad, w.grad, gu.grad, dn.grad


def model_worker(rank, world, name, state, prompts, new_tokens, group=None):
    """This rank's equal share of ``prompts`` (in order; seeds their indices) through the zoo's
    model ``name`` with the weights ``state``, sharded by ``shard_ep``: the padded rollout's
    samples, then the recompute of those samples, ``(samples, log-probs, {expert parameter:
    gradient})``."""
    from rlk_integrations.engine import rollout, training
    from rlk_integrations.models import ep
    from rlk_integrations.models import transformers as rt
    from rlk_integrations.tools import zoo

    model = zoo.load_model(name, dtype=torch.float32)
    model.load_state_dict(state)
    ep.shard_ep(rt.patch_model(model.eval()), group=group)
    per = len(prompts) // world
    seeds = list(range(rank * per, (rank + 1) * per))
    ro = rollout.generate(model, [prompts[i] for i in seeds], new_tokens, seeds=seeds)
    lps = training.packed_logprobs(model, ro.samples)
    (-torch.cat(lps).sum()).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if n.endswith(ep.EXPERT_PARAMS)}
    return ro.samples, [lp.detach() for lp in lps], grads


def cases_worker(rank, world, cases):
    """Every case of ``cases`` (name -> ``(size, worker, args)``) on ranks ``0 .. size - 1``,
    an expert-parallel group of its own (one spawn of ``world`` processes serves them all:
    starting a process costs more than a case): ``{name: this rank's result}``."""
    groups = {}
    for size in sorted({size for size, _, _ in cases.values()}):
        # Every rank makes every group (a collective); only the first block runs the cases.
        groups[size] = dist.new_group(list(range(size)),
                                      timeout=datetime.timedelta(seconds=TIMEOUT_S))  # fmt: skip
    out = {}
    for name, (size, fn, args) in cases.items():
        if rank < size:
            out[name] = fn(rank, size, *args, group=groups[size])
    return out


def megatron_ep_worker(rank, world, name, lengths):
    """This rank of a Megatron-core EP group of ``world`` on zoo model ``name``, running its
    sequences ``lengths[rank]``: (its log-probs, its last MoE layer's expert gradients by
    Megatron name, the experts its tokens were routed to)."""
    import warnings

    warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
    from test_consistency_megatron import _samples

    from rlk_integrations.adapters import megatron as rm
    from rlk_integrations.tools import zoo

    teardown = rm.init_model_parallel(1, world)
    try:
        hf = zoo.load_model(name, dtype=torch.bfloat16)  # seeded: the same weights everywhere
        mg = rm.build_gpt_model(hf.config, dtype=torch.bfloat16)
        rm.load_hf_weights(mg, hf.state_dict(), hf.config, ep_rank=rank, ep_world_size=world)
        assert len(mg.decoder.layers[0].mlp.experts.local_experts) == hf.config.num_experts // world
        samples = _samples(lengths[rank], hf.config.vocab_size, seed=10 + rank)
        with rm.RoutingLog(mg) as log:
            lps = rm.packed_logprobs(mg, samples)
        torch.cat(lps).sum().backward()
        last = f"decoder.layers.{hf.config.num_hidden_layers - 1}.mlp.experts."
        grads = {k: p.grad for k, p in mg.named_parameters() if k.startswith(last)}
        return [lp.detach() for lp in lps], grads, set(log.calls[0][2].flatten().tolist())
    finally:
        teardown()
