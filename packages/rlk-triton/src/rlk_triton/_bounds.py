"""Index inputs that the kernels check on the device, and how a bad one is reported.

``rlk.ops`` checks index values (``cu_seqlens``, ``block_table``, ``seq_lens``, ``targets``) on
the host only where that costs no device synchronisation: always on CPU, on a GPU only with
``RLK_VALIDATE`` on. In default mode on a GPU a bad index therefore reaches the kernels, and so
every kernel that reads an index bounds it itself:

- An index outside its range is never used to address memory: the load or store is masked (a
  sequence whose offsets leave ``[0, T]``, a page id outside ``[0, num_pages)``, a target outside
  ``[0, V)``). The rows that depend on it get a defined value, NaN, instead of a result.
- The kernel clears a one-element ``ok`` flag (:func:`flag`) that the launcher hands to
  :func:`report`: on a GPU that is ``torch._assert_async``, which costs one tiny kernel and no
  synchronisation, and fails the CUDA context ("device-side assert triggered", with the message)
  at the next synchronisation; on CPU it reads the flag at once and raises ``ValueError``.

So a bad index can corrupt nothing, and it cannot pass unnoticed either.

On a GPU the flag is one tensor per device, made once, not one per call: it never needs setting
back to 1, since a failed check ends the CUDA context; so a decode step spends no kernel filling
flags. On CPU every call gets a fresh flag (a test may run a kernel on bad input without
:func:`report`, which must not leave a cleared flag to the next call).
"""

from __future__ import annotations

import torch

_FLAGS: dict[torch.device, torch.Tensor] = {}


def flag(device: torch.device) -> torch.Tensor:
    """The ``ok`` flag of ``device``, int32 ``[1]`` = 1; a kernel that meets a bad index stores
    0."""
    if device.type == "cpu":
        return torch.ones(1, dtype=torch.int32)
    ok = _FLAGS.get(device)
    if ok is None:
        ok = _FLAGS[device] = torch.ones(1, dtype=torch.int32, device=device)
    return ok


def report(ok: torch.Tensor, message: str) -> None:
    """Raise (CPU: ``ValueError`` now; GPU: a device-side assertion, asynchronously) unless the
    kernels left ``ok`` at 1."""
    if ok.device.type == "cpu":
        if not bool(ok.item()):
            raise ValueError(message)
        return
    torch._assert_async(ok, message)
