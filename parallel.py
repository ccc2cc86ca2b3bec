"""Tensor parallelism on torch.distributed: one model split across processes, Megatron's way (tp_split says
which rows or columns each rank holds). Rank 0, the engine, broadcasts each step's batch; every rank runs the same
forward pass on its own heads and MLP columns, and one all-reduce per half-layer adds their partial outputs. One GPU
per rank with NCCL, or CPU processes with gloo. The engine spawns its workers; under torchrun (several machines) every
process runs the same command, rank 0 serves, and the others call runner.run_worker."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import os
import signal
import socket
import threading
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if TYPE_CHECKING:
    from model import ModelConfig


def tp_split(c: ModelConfig, name: str, rank: int, size: int) -> tuple[int, int, int] | None:
    """The part of weight `name` (HF naming) that rank `rank` of `size` holds, as (dim, start, stop); None:
    all of it (embedding, norms, LM head). Megatron's split: Q/K/V and gate/up by output rows, o and down by
    input columns, so a rank owns whole attention heads and MLP columns, and adding the ranks' partial o and
    down outputs completes a layer. KV heads are split like the query heads while there are at least `size`
    of them; with fewer, rank r keeps head r * kv // size, the one its query heads read (as vLLM does)."""
    d, heads, kv = c.head_dim, c.num_attention_heads // size, c.num_key_value_heads
    if name.endswith(("q_proj.weight", "o_proj.weight")):
        start, n = rank * heads * d, heads * d
    elif name.endswith(("k_proj.weight", "v_proj.weight")):
        start, n = rank * kv // size * d, max(1, kv // size) * d
    elif name.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight")):
        n = c.intermediate_size // size
        start = rank * n
    else:
        return None
    return int(name.endswith(("o_proj.weight", "down_proj.weight"))), start, start + n


def tp_check(c: ModelConfig, size: int) -> None:
    """ValueError unless the model splits evenly into `size` ranks."""
    kv = c.num_key_value_heads
    for what, n, ok in (
        ("attention heads", c.num_attention_heads, c.num_attention_heads % size == 0),
        ("KV heads", kv, kv % size == 0 if size <= kv else size % kv == 0),
        ("MLP columns", c.intermediate_size, c.intermediate_size % size == 0),
    ):
        if not ok:
            raise ValueError(f"tensor_parallel_size {size} does not split the model's {n} {what} evenly")


_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13

# How long a rank waits for the others to join, and then within a step for the others to reach each
# all-reduce. Waiting for the next step has no limit (the control group's): the server may idle for days.
STARTUP = datetime.timedelta(minutes=2)


class WorkerFailure(RuntimeError):
    """A rank died or a collective failed: the ranks are out of step, and the model cannot run again."""


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


