"""Two checkouts' engines on one workload, stepped in turn: this one and another (a worktree of an older
commit, say). On a machine whose speed drifts between runs, timing both in the same minutes is the fair
comparison; each engine runs in its own process, and only one steps at a time.

    git worktree add /tmp/before HEAD~1 && python -m benchmarks.bench_ab /tmp/before

The workload is bench.py's 64-stream level without HTTP: --num-seqs clients, each sending --waves requests
one after the other (random token ids, --prompt-len tokens, --max-tokens greedy tokens, ignore_eos)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from dataclasses import fields

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout


def worker(root: str, job: dict) -> int:
    """root's engine on job's workload, one step per line read; answers [seconds, prefill?], then null.
    Nothing of the project is imported before this, so that every module comes from root."""
    sys.path[0] = root  # in place of this file's directory
    rng = random.Random(0)
    left: dict[str, int] = {}  # request id -> requests its client has still to send after it

    def send(waves: int) -> None:
        ids = [rng.randrange(1000, 20000) for _ in range(rng.randint(*job["prompt_len"]))]
        params = SamplingParams(max_tokens=job["max_tokens"], ignore_eos=True, temperature=0)
        left[engine.add_request(ids, params)] = waves

    def refuse(e: Exception) -> int:  # the parent says which worker failed; this line says why
        print(f"{root}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1

    try:
        from engine import Engine
        from sequence import SamplingParams

        engine = Engine(**job["knobs"])
        for _ in range(job["num_seqs"]):  # here too: a request the engine cannot hold (--max-tokens, --prompt-len)
            send(job["waves"] - 1)
    except Exception as e:
        return refuse(e)
    print("ready", flush=True)
    s = engine.scheduler
    for _ in sys.stdin:
        if not (s.running or s.waiting):
            print("null", flush=True)
            continue
        prefill = bool(s.waiting) or any(q.num_computed_tokens < q.num_prompt_tokens for q in s.running)
        t = time.perf_counter()
        outputs = engine.step()
        print(json.dumps([time.perf_counter() - t, prefill]), flush=True)
        for o in outputs:
            if o.finished and (waves := left.pop(o.request_id)):
                try:
                    send(waves - 1)
                except ValueError as e:  # a prompt longer than the first ones drew, and too long
                    return refuse(e)
    return 0


def main(argv: list[str] | None = None) -> int:
    # Here, not at the top: a worker must not have imported this checkout's modules.
    from bench import _number  # positive numbers, as bench.py's
    from cli import ArgumentParser, add_cli_args, from_cli_args
    from config import EngineConfig

    p = ArgumentParser(prog="bench_ab.py", description=__doc__.split("\n\n")[0])
    p.add_argument("other", help="the other checkout's directory")
    p.add_argument("--num-seqs", type=_number(int), default=64, help="clients")
    p.add_argument("--waves", type=_number(int), default=2, help="requests per client, one after the other")
    p.add_argument("--prompt-len", type=_number(int), nargs=2, default=[53, 53], metavar=("MIN", "MAX"))
    p.add_argument("--max-tokens", type=_number(int), default=128)
    add_cli_args(p, "engine (both engines get the knobs set here, which the other checkout must know too)")
    args = p.parse_args(argv)
    if args.prompt_len[0] > args.prompt_len[1]:
        p.error("--prompt-len: MIN is over MAX")
    try:
        from_cli_args(args)
    except ValueError as e:
        p.error(str(e))
    roots = [ROOT, os.path.abspath(args.other)]
    if not os.path.isfile(os.path.join(roots[1], "engine.py")):
        p.error(f"no engine.py in {roots[1]}")
    # Only the knobs that differ from this checkout's defaults, so that an older engine gets its own.
    job = {
        "knobs": {
            f.name: v
            for f in fields(EngineConfig)
            if "help" in f.metadata and (v := getattr(args, f.name)) != f.default
        },
        "num_seqs": args.num_seqs,
        "waves": args.waves,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
    }
    # Each checkout builds its kernels into its own extension directory: one shared by two versions of the same
    # extension's sources can hand a worker the other's build.
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser("~/.cache/torch_extensions")
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", r, json.dumps(job)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "TORCH_EXTENSIONS_DIR": os.path.join(base, f"ab{i}")},
        )
        for i, r in enumerate(roots)
    ]
    totals = [[0.0, 0, 0.0, 0] for _ in roots]  # prefill seconds and steps, decode seconds and steps
    try:
        if any(proc.stdout.readline().strip() != "ready" for proc in procs[::-1]):  # a broken other fails first
            raise RuntimeError("a worker failed to start (why is above)")
        running = [True, True]
        while any(running):
            for i, proc in enumerate(procs):
                if running[i]:
                    proc.stdin.write("step\n")
                    proc.stdin.flush()
                    if not (line := proc.stdout.readline()):
                        raise RuntimeError(f"the worker for {roots[i]} died (why is above)")
                    if (r := json.loads(line)) is None:
                        running[i] = False
                        continue
                    totals[i][0 if r[1] else 2] += r[0]
                    totals[i][1 if r[1] else 3] += 1
    except (RuntimeError, OSError) as e:
        print(f"bench_ab.py: error: {e}", file=sys.stderr)
        return 1
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    for root, (tp, npf, td, nd) in zip(("this", roots[1]), totals):
        print(
            f"{root}: {tp + td:.2f} s; {npf} steps with prefill {tp:.2f} s; {nd} decode steps "
            f"{1000 * td / max(nd, 1):.1f} ms each"
        )
    (a, _, c, _), (b, _, d, _) = totals
    print(f"this / other: {(a + c) / (b + d):.3f} of the time ({(c / d if d else float('nan')):.3f} in decode steps)")
    return 0


if __name__ == "__main__":
    sys.exit(worker(sys.argv[2], json.loads(sys.argv[3])) if sys.argv[1:2] == ["--worker"] else main())
