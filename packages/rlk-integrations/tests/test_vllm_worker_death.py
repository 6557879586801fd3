"""A vLLM worker that dies ends the call with an error, never a hang (the real engine, CPU build).

Each case runs rlk's model in vLLM the way users start it (``LLM(model=..., **engine_args())``)
in a child Python process that :func:`subprocess.run` bounds with a timeout, so a hang fails the
test instead of stalling the suite. In the middle of a call the child SIGKILLs:

(a) ``llm.generate``, after three engine steps of a longer generation: vLLM's worker process
    (the ``VLLM::Worker`` child of the ``EngineCore`` process, which holds rlk's model); vLLM's
    executor reports it and the call raises ``EngineDeadError``;
(b) ``rv.update_weights``, while its third bucket's ``collective_rpc`` waits for an answer:
    the ``EngineCore`` process (stopped when the call is sent, killed a second later). vLLM
    0.32's synchronous ``LLM`` waits forever for that answer (its engine monitor marks the
    engine dead but fails no call already waiting); ``update_weights`` watches that mark and
    raises ``RuntimeError`` naming the bucket and the process. Without that bound the child
    runs into its timeout.

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
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from vllm_helpers import ENGINE, prompts, rv, write_checkpoint  # skips without vLLM

pytestmark = pytest.mark.slow

#: The child's wall-clock bound in seconds: an engine start (30-95 s on a busy 2-core host)
#: plus the call; a call that hangs after the kill runs into it.
CHILD_TIMEOUT = 180
#: The most seconds the call may take to raise once the process is dead.
RAISE_WITHIN = 30.0


def _victim(llm, mode: str):
    """The process to kill (psutil): for ``generate`` vLLM's worker, the one child of the
    EngineCore process; for ``update`` the EngineCore process itself."""
    import psutil

    (core,) = llm.llm_engine.engine_core.resources.engine_manager.processes
    if mode == "update":
        return psutil.Process(core.pid)
    workers = [p for p in psutil.Process(core.pid).children() if "Worker" in p.name()]
    if len(workers) != 1:
        raise RuntimeError(f"expected one vLLM worker under EngineCore, found {workers}")
    return workers[0]


def _child(mode: str, checkpoint: str) -> dict:
    """Start the engine, kill a process of it in the middle of ``mode``'s call, report."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=checkpoint, **{**ENGINE, **rv.engine_args()})
    victim = _victim(llm, mode)
    state = {"killed_at": None}

    def kill() -> None:
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)  # gone before the call goes on
        state["killed_at"] = time.monotonic()

    def in_flight() -> None:
        """Kill once the call is sent: the process is stopped now (the call waits for an
        answer that never comes) and killed a second later, while the call waits."""
        victim.send_signal(signal.SIGSTOP)
        threading.Timer(1.0, kill).start()

    def after(fn, n: int, action):
        """``fn`` that runs ``action`` before its call ``n + 1``."""
        calls = [0]

        def wrapped(*a, **kw):
            calls[0] += 1
            if calls[0] == n + 1:
                action()
            return fn(*a, **kw)

        return wrapped

    sp = SamplingParams(max_tokens=64, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts([5, 7])]
    if mode == "generate":
        llm.llm_engine.step = after(llm.llm_engine.step, 3, kill)
        call = lambda: llm.generate(requests, sp, use_tqdm=False)  # noqa: E731
    else:
        from safetensors.torch import load_file

        tensors = sorted(load_file(os.path.join(checkpoint, "model.safetensors")).items())
        llm.collective_rpc = after(llm.collective_rpc, 2, in_flight)
        call = lambda: rv.update_weights(llm, tensors, bucket_size=1)  # noqa: E731
    report = {"alive": None, "returned": False, "error": None, "message": None}
    try:
        call()
        report["returned"] = True
    except Exception as e:  # noqa: BLE001 - what the call raised is the result
        report["error"], report["message"] = type(e).__name__, str(e)[:300]
    if state["killed_at"] is not None:
        report["seconds"] = time.monotonic() - state["killed_at"]
    report["killed"] = state["killed_at"] is not None
    report["alive"] = victim.is_running() and victim.status() != "zombie"
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
    """A process of vLLM killed in the middle of ``generate`` / ``update_weights`` (module
    docstring): the call raises within :data:`RAISE_WITHIN` seconds of the kill
    (``EngineDeadError`` for ``generate``, rlk's ``RuntimeError`` naming the bucket and
    ``EngineCore`` for the update), the killed process is really gone, and the engine refuses
    the next ``generate``. A hang runs into the child's timeout and fails the test; a call that
    finished before the kill (``returned``, ``killed`` false) fails it too."""
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
    assert not got["alive"], got
    assert not got["returned"], f"{mode} finished although vLLM was killed: {got}"
    if mode == "generate":
        assert got["error"] == "EngineDeadError", got
    else:
        assert got["error"] == "RuntimeError", got
        assert "EngineCore" in got["message"] and "bucket 3 of" in got["message"], got
    assert got["seconds"] < RAISE_WITHIN, got
    assert got["next"] == "EngineDeadError", got


class _Stuck:
    """An ``LLM`` stand-in whose calls never answer, as vLLM 0.32's client after EngineCore
    died; ``engine_dead`` is its engine monitor's flag."""

    def __init__(self, dead: bool) -> None:
        resources = SimpleNamespace(engine_dead=dead, engine_manager=None)
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(resources=resources))
        self.calls = 0

    def collective_rpc(self, *args, **kwargs):
        self.calls += 1
        threading.Event().wait()  # never returns


@pytest.mark.parametrize("dead", [False, True])
def test_update_weights_is_bounded_when_vllm_never_answers(dead):
    """A call that never returns: ``update_weights`` raises ``TimeoutError`` after ``timeout``
    seconds, or at once (without a timeout) ``RuntimeError`` naming the bucket once vLLM's
    monitor marks the engine dead."""
    llm = _Stuck(dead)
    tensors = [("a", torch.zeros(2)), ("b", torch.ones(2))]
    raised: list[BaseException] = []

    def push() -> None:  # in a thread, so that a regression hangs the thread, not the suite
        try:
            rv.update_weights(llm, tensors, bucket_size=1, timeout=None if dead else 1.0)
        except BaseException as e:  # noqa: BLE001 - checked below
            raised.append(e)

    thread = threading.Thread(target=push, daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "update_weights hung on an engine that never answers"
    (e,) = raised
    if dead:
        assert isinstance(e, RuntimeError) and "engine died during" in str(e), e
    else:
        assert isinstance(e, TimeoutError), e
    assert "(bucket 1 of 2)" in str(e) and llm.calls == 1, e
    with pytest.raises(ValueError, match="timeout"):
        rv.update_weights(llm, tensors, timeout=0)


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1], sys.argv[2])), flush=True)
