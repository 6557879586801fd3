"""rlk: deterministic, batch-invariant operators for RL post-training of LLMs.

The rollout engine and the trainer call the same ops, so every sampled token gets bitwise the
same log-probability on both sides. Ops dispatch to a backend chosen per device (``RLK_BACKEND``
or :func:`use_backend`; see ``rlk info`` and :mod:`rlk.selection`). Backends are plugins written
against :mod:`rlk.plugins`.
"""

import os as _os
import sys as _sys


def _choose_triton_mode() -> None:
    # Triton picks compiled or interpreted execution when it is first imported. On a machine
    # without a GPU rlk's kernels need the interpreter, so choose it now, before any other
    # library (transformers, ...) imports triton.
    if "TRITON_INTERPRET" in _os.environ or "triton" in _sys.modules:
        return
    import torch

    if not torch.cuda.is_available():
        _os.environ["TRITON_INTERPRET"] = "1"


_choose_triton_mode()

# The ops: each family module of rlk.ops declares its ops (the catalog, rlk.ops.CATALOG) and
# lists them in its __all__, which is star-imported here and added to rlk's (static tools, the
# API docs among them, read both); a test checks them against the catalog.
from rlk import _library  # noqa: E402, F401  (defines the torch.ops.rlk operators)
from rlk.batch_invariant import batch_invariant  # noqa: E402
from rlk.ops import OPS  # noqa: E402
from rlk.ops import attention as _attention  # noqa: E402
from rlk.ops import dense as _dense  # noqa: E402
from rlk.ops import logprobs as _logprobs  # noqa: E402
from rlk.ops import losses as _losses  # noqa: E402
from rlk.ops import ppo as _ppo  # noqa: E402
from rlk.ops import sampling as _sampling  # noqa: E402
from rlk.ops.attention import *  # noqa: E402, F403
from rlk.ops.dense import *  # noqa: E402, F403
from rlk.ops.logprobs import *  # noqa: E402, F403
from rlk.ops.losses import *  # noqa: E402, F403
from rlk.ops.moe import *  # noqa: E402, F403  (optional ops: reachable here, not in __all__)
from rlk.ops.ppo import *  # noqa: E402, F403
from rlk.ops.sampling import *  # noqa: E402, F403
from rlk.plugins import (  # noqa: E402
    GUARANTEES,
    BackendError,
    BackendImpl,
    BackendSpec,
    OpAutograd,
    hookimpl,
)
from rlk.selection import current_backend, use_backend  # noqa: E402

__version__ = "0.1.0"

#: The public names: the API, then every required op of the catalog, in ``rlk.OPS`` order.
__all__ = [
    "GUARANTEES",
    "OPS",
    "BackendError",
    "BackendImpl",
    "BackendSpec",
    "OpAutograd",
    "batch_invariant",
    "current_backend",
    "hookimpl",
    "use_backend",
]
__all__ += _dense.__all__
__all__ += _attention.__all__
__all__ += _logprobs.__all__
__all__ += _losses.__all__
__all__ += _ppo.__all__
__all__ += _sampling.__all__
