"""laneserve beside a peer server on this CPU, in interleaved rounds: every server is up at once, and each takes its
turn at each level, round after round, so a machine whose speed drifts from one minute to the next drifts for all of
them alike. Issue 55's check on any CPU, in one command:

    python -m benchmarks.bench_peer --peer "PATH/llama-server -m {gguf} -np 64 -t 2 -c 32768 --port {port}" \\
        --variants default avx512_vnni avx2

--peer is a command line ({gguf}: laneserve's default checkpoint, the same file; {port}: a free port); --variants
are laneserve servers, one per kernel variant (LANESERVE_CPU_MATMUL; default: the CPU's own choice), with serve.py's
defaults and --serve-args. Each level (CLIENTS:REQUESTS, requests per client) runs bench.py's client: streaming
chat, 128 tokens, ignore_eos, greedy. Prints the CPU, each server's output tok/s round by round, their means, and
each mean against the peer's."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout
PEER = "peer"


def level(text: str) -> tuple[int, int]:
    """--levels' CLIENTS:REQUESTS."""
    try:
        clients, requests = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text} is not CLIENTS:REQUESTS (say 4:2)") from None
    if clients < 1 or requests < 1:
        raise argparse.ArgumentTypeError(f"{text}: clients and requests must be at least 1")
    return clients, requests


def cpu_name() -> str:
    """The CPU's model, and the flags the kernels choose by."""
    info = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in info.splitlines() if ":" in line)}
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_bf16")
    flags = [f for f in wanted if f in fields.get("flags", "").split()]
    return f"{fields.get('model name', 'unknown CPU')}, {os.cpu_count()} threads, {' '.join(flags) or 'no AVX2'}"


def start(name: str, command: list[str], env: dict[str, str]) -> subprocess.Popen:
    """The server, its output to a file (a pipe nobody reads would fill and stop it)."""
    log = tempfile.TemporaryFile("w+")
    try:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    except OSError as e:
        raise SystemExit(f"bench_peer.py: error: cannot start {name}: {e}") from None
    proc.log = log
    return proc


def wait_up(name: str, url: str, proc: subprocess.Popen, deadline: float) -> None:
    """Until url serves /v1/models; a server that exits first, or is not up by the deadline, ends the run."""
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=2).close()
            return
        except OSError:
            time.sleep(1)
    proc.log.seek(0)
    last = (proc.log.read().strip().splitlines() or [""])[-1]
    why = f"exited ({proc.returncode})" if proc.poll() is not None else "was not up in time"
    raise SystemExit(f"bench_peer.py: error: {name} {why} before serving {url}" + (f": {last}" if last else ""))


