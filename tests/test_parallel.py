"""Tensor parallelism on CPU with gloo: 2, 3 and 4 processes give TP=1's greedy tokens (float32), on SmolLM2's
weights too and under KV pressure; HTTP streaming from a TP=2 server; a killed worker; torchrun's entry point;
the errors."""

import contextlib
import http.client
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
import test_lanes
import torch

import parallel
import weights
from config import EngineConfig
from engine import LLM
from model import ModelConfig
from sequence import SamplingParams
from serve import Server

pytestmark = pytest.mark.slow  # the whole file: run by `pytest -q`, not by `-m "not slow"`

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], list(range(7, 47)), list(range(100, 117)), [9] * 70]


def shapes(kv_heads: int) -> ModelConfig:
    return ModelConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=kv_heads,
        head_dim=16,
    )


@pytest.fixture
def preset(monkeypatch):
    """Registers a small preset (rank 0 sends its shapes to the workers it spawns)."""

    def register(kv_heads: int) -> str:
        monkeypatch.setitem(weights.PRESETS, f"kv{kv_heads}", shapes(kv_heads))
        return f"kv{kv_heads}"

    return register


def run(prompts: list, params: SamplingParams = GREEDY, **knobs) -> tuple[list[list[int]], int, list[str]]:
    """Greedy tokens of each prompt, how many preemptions it took, and the texts."""
    llm = LLM(device="cpu", dtype="float32", **knobs)
    try:
        outs = llm.generate(prompts, params)
        assert all(o.error is None for o in outs)
        return [o.token_ids for o in outs], llm.scheduler.num_preemptions, [o.text for o in outs]
    finally:
        llm.close()


# KV heads split, then replicated (tp > KV heads); an 8-bit KV cache (each rank's heads and their scales)
@pytest.mark.parametrize("kv_heads,tp,kv_cache_dtype", [(4, 2, "auto"), (2, 4, "auto"), (4, 2, "int8")])
def test_tp_gives_tp1_tokens_and_lanes_never_mix(preset, kv_heads, tp, kv_cache_dtype):
    """TP's greedy tokens are TP=1's; and under TP a request's tokens and logprobs are the same bits alone
    as beside the others (two ranks all-reduce, four gather and add in rank order)."""
    model = preset(kv_heads)
    knobs = dict(model=model, dummy_weights=True, num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype)
    tp1 = run(PROMPTS, **knobs)[0]
    llm = LLM(device="cpu", dtype="float32", **knobs, tensor_parallel_size=tp)
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == tp1
        params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, logprobs=2, ignore_eos=True)
        requests = [(p, params) for p in PROMPTS]
        assert test_lanes.run(llm, requests) == test_lanes.alone(llm, requests)
        # What must go before the group (CUDA graphs holding NCCL's communicator) goes while it still exists.
        released = []
        llm.runner.tp.on_close.append(lambda: released.append(torch.distributed.is_initialized()))
    finally:
        llm.close()
    assert released == [True]


