"""A vLLM worker that dies ends the call with an error, never a hang (the real engine, CPU build).

Each case runs rlk's model in vLLM the way users start it (``LLM(model=..., **engine_args())``)
in a child Python process that :func:`subprocess.run` bounds with a timeout, so a hang fails the
test instead of stalling the suite. The child kills vLLM's worker process (the ``VLLM::Worker``
child of the ``EngineCore`` process, which holds rlk's model) with SIGKILL in the middle of a
call: (a) ``llm.generate`` after three engine steps of a longer generation, (b)
``rv.update_weights`` after two of its buckets were pushed, and reports what the call did.

Killing the ``EngineCore`` process itself instead hangs vLLM 0.32's synchronous ``LLM`` (its
engine monitor marks the engine dead but fails no call already waiting: ``generate`` blocks on
its output queue, ``collective_rpc`` on its future), which the guide tells users to bound.

Run as a script, this file is the child (``python test_vllm_worker_death.py MODE CHECKPOINT``):
it prints one JSON line. vLLM spawns its engine process, which imports this file again as
``__mp_main__``, so the child's work stays under ``if __name__ == "__main__"``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from vllm_helpers import ENGINE, prompts, rv, write_checkpoint  # skips without vLLM

pytestmark = pytest.mark.slow

#: The child's wall-clock bound in seconds: an engine start (30-95 s on a busy 2-core host)
#: plus the call; a call that hangs after the kill runs into it.
CHILD_TIMEOUT = 180
#: The most seconds the call may take to raise once the worker is dead.
RAISE_WITHIN = 30.0


def _worker(llm):
    """vLLM's worker process of ``llm`` (psutil): the one child of its EngineCore process."""
    import psutil

    procs = llm.llm_engine.engine_core.resources.engine_manager.processes
    (core,) = procs
    workers = [p for p in psutil.Process(core.pid).children() if "Worker" in p.name()]
    if len(workers) != 1:
        raise RuntimeError(f"expected one vLLM worker under EngineCore, found {workers}")
    return workers[0]


def _child(mode: str, checkpoint: str) -> dict:
    """Start the engine, kill its worker in the middle of ``mode``'s call, report the call."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=checkpoint, **{**ENGINE, **rv.engine_args()})
    worker = _worker(llm)
    state = {"killed_at": None}

    def kill() -> None:
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=30)  # gone before the call goes on
        state["killed_at"] = time.monotonic()

    def after(fn, n: int):
        """``fn`` that kills the worker once it has been called ``n`` times."""
        calls = [0]

        def wrapped(*a, **kw):
            calls[0] += 1
            if calls[0] == n + 1:
                kill()
            return fn(*a, **kw)

        return wrapped

    sp = SamplingParams(max_tokens=64, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts([5, 7])]
    if mode == "generate":
        llm.llm_engine.step = after(llm.llm_engine.step, 3)
        call = lambda: llm.generate(requests, sp, use_tqdm=False)  # noqa: E731
    else:
        from safetensors.torch import load_file

        tensors = sorted(load_file(os.path.join(checkpoint, "model.safetensors")).items())
        llm.collective_rpc = after(llm.collective_rpc, 2)
        call = lambda: rv.update_weights(llm, tensors, bucket_size=1)  # noqa: E731
    report = {"worker_alive": None, "returned": False, "error": None, "message": None}
    try:
        call()
        report["returned"] = True
    except Exception as e:  # noqa: BLE001 - what the call raised is the result
        report["error"], report["message"] = type(e).__name__, str(e)[:300]
    if state["killed_at"] is not None:
        report["seconds"] = time.monotonic() - state["killed_at"]
    report["killed"] = state["killed_at"] is not None
    report["worker_alive"] = worker.is_running() and worker.status() != "zombie"
    # The engine is unusable afterwards: a next generate refuses instead of sampling.
    try:
        llm.generate(requests[:1], sp, use_tqdm=False)
        report["next"] = "returned"
    except Exception as e:  # noqa: BLE001
        report["next"] = type(e).__name__
    return report


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-hd64"))
    write_checkpoint(path)
    return path


@pytest.mark.parametrize("mode", ["generate", "update"])
def test_a_dead_worker_ends_the_call_with_an_error(checkpoint, mode):
    """SIGKILL of vLLM's worker in the middle of ``generate`` / ``update_weights``: the call
    raises within :data:`RAISE_WITHIN` seconds (``EngineDeadError`` for ``generate``; vLLM's
    failed ``collective_rpc`` for the update), the worker is really gone, and the engine refuses
    the next ``generate``. A hang runs into the child's timeout and fails the test; a call that
    finished before the kill (``returned``) fails it too."""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(__file__))
    try:
        run = subprocess.run(
            [sys.executable, __file__, mode, checkpoint],
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT,
            env=env,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{mode}: no result within {CHILD_TIMEOUT} s after start (a hang):\n{e.stderr}")
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
    if run.returncode != 0 or not lines:
        started = "Engine core initialization failed" not in run.stderr
        if not started and os.environ.get("RLK_REQUIRE_VLLM") != "1":
            pytest.skip("vLLM's engine cannot start here")
        pytest.fail(f"the child failed ({run.returncode}):\n{run.stderr[-4000:]}")
    got = json.loads(lines[-1])
    assert got["killed"], got
    assert not got["worker_alive"], got
    assert not got["returned"], f"{mode} finished although its worker died: {got}"
    if mode == "generate":
        assert got["error"] == "EngineDeadError", got
    else:
        assert got["error"] == "EngineDeadError" or "collective_rpc" in got["message"], got
    assert got["seconds"] < RAISE_WITHIN, got
    assert got["next"] == "EngineDeadError", got


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1], sys.argv[2])), flush=True)