def throughput(url: str, clients: int, requests: int, bench_args: list[str]) -> float:
    """Output tok/s of one bench.py level against url."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        argv = ["--base-url", url, "--concurrency", str(clients), "--requests-per-client", str(requests)]
        done = subprocess.run(
            [sys.executable, "bench.py", *argv, *bench_args, "--json", report], cwd=ROOT, capture_output=True, text=True
        )
        if done.returncode != 0:
            raise SystemExit(f"bench_peer.py: error: bench.py against {url}: {done.stderr.strip()[-500:]}")
        with open(report) as f:
            return json.load(f)["runs"]["remote"]["sweep"][0]["metrics"]["output_throughput"]


def words(p: argparse.ArgumentParser, flag: str, text: str, **fill) -> list[str]:
    """A flag's command line as its words, the placeholders filled in if given; a one-line error if it has none."""
    try:
        return shlex.split(text.format(**fill) if fill else text)
    except KeyError as e:
        p.error(f"{flag}: no placeholder {{{e.args[0]}}}: it takes {', '.join(map('{{{}}}'.format, fill))}")
    except (ValueError, IndexError) as e:  # unbalanced quotes or braces, or a positional {0}
        p.error(f"{flag}: {e}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_peer.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--peer", help="the peer's command line, {gguf} and {port} filled in (llama.cpp's llama-server)")
    p.add_argument("--variants", nargs="+", default=["default"], help="laneserve kernel variants (default: default)")
    p.add_argument("--levels", nargs="+", type=level, default=[(1, 6), (4, 2), (64, 1)], help="CLIENTS:REQUESTS")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every level on every server (default: 3)")
    p.add_argument("--serve-args", default="", help="more serve.py flags, for every laneserve server")
    p.add_argument("--bench-args", default="", help="more bench.py flags, for every level (say --max-tokens 32)")
    p.add_argument("--startup", type=float, default=300, help="seconds for every server to come up (default: 300)")
    p.add_argument("--json", help="write the rounds here")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.json and (os.path.isdir(args.json) or not os.access(os.path.dirname(os.path.abspath(args.json)), os.W_OK)):
        p.error(f"--json: cannot write {args.json} (a directory, or its directory is missing or read-only)")
    # Every command line split now, not once servers are up: unbalanced quotes, or a placeholder the peer has not.
    serve_args, bench_args = words(p, "--serve-args", args.serve_args), words(p, "--bench-args", args.bench_args)
    peer = args.peer is not None and words(p, "--peer", args.peer, gguf="GGUF", port=0)
    if peer == []:
        p.error("--peer is empty: give the peer's command line, or leave --peer out")
    try:
        import weights  # after parsing: --help needs no torch

        gguf = weights.resolve_checkpoint()
    except (ImportError, FileNotFoundError) as e:  # laneserve's servers need what weights.py needs
        p.error(f"laneserve cannot run here ({type(e).__name__}: {e})")
    commands: dict[str, tuple[list[str], dict[str, str]]] = {}
    ports: dict[str, int] = {}
    for name in ([PEER] if peer else []) + args.variants:
        with socket.socket() as s:  # a free port now; taken by the server a moment later
            s.bind(("127.0.0.1", 0))
            ports[name] = s.getsockname()[1]
        if name == PEER:
            commands[name] = shlex.split(args.peer.format(gguf=gguf, port=ports[name])), dict(os.environ)
        else:
            env = {k: v for k, v in os.environ.items() if k != "LANESERVE_CPU_MATMUL"}
            env |= {"LANESERVE_CPU_MATMUL": name} if name != "default" else {}
            serve = [sys.executable, "serve.py", "--port", str(ports[name]), *serve_args]
            commands[name] = serve, env
    rounds: dict[str, dict[str, list[float]]] = {f"{c}:{r}": {n: [] for n in commands} for c, r in args.levels}
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, (command, env) in commands.items():
            procs[name] = start(name, command, env)
        deadline = time.monotonic() + args.startup
        for name, proc in procs.items():
            wait_up(name, f"http://127.0.0.1:{ports[name]}", proc, deadline)
        print(f"bench_peer: {cpu_name()}; servers: {', '.join(commands)}", flush=True)
        for r in range(args.rounds):
            for clients, requests in args.levels:
                for name in commands:
                    tok_s = throughput(f"http://127.0.0.1:{ports[name]}", clients, requests, bench_args)
                    rounds[f"{clients}:{requests}"][name].append(tok_s)
            print(f"bench_peer: round {r + 1} of {args.rounds} done", flush=True)
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait()
    print("| output tok/s, level (clients:requests each) | server | rounds | mean | vs peer |")
    print("| --- | --- | --- | --- | --- |")
    for lv, by_server in rounds.items():
        for name, xs in by_server.items():
            mean, peer = statistics.mean(xs), rounds[lv].get(PEER)
            ratio = f"{mean / statistics.mean(peer):.2f}x" if peer and name != PEER else ""
            print(f"| {lv} | {name} | {', '.join(f'{x:.1f}' for x in xs)} | {mean:.1f} | {ratio} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_name(), "commands": {n: c for n, (c, _) in commands.items()}, "rounds": rounds}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
