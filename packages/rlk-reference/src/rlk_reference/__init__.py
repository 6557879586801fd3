"""rlk_reference: the float64, unfused, obviously-correct oracle of every rlk op.

Each op takes the normalised arguments that ``rlk`` passes to a backend (row ops get 2-D
``[T, H]`` tensors, ``sample`` gets per-row parameter tensors), computes in float64 and returns
results in the input dtype (log-probabilities, entropies, losses, KL and advantages in float32;
float64 inputs give float64 results). The backward is torch autograd through the float64
computation. Every op accepts an ignored ``table=None`` keyword, like the rlk_triton ops.

It also implements the optional ops of ``rlk.parallel`` (:func:`tree_linear`,
:func:`column_tree_linear`, :func:`vocab_parallel_linear_logprobs`), whose ranks exchange
float64 partial values through the ``exchange`` that ``rlk.parallel`` passes.

The random numbers of :func:`sample` are specified bit-exactly in :mod:`rlk_reference.philox`.
"""

# Each module lists its ops in __all__ (static tools read the star imports and the sums);
# rlk-api's test_catalog.py checks that they are the ops of rlk's catalog.
from rlk_reference import _attention, _dense, _logprobs, _losses, _moe, _parallel, _ppo, _sampling
from rlk_reference._attention import *  # noqa: F403
from rlk_reference._dense import *  # noqa: F403
from rlk_reference._logprobs import *  # noqa: F403
from rlk_reference._losses import *  # noqa: F403
from rlk_reference._moe import *  # noqa: F403
from rlk_reference._parallel import *  # noqa: F403
from rlk_reference._ppo import *  # noqa: F403
from rlk_reference._sampling import *  # noqa: F403

__all__: list[str] = []
__all__ += _dense.__all__
__all__ += _attention.__all__
__all__ += _logprobs.__all__
__all__ += _losses.__all__
__all__ += _ppo.__all__
__all__ += _sampling.__all__
__all__ += _parallel.__all__
__all__ += _moe.__all__
