"""Megatron's model-parallel state for rlk's ``GPTModel``: one process
(:func:`init_single_process`), the caller's process group (:func:`init_model_parallel`) or one
spawned TP rank (:func:`init_distributed`). Each returns the teardown.

Example::

    teardown = init_single_process()
    ...  # build_gpt_model, load_hf_weights, packed_logprobs
    teardown()
"""

from __future__ import annotations

import contextlib
import importlib
import os
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def _import_quietly(name: str) -> Any:
    """Import a Megatron module without its "Transformer Engine and Apex are not installed"
    warnings (the local spec used here needs neither)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
        return importlib.import_module(name)


def init_model_parallel(tensor_parallel: int = 1, expert_parallel: int = 1) -> Callable[[], None]:
    """Set up Megatron's model-parallel state (tensor parallelism ``tensor_parallel``, expert
    parallelism ``expert_parallel`` over the data-parallel ranks, no pipeline) and its RNG
    tracker; returns the teardown function.

    Without an initialised ``torch.distributed`` (one process) it first makes a 1-rank gloo
    group (file rendezvous), which the teardown destroys; with one (the caller's TP workers) it
    uses it and leaves it alone. Dropout is 0 in :func:`megatron_config`, so the tracker is
    Megatron's inference tracker (its fork is a no-op and needs no CUDA RNG).
    """
    ps = _import_quietly("megatron.core.parallel_state")
    mrandom = _import_quietly("megatron.core.tensor_parallel.random")
    path = None
    if not dist.is_initialized():
        if tensor_parallel != 1 or expert_parallel != 1:
            raise ValueError(
                f"tensor_parallel = {tensor_parallel}, expert_parallel = {expert_parallel} "
                "needs torch.distributed initialised by the caller (one process per rank)"
            )
        fd, path = tempfile.mkstemp(prefix="rlk-megatron-")
        os.close(fd)
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel, expert_model_parallel_size=expert_parallel
    )
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)

    def teardown() -> None:
        ps.destroy_model_parallel()
        # mcore API: no public reset; the next initialize_rng_tracker builds a fresh one.
        mrandom._CUDA_RNG_STATE_TRACKER = None
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
        if path is not None:
            dist.destroy_process_group()
            with contextlib.suppress(OSError):
                os.unlink(path)

    return teardown


def init_distributed(
    rank: int,
    world: int,
    init_file: str,
    device: str | torch.device = "cpu",
    *,
    expert_parallel: int = 1,
) -> tuple[torch.device, Callable[[], None]]:
    """One rank of a spawned TP group: ``torch.distributed`` (file rendezvous at ``init_file``;
    NCCL on ``cuda:<rank>`` for a CUDA ``device``, gloo on the CPU otherwise) and then
    :func:`init_model_parallel` at TP = ``world``; or, with ``expert_parallel`` > 1, at TP = 1
    and EP = ``expert_parallel`` (the ``world`` ranks data-parallel, each running its own
    sequences; an MoE model's experts sharded over each EP group). Returns the rank's device
    and the teardown (Megatron's state, then the process group)."""
    if expert_parallel < 1 or world % expert_parallel:
        raise ValueError(f"expert_parallel = {expert_parallel} does not divide {world} ranks")
    if torch.device(device).type == "cuda":
        if torch.cuda.device_count() < world:
            raise RuntimeError(f"TP = {world} needs {world} GPUs, {torch.cuda.device_count()} seen")
        dev, backend = torch.device("cuda", rank), "nccl"
        torch.cuda.set_device(dev)
    else:
        dev, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        if expert_parallel == 1:
            teardown_mp = init_model_parallel(world)
        else:
            teardown_mp = init_model_parallel(1, expert_parallel)
    except BaseException:
        dist.destroy_process_group()
        raise

    def teardown() -> None:
        try:
            teardown_mp()
        finally:
            dist.destroy_process_group()

    return dev, teardown


def init_single_process() -> Callable[[], None]:
    """:func:`init_model_parallel` at TP=1 in this process alone (a 1-rank gloo group unless
    ``torch.distributed`` is already initialised); returns the teardown function."""
    return init_model_parallel(1)