def test_tp3_gives_tp1_tokens_on_the_default_models_weights(smollm2_4_layers):
    # SmolLM2's own weights (its first 4 layers): 9 query and 3 KV heads, 3 and 1 per rank, each rank
    # reading its slices of the safetensors.
    prompts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"]
    tp1 = run(prompts, model=smollm2_4_layers, num_kv_blocks=128)[0]
    assert run(prompts, model=smollm2_4_layers, num_kv_blocks=128, tensor_parallel_size=3)[0] == tp1


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tp_under_kv_pressure(preset, mode):
    model = preset(4)
    prompts = [list(range(i, i + 30 + 5 * i)) for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = run(prompts, params, model=model, dummy_weights=True, num_kv_blocks=64)[0]
    tokens, preemptions, _ = run(
        prompts,
        params,
        model=model,
        dummy_weights=True,
        num_kv_blocks=12,
        block_size=16,
        preemption_mode=mode,
        swap_space=0.01,
        tensor_parallel_size=2,
    )
    assert preemptions > 0 and tokens == alone


def request(url: str, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
    host, port = re.match(r"http://([\d.]+):(\d+)", url).groups()
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request(method, path, json.dumps(body) if body else None)
    r = conn.getresponse()
    return r.status, r.read()


def test_tp2_server_streams_then_a_killed_worker_is_an_error_not_a_hang(preset):
    model = preset(4)
    expected = run([[5, 6, 7]], model=model, dummy_weights=True, num_kv_blocks=64)[2][0]
    s = Server(
        EngineConfig(
            model=model, dummy_weights=True, num_kv_blocks=64, device="cpu", dtype="float32", tensor_parallel_size=2
        ),
        port=0,
        log_requests=False,
    )
    s.start()
    try:
        assert s.wait_ready(120)
        body = {
            "model": model,
            "prompt": [5, 6, 7],
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        status, raw = request(s.url, "POST", "/v1/completions", body)
        events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]
        assert status == 200 and len(events) == 12  # a chunk per token: random weights' tokens are all printable
        assert "".join(e["choices"][0]["text"] for e in events) == expected
        workers = s.engine.runner.tp.workers
        os.kill(workers[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while request(s.url, "GET", "/health")[0] == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        status, raw = request(s.url, "GET", "/health")
        assert status == 503 and "worker tp-rank1 exited" in json.loads(raw)["error"]["message"]
        assert request(s.url, "POST", "/v1/completions", {**body, "stream": False})[0] == 503
        assert not any(w.is_alive() for w in workers)
    finally:
        s.stop()
    assert not torch.distributed.is_initialized()


def test_a_worker_killed_mid_generation_fails_the_step(preset):
    model = preset(4)
    llm = LLM(model=model, dummy_weights=True, num_kv_blocks=64, device="cpu", dtype="float32", tensor_parallel_size=2)
    try:
        llm.add_request([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
        llm.step()
        os.kill(llm.runner.tp.workers[0].pid, signal.SIGKILL)
        with pytest.raises(parallel.WorkerFailure, match="tp-rank1 exited"):
            for _ in range(50):
                llm.step()
    finally:
        llm.close()
    assert not any(w.is_alive() for w in llm.runner.tp.workers)


@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_ctrl_c_stops_every_rank(launcher):
    """serve.py spawning its 2 workers, or torchrun starting 3 copies of it (the multi-node entry point, on
    one machine, env:// rendezvous): rank 0 serves; Ctrl-C in the terminal stops every process."""
    serve = [
        "serve.py",
        "--dummy-weights",
        "--tensor-parallel-size",
        "3",
        "--port",
        "0",
        "--num-kv-blocks",
        "64",
        "--max-model-len",
        "512",
    ]
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3"]
    p = subprocess.Popen(
        [sys.executable, *(torchrun if launcher == "torchrun" else []), *serve],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        for line in p.stderr:
            if "serving http" in line:
                break
        url = re.search(r"http://[\d.]+:\d+", line).group()
        status, raw = request(url, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 4, "ignore_eos": True})
        assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 4
        os.killpg(p.pid, signal.SIGINT)  # as a terminal's Ctrl-C: to every process of the group
        code = p.wait(60)
        err = p.stderr.read()
        assert "laneserve: stopping" in err
        if launcher == "spawn":  # torchrun itself answers SIGINT with a traceback and exit status 1
            assert code == 0 and "Traceback" not in err, err
        # Every process it started ends (they share its session), within seconds.
        deadline = time.monotonic() + 10
        while (left := _session_members(p.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)


@pytest.mark.parametrize("wait", [0.0, 2.0])  # after the workers start: while they import, or join and load
def test_stopped_while_loading_leaves_no_worker_and_no_traceback(wait):
    """SIGTERM while the spawned workers are still loading: rank 0 exits at once (torch cannot be stopped
    mid-load), and its workers, which nothing can tell to stop any more, end themselves quietly. A load that wins
    the race (a warm machine loads in under 2 s) must find a server it can start, not fail its KV check."""
    p = subprocess.Popen(
        [
            sys.executable,
            "serve.py",
            "--dummy-weights",
            "--tensor-parallel-size",
            "3",
            "--port",
            "0",
            "--num-kv-blocks",
            "64",
            "--max-model-len",
            "1024",
        ],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while sum("spawn_main" in cmd for cmd in _session_members(p.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(wait)
        os.kill(p.pid, signal.SIGTERM)
        assert p.wait(30) == 0
        deadline = time.monotonic() + 10
        while (left := _session_members(p.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left
        err = p.stderr.read()  # the workers' stderr too: it ends once they have all exited
        assert "laneserve: stopping" in err and "Traceback" not in err, err
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)


def test_a_killed_rank_0_leaves_no_worker():
    """SIGKILL runs no exit handler on rank 0: its workers, which watch it, end by themselves."""
    script = (
        "import sys, time, weights\n"
        "sys.path.insert(0, 'tests')\n"
        "import test_parallel\n"
        "from engine import LLM\n"
        "weights.PRESETS['kv4'] = test_parallel.shapes(4)\n"
        "llm = LLM(model='kv4', dummy_weights=True, device='cpu', num_kv_blocks=64, tensor_parallel_size=2)\n"
        "print(llm.runner.tp.workers[0].pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        worker = int(p.stdout.readline())
        p.kill()
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{worker}") and _state(worker) != "Z" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{worker}") or _state(worker) == "Z"
    finally:
        p.kill()


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _session_members(session: int) -> list[str]:
    """Command lines of the live processes (not zombies) in a session."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, _, _, sid = f.read().rsplit(")", 1)[1].split()[:4]
            with open(f"/proc/{pid}/cmdline") as f:
                cmd = f.read().replace("\0", " ")
        except OSError:
            continue
        if int(sid) == session and state != "Z":
            found.append(cmd)
    return found


def test_clear_errors():
    with pytest.raises(ValueError, match="does not split the model's 9 attention heads"):
        LLM(device="cpu", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="nccl|GPUs"):  # no CUDA build here, or too few GPUs
        parallel.TensorParallel(torch.cuda.device_count() + 1, "cuda", None)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)
    assert not torch.distributed.is_initialized()


def test_tp_with_speculation(preset):
    # Drafts travel in the step's broadcast: under TP=2, outputs are the same with and without speculation.
    import test_speculation

    requests, model, got = test_speculation.mixed(random.Random(2), 6), preset(4), []
    requests += [
        (prompt, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, logprobs=1)) for prompt in PROMPTS
    ]
    for k in (0, 4):  # one tensor-parallel engine per process at a time
        llm = LLM(
            model=model,
            dummy_weights=True,
            num_kv_blocks=64,
            device="cpu",
            dtype="float32",
            tensor_parallel_size=2,
            num_speculative_tokens=k,
        )
        try:
            got.append(test_speculation.run(llm, requests))
        finally:
            llm.close()
    assert got[1] == got[0]
    assert llm.num_accepted_tokens > 0
