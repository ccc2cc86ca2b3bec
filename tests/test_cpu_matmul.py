"""The CPU matmul kernel (cpu_matmul): near the float64 product, and each row the same bits whatever the number of
rows beside it, its place among them and the thread count, in every instruction set this CPU runs (each forced in
turn), for float32, bfloat16, int4 and int8 weights. The lane tests run the engine on it (test_lanes.py)."""

import os
import subprocess
import sys

import pytest
import torch

import cpu
import cpu_matmul
import model

ISAS = [name for name in cpu_matmul.ISAS if cpu_matmul.supported(name)]
KINDS = [(dtype, quant) for quant in (None, "int4", "int8") for dtype in (torch.float32, torch.bfloat16)]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout
pytestmark = pytest.mark.skipif(not ISAS, reason="the kernel did not build, or this CPU has none of its ISAs")


def layer(dtype: torch.dtype, quant: str | None, isa: str, n: int = 200, k: int = 96, seed: int = 0):
    """A kernel Linear of n outputs (not a multiple of its 64-column tiles) and the float64 weight it holds."""
    w = lin_weight(dtype, n, k, seed)
    w64 = (
        cpu_matmul.dequantize_int4(*cpu_matmul.int4_groups(w, 32))
        if quant == "int4"
        else dequantize_int8(*cpu_matmul.int8_groups(w, 32))
        if quant == "int8"
        else w.double()
    )
    return cpu_matmul.Linear(w, cpu_matmul.ISAS[isa], quant), w64


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    return (q.double().view(n, k // 32, 32) * scale.double()[..., None]).view(n, k)


def lin_weight(dtype: torch.dtype, n: int = 200, k: int = 576, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def rows(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype, quant", KINDS)
def test_near_the_float64_product(isa, dtype, quant):
    lin, w64 = layer(dtype, quant, isa, k=576)
    x = rows(70, 576, dtype)
    y = lin(x)
    assert y.dtype == dtype and y.shape == (70, 200)
    exact = x.double() @ w64.T
    # float32 accumulation: at most K roundings of the running sum (bounded by |x| |w|); then bfloat16's output
    # rounding, half an ulp. int4 and int8 round x to 8 bits per group of 32 (amax / 254 off at most) against
    # (q - 8) * scale and q * scale.
    bound = 576 * 2.0**-24 * (x.double().abs() @ w64.abs().T) * 2 + exact.abs() * (
        2.0**-8 if dtype == torch.bfloat16 else 0
    )
    if quant == "int4":
        q, scale, lo = cpu_matmul.int4_groups(lin_weight(dtype), 32)
        centred = ((q.double().view(200, 18, 32) - 8) * scale.double()[..., None]).abs().sum(-1)  # [n, groups]
    if quant == "int8":
        centred = w64.abs().view(200, 18, 32).sum(-1)
    if quant:
        bound += (x.double().view(70, 18, 32).abs().amax(-1) / 254) @ centred.T
    err = (y.double() - exact).abs()
    assert (err <= bound + 1e-30).all(), (err - bound).max()
    assert err.max() > 0  # float32 sums round: equality would mean no kernel ran


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype, quant", KINDS)
def test_a_row_is_the_same_bits_in_any_batch(isa, dtype, quant):
    lin, _ = layer(dtype, quant, isa)
    x = rows(300, 96, dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = lin(x)
        for m in range(1, 301):  # every row count: each size of the last register tile, thread split
            assert torch.equal(lin(x[:m]), full[:m]), m
        for shift in (1, 3, 150):  # a row's place in the batch
            assert torch.equal(lin(x.roll(shift, 0)), full.roll(shift, 0)), shift
        torch.set_num_threads(1)
        for m in (1, 2, 5, 64, 300):
            assert torch.equal(lin(x[:m]), full[:m]), m
        assert torch.equal(lin(x[7:8]), full[7:8])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype, quant", KINDS)
def test_every_instruction_set_adds_in_one_order(dtype, quant):
    # float32, int4 and int8 are FMA chains of the same order in all (VNNI's vpdpbusd gives vpmaddubsw and
    # vpmaddwd's exact int32 sums); bfloat16 pairs too where vdpbf16ps is not used.
    same = [isa for isa in ISAS if quant or dtype == torch.float32 or isa != "avx512_bf16"]
    if len(same) < 2:
        pytest.skip("this CPU runs one instruction set")
    x = rows(70, 96, dtype)
    assert all(torch.equal(layer(dtype, quant, same[0])[0](x), layer(dtype, quant, isa)[0](x)) for isa in same[1:])


def test_choosing_the_instruction_set(monkeypatch):
    monkeypatch.setenv("LANESERVE_CPU_MATMUL", "off")
    assert cpu_matmul.isa() is None
    monkeypatch.setenv("LANESERVE_CPU_MATMUL", "avx2")
    assert cpu_matmul.isa() == cpu_matmul.ISAS["avx2"]
    monkeypatch.setenv("LANESERVE_CPU_MATMUL", "sse2")
    with pytest.raises(ValueError, match="LANESERVE_CPU_MATMUL=sse2: this CPU runs"):
        cpu_matmul.isa()
    monkeypatch.delenv("LANESERVE_CPU_MATMUL")
    assert cpu_matmul.isa() == cpu_matmul.ISAS[ISAS[-1]]


def test_bad_input_is_an_error():
    lin, _ = layer(torch.bfloat16, None, ISAS[0])
    with pytest.raises(RuntimeError, match="dtype"):
        lin(rows(3, 96, torch.float32))
    with pytest.raises(ValueError, match="does not fit"):
        lin(rows(3, 64, torch.bfloat16))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_matmul.Linear(torch.ones(4, 4, dtype=torch.float16), cpu_matmul.ISAS[ISAS[0]])
    for quant in ("int4", "int8"):
        with pytest.raises(ValueError, match="divisible by 32"):
            cpu_matmul.Linear(torch.ones(4, 48), cpu_matmul.ISAS[ISAS[0]], quant)


def test_int4_codes_are_those_of_the_tiles_path():
    # The kernel and cpu.Int4Linear (the fallback) quantize alike: the same codes, scales rounded apart.
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(3))
    x = torch.eye(96)
    w64 = cpu_matmul.dequantize_int4(*cpu_matmul.int4_groups(w, 32))
    assert torch.allclose(cpu_matmul.Linear(w, cpu_matmul.ISAS[ISAS[0]], "int4")(x).T.double(), w64, atol=1e-6)
    assert torch.allclose(cpu.Int4Linear(w)(x).T.double(), w64, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm(dtype):
    # Near the float64 formula (rounded where Hugging Face's RMSNorm rounds: twice in bfloat16), and a row the same
    # bits whatever rows run beside it and however many threads.
    norm = torch.nn.RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576, generator=torch.Generator().manual_seed(2)).to(dtype)
    kernel, x = cpu_matmul.RMSNorm(norm), rows(100, 576, dtype)
    y = kernel(x)
    exact = x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    # float32's sum of squares: 576 roundings at most, halved by the square root; then the roundings to dtype.
    rel = 576 * 2.0**-24 + (2 * 2.0**-8 if dtype == torch.bfloat16 else 2.0**-22)  # unit roundoff 2^-8
    want = exact * norm.weight.detach().double()
    assert ((y.double() - want).abs() <= want.abs() * rel + 1e-30).all()
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for m in (1, 3, 17, 100):
                assert torch.equal(kernel(x[:m]), y[:m])
            assert torch.equal(kernel(x.view(10, 10, 576)[3]), y[30:40])
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="rms_norm"):
        torch.ops.laneserve_cpu.rms_norm(x.half(), norm.weight.half(), 1e-5)


@pytest.mark.parametrize(
    "dtype, cache", [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.float32, torch.bfloat16)], ids=str
)
def test_rope_store_is_the_torch_forms_rope_and_store(dtype, cache):
    # model.apply_rope on the Q and K heads, then cpu.store_finite_kv, bit for bit: one row per token (q: 3 heads,
    # k: 2, v: 2), non-finite values and slots -1 among them; a token's row the same alone and beside others. A
    # bfloat16 cache beside float32 (--kv-cache-dtype bfloat16) takes the values rounded to it.
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(9, 7 * 64, generator=g).to(dtype)
    qkv[2, 3 * 64 + 5], qkv[4, 5 * 64], qkv[6, 4 * 64 + 1] = float("nan"), float("inf"), float("-inf")
    angles = torch.randn(9, 1, 64, generator=g) * 3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    sin[..., :32] *= -1  # as Transformer.rope_sin
    slots = torch.tensor([0, 5, 9, 17, 3, 30, 31, 8, -1])
    base = torch.randn(4, 8, 2, 64, generator=g).to(cache)
    torch_form, kernel = [base.clone(), base.clone()], [base.clone(), base.clone()]
    qk = model.apply_rope(qkv.view(9, 7, 64)[:, :5], cos, sin)
    cpu.store_finite_kv(qk[:, 3:], qkv.view(9, 7, 64)[:, 5:], *torch_form, slots)
    q = torch.ops.laneserve_cpu.rope_store(qkv, cos, sin, *kernel, slots, 3)
    assert torch.equal(q, qk[:, :3])
    for a, b in zip(torch_form, kernel):
        assert torch.equal(a, b) and a.isfinite().all()
    for i in (0, 4, 8):
        assert torch.equal(
            torch.ops.laneserve_cpu.rope_store(
                qkv[i : i + 1], cos[i : i + 1], sin[i : i + 1], *kernel, slots[i : i + 1], 3
            ),
            q[i : i + 1],
        )
    with pytest.raises(RuntimeError, match="past the cache"):
        torch.ops.laneserve_cpu.rope_store(qkv, cos, sin, *kernel, slots + 32, 3)
    with pytest.raises(RuntimeError, match="rope_store"):
        torch.ops.laneserve_cpu.rope_store(qkv, cos, sin, *kernel, slots, 4)
    with pytest.raises(RuntimeError, match="rope_store"):  # caches neither in qkv's dtype nor bfloat16
        torch.ops.laneserve_cpu.rope_store(qkv, cos, sin, *(c.half() for c in kernel), slots, 3)


@pytest.mark.parametrize("dtype, quant", KINDS)
def test_a_residual_is_added_as_torch_adds(dtype, quant):
    lin, _ = layer(dtype, quant, ISAS[-1])
    x, residual = rows(5, 96, dtype), rows(5, 200, dtype, seed=7)
    assert torch.equal(lin(x, residual), residual + lin(x))
    with pytest.raises(RuntimeError, match="residual"):
        lin(x, residual[:, :100].contiguous())


@pytest.mark.parametrize(
    "dtype, quant",
    [
        ("float32", None),
        *(pytest.param(*m, marks=pytest.mark.slow) for m in [("bfloat16", None), ("bfloat16", "int4")]),
    ],
)
def test_fused_block_is_block_forward(dtype, quant):
    # cpu.optimize's FusedBlock gives Block.forward's logits bit for bit over a step of prompt pieces and decodes.
    from engine import LLM, SamplingParams

    llm = LLM(
        model="smollm2-135m",
        dummy_weights=True,
        device="cpu",
        dtype=dtype,
        quantization=quant,
        num_kv_blocks=64,
        max_num_batched_tokens=48,
    )
    layers = llm.runner.model.layers
    assert all(isinstance(layer.forward, cpu.FusedBlock) for layer in layers)
    logits, forward = [], model.Transformer.forward

    def kept(*args):
        logits.append(forward(*args))
        return logits[-1]

    prompts, greedy = (
        ["a longer prompt than the other one, cut in pieces " * 3, "hello"],
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model.Transformer, "forward", kept)
        fused = llm.generate(prompts, greedy)
        fused_logits, logits[:] = list(logits), []
        for layer in layers:
            del layer.forward
        assert [o.token_ids for o in llm.generate(prompts, greedy)] == [o.token_ids for o in fused]
    assert len(logits) == len(fused_logits) > 6 and all(map(torch.equal, logits, fused_logits))


@pytest.mark.slow  # the inner loop keeps a lighter test of its kind
def test_a_build_lock_left_by_a_killed_process_does_not_hang_the_next():
    # torch's lock file, as a process killed inside torch's load leaves it: the next process still loads.
    from torch.utils.cpp_extension import _get_build_directory

    lock = os.path.join(_get_build_directory("laneserve_cpu_matmul", False), "lock")
    open(lock, "w").close()
    out = subprocess.run(
        [sys.executable, "-c", "import cpu_matmul; print(cpu_matmul._load())"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.stdout.strip() == "True", out.stderr[-2000:]
    assert not os.path.exists(lock)
