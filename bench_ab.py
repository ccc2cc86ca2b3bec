"""Two checkouts' engines on one workload, stepped in turn: this one and another (a worktree of an older
commit, say). On a machine whose speed drifts between runs, timing both in the same minutes is the fair
comparison; each engine runs in its own process, and only one steps at a time.

    git worktree add /tmp/before HEAD~1 && python bench_ab.py /tmp/before

The workload is bench.py's 64-stream level without HTTP: --num-seqs clients, each sending --waves requests
one after the other (random token ids, --prompt-len tokens, --max-tokens greedy tokens, ignore_eos)."""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import fields

from config import EngineConfig, add_cli_args, from_cli_args

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(args) -> None:
    """Load args.worker's engine, then take one step per line read; answer [seconds, prefill?] or null."""
    sys.path.insert(0, args.worker)
    from engine import Engine
    from sequence import SamplingParams
    engine = Engine(**json.loads(args.knobs))
    rng = random.Random(0)
    left: dict[str, int] = {}

    def send(waves: int) -> None:
        ids = [rng.randrange(1000, 20000) for _ in range(rng.randint(*args.prompt_len))]
        left[engine.add_request(ids, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0))] = waves

    for _ in range(args.num_seqs):
        send(args.waves - 1)
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
                send(waves - 1)


def positive(text: str) -> int:
    if not text.isdecimal() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("other", help="the other checkout's directory")
    p.add_argument("--num-seqs", type=positive, default=64, help="clients")
    p.add_argument("--waves", type=positive, default=2, help="requests per client, one after the other")
    p.add_argument("--prompt-len", type=positive, nargs=2, default=[53, 53], metavar=("MIN", "MAX"))
    p.add_argument("--max-tokens", type=positive, default=128)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--knobs", help=argparse.SUPPRESS)
    add_cli_args(p, "engine (both engines get the knobs set here, which the other checkout must know too)")
    args = p.parse_args(argv)
    if args.prompt_len[0] > args.prompt_len[1]:
        p.error("--prompt-len: MIN is over MAX")
    if args.worker:
        try:
            worker(args)
        except Exception as e:  # the parent says which worker failed; this line says why
            print(f"{args.worker}: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        return 0
    try:
        from_cli_args(args)
    except ValueError as e:
        p.error(str(e))
    roots = [HERE, os.path.abspath(args.other)]
    if not os.path.isfile(os.path.join(roots[1], "engine.py")):
        print(f"bench_ab.py: no engine.py in {roots[1]}", file=sys.stderr)
        return 2
    # Only the knobs that differ from this checkout's defaults, so that an older engine gets its own.
    knobs = {f.name: v for f in fields(EngineConfig) if "help" in f.metadata and (v := getattr(args, f.name)) != f.default}
    argv = [args.other, "--num-seqs", str(args.num_seqs), "--waves", str(args.waves), "--max-tokens",
            str(args.max_tokens), "--prompt-len", *map(str, args.prompt_len), "--knobs", json.dumps(knobs)]
    procs = [subprocess.Popen([sys.executable, __file__, *argv, "--worker", r], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for r in roots]
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
        print(f"bench_ab.py: {e}", file=sys.stderr)
        return 1
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    for root, (tp, npf, td, nd) in zip(("this", roots[1]), totals):
        print(f"{root}: {tp + td:.2f} s; {npf} steps with prefill {tp:.2f} s; {nd} decode steps "
              f"{1000 * td / max(nd, 1):.1f} ms each")
    (a, _, c, _), (b, _, d, _) = totals
    print(f"this / other: {(a + c) / (b + d):.3f} of the time ({(c / d if d else float('nan')):.3f} in decode steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