class TensorParallel:
    """This process's rank, size, device and two process groups: the model's all-reduces on the device's
    backend (NCCL or gloo), the step broadcasts on gloo, on the host, with no timeout (see STARTUP)."""

    def __init__(self, size: int, device_type: str, threads: int | None, rank: int = 0, address: str | None = None):
        """Checks what can be checked before loading; the group forms in start()."""
        if launched_by_torchrun():
            rank, local_rank, local_size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))
            if int(os.environ["WORLD_SIZE"]) != size:
                raise ValueError(
                    f"torchrun started {os.environ['WORLD_SIZE']} processes for tensor_parallel_size "
                    f"{size}: they must be equal"
                )
        else:
            local_rank, local_size = rank, size
        backend = "nccl" if device_type == "cuda" else "gloo"
        if not (dist.is_available() and dist.is_backend_available(backend)):
            raise ValueError(
                f"tensor parallelism on {device_type} needs torch.distributed's {backend} backend, "
                "which this torch build lacks"
            )
        if device_type == "cuda" and local_size > torch.cuda.device_count():
            raise ValueError(
                f"tensor_parallel_size {size} needs {local_size} GPUs on this machine; "
                f"{torch.cuda.device_count()} are visible"
            )
        if dist.is_initialized():
            raise ValueError("one tensor-parallel engine per process: close the other first")
        self.rank, self.size, self.address, self.backend = rank, size, address, backend
        self.device = torch.device(f"cuda:{local_rank}") if device_type == "cuda" else torch.device("cpu")
        if device_type == "cpu":  # the ranks share this machine's cores
            torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // local_size))
        self.failure: str | None = None
        # Run by close() before the group is destroyed: NCCL's destroy waits until every CUDA graph that captured
        # its kernels is gone (a hang at exit otherwise), so the runner frees its graphs here.
        self.on_close: list[Callable[[], None]] = []
        self.workers: list[mp.Process] = []
        self.watcher: threading.Thread | None = None
        self.started = self.closed = False

    def start(self, spawn: tuple = ()) -> None:
        """Form the group; rank 0 outside torchrun first spawns ranks 1..size-1 running spawn[0](*spawn[1:], rank,
        address). Joining waits at most STARTUP: a spawned worker joins right after its imports, or it has died."""
        address = self.address
        if self.rank > 0:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's: it tells the others to stop
            if mp.parent_process():  # spawned by rank 0 (torchrun ends its processes itself)
                threading.Thread(target=_exit_with_rank_0, daemon=True, name="tp-parent").start()
        if launched_by_torchrun():
            address = "env://"
        elif self.rank == 0:
            with socket.socket() as s:  # a free port for the rendezvous
                s.bind(("127.0.0.1", 0))
                address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
            target, *args = spawn
            self.workers = [
                mp.get_context("spawn").Process(
                    target=target, args=(*args, r, address), daemon=True, name=f"tp-rank{r}"
                )
                for r in range(1, self.size)
            ]
            for w in self.workers:
                w.start()
            self.watcher = threading.Thread(target=self._watch, daemon=True, name="tp-watch")
            self.watcher.start()
        self.started = True
        dist.init_process_group(
            self.backend,
            init_method=address,
            rank=self.rank,
            world_size=self.size,
            timeout=STARTUP,
            device_id=self.device if self.device.type == "cuda" else None,
        )
        self.group = dist.group.WORLD
        self.control = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))
        atexit.register(self.close)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x, the same bits whatever the batch: for two ranks one addition (commutative:
        any algorithm, same bits); with more, NCCL and gloo order additions by size, so here parts add in rank order."""
        if self.size == 2:
            dist.all_reduce(x, group=self.group)
            return x
        parts = x.new_empty(self.size * x.shape[0], *x.shape[1:])
        _all_gather(parts, x.contiguous(), group=self.group)
        return functools.reduce(torch.add, parts.chunk(self.size))

    def barrier(self) -> None:
        dist.barrier(group=self.control)

    def smallest(self, value: int) -> int:
        """The smallest of every rank's value (the KV blocks each rank has room for)."""
        t = torch.tensor([value])
        dist.all_reduce(t, dist.ReduceOp.MIN, group=self.control)
        return int(t)

    def broadcast(self, step: object) -> object:
        """Rank 0 sends step (any picklable object; None says stop) to every rank; the others get it."""
        box = [step]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def fail(self, error: BaseException) -> WorkerFailure:
        """What rank 0 raises once a step failed: the ranks are out of step, so the workers are ended."""
        if self.failure is None:  # a dead worker is the likely cause: name it
            self.failure = self._dead(timeout=1.0) or f"tensor parallelism failed ({type(error).__name__}: {error})"
        self._end_workers()
        return WorkerFailure(self.failure)

    def close(self) -> None:
        """Rank 0: tell the workers to stop and wait for them (ending any that do not); every rank: leave the
        group. Called by Engine.close and at exit."""
        if self.closed or not self.started:
            self.closed = True
            return
        self.closed = True
        if self.rank == 0 and self.failure is None:
            with contextlib.suppress(RuntimeError):  # a worker is already gone: ended below
                self.broadcast(None)
        for w in self.workers:
            w.join(timeout=10)
        self._end_workers()
        if self.watcher:  # it may be reaping a worker too: until it has recorded the exit, is_alive() says yes
            self.watcher.join()
        for release in self.on_close:
            release()
        if dist.is_initialized():  # not if joining failed
            dist.destroy_process_group()
        atexit.unregister(self.close)

    def _end_workers(self) -> None:
        for w in self.workers:
            if w.is_alive():
                w.kill()
            w.join()

    def _watch(self) -> None:
        """Rank 0: notice a worker's death even while idle (/health then answers 503), and end the others, so
        that a collective in flight fails at once instead of waiting for the dead rank."""
        dead = self._dead()
        if not self.closed:
            self.failure = self.failure or dead
            self._end_workers()

    def _dead(self, timeout: float | None = None) -> str | None:
        """Which worker has exited, waiting up to timeout for one (None: as long as it takes)."""
        if not self.workers:  # torchrun's ranks, or a worker's own view: nothing to watch
            return None
        ready = wait([w.sentinel for w in self.workers], timeout)
        for w in self.workers:
            if w.sentinel in ready:
                w.join()  # its pipe closes as it exits: reap it for its exit code
                return f"tensor-parallel worker {w.name} exited (code {w.exitcode}); restart the server"
        return None


def rank_0_gone(timeout: float | None = 1.0) -> bool:
    """In a spawned worker: whether rank 0, its parent, has exited, waiting up to timeout for it (a collective
    failing is often the first sign of its exit; None waits as long as it takes)."""
    parent = mp.parent_process()
    if parent is None:
        return False
    parent.join(timeout)
    return not parent.is_alive()


def _exit_with_rank_0() -> None:
    """A spawned worker's watch on rank 0, which may go without a word (killed, or exiting mid-load, which torch
    cannot interrupt): it ends itself quietly, not waiting out STARTUP in a rendezvous or failing a collective."""
    rank_0_gone(timeout=None)
    os._exit(1)
