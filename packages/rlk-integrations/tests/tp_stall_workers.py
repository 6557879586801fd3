"""A worker of test_consistency_tp.py's timeout test, importable by name for
torch.multiprocessing (pytest imports test files by path, which a child process cannot)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

#: How long the stalled rank sleeps: far longer than the timeout the test gives the collective.
STALL_S = 90.0


def stalled_peer_worker(rank, world, device):
    """Rank 0 all-reduces; every other rank sleeps :data:`STALL_S` seconds and never joins."""
    if rank != 0:
        time.sleep(STALL_S)
        return None
    t = torch.ones(1, device=device)
    dist.all_reduce(t)
    return t
