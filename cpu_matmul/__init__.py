"""Batch-invariant CPU kernels: attention token by token (attention.cpp, the op token_attention, which
cpu.BucketedAttention calls for generated tokens and short prompts' tokens) and the matmul, y = x Wᵀ by matmul.cpp,
each row's result the same bits whatever else the batch holds and however many threads run it, so that cpu.py needs
no row tiles where it is used: one row is a matrix-vector product streaming the weights once. float32 and bfloat16
weights, the int4 groups of --quantization int4 (GGUF's Q4_1: w = q * scale + min), and int8 groups for its LM head
(GGUF's Q8_0: w = q * scale). Beside them the row-wise ops (rows.cpp: rms_norm, rope_store) and a Llama layer's
decode halves composed from all these in C++ (layer.cpp: attend, mlp; cpu.FusedBlock calls them). Built with
torch.utils.cpp_extension on first use, as attention_cuda is; where it does not build, or the CPU has none of its
instruction sets, isa() is None and cpu.py keeps its tiles. LANESERVE_CPU_MATMUL chooses: off (the tiles), avx2,
avx2_vnni, avx512, avx512_vnni or avx512_bf16; unset, the best this CPU has."""

from __future__ import annotations

import contextlib
import fcntl
import os
import warnings

import torch
import torch.nn.functional as F
from torch import nn

# matmul.cpp's Isa, from the least to the most capable: isa() takes the last this CPU has.
ISAS = {"avx2": 1, "avx2_vnni": 5, "avx512": 2, "avx512_vnni": 4, "avx512_bf16": 3}
KINDS = {torch.float32: 0, torch.bfloat16: 1}  # matmul.cpp's Kind, with INT4 and INT8
INT4, INT8 = 2, 3
COLUMNS = 64  # outputs padded to a multiple of this: a register tile's width
BLOCK = 16  # output columns per packed block
_built: bool | None = None


def _load() -> bool:
    """Build (once per source and flags; ninja, into torch's extension cache) and load the kernel."""
    global _built
    if _built is None:
        try:
            from torch.utils.cpp_extension import _get_build_directory, load

            name, here = "laneserve_cpu_matmul", os.path.dirname(os.path.abspath(__file__))
            build = _get_build_directory(name, False)
            # torch's build lock is a file that every load holds while ninja runs, and a process killed holding it
            # leaves it behind: every later load would wait on it forever. Ours, an flock, ends with its process;
            # under it no other load of ours is inside torch's, so a lock file found is such a leftover.
            with open(os.path.join(build, "flock"), "w") as ours:
                fcntl.flock(ours, fcntl.LOCK_EX)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(build, "lock"))
                sources = ("matmul.cpp", "attention.cpp", "rows.cpp", "layer.cpp")
                load(
                    name,
                    [os.path.join(here, f) for f in sources],
                    extra_cflags=["-O3", "-ffp-contract=off", "-fopenmp"],
                    extra_ldflags=["-fopenmp"],
                    is_python_module=False,
                )  # -fopenmp: else at::parallel_for runs on one thread
            _built = True
        except Exception as e:  # no compiler, no ninja, ...: the tiles serve
            warnings.warn(
                f"cpu_matmul: could not build the CPU matmul kernel, using row tiles ({type(e).__name__}: {e})",
                stacklevel=2,
            )
            _built = False
    return _built


def supported(name: str) -> bool:
    return _load() and torch.ops.laneserve_cpu.supported(ISAS[name])


def isa() -> int | None:
    """The instruction set the kernel runs with (an ISAS value), or None: cpu.py's tiles."""
    choice = os.environ.get("LANESERVE_CPU_MATMUL", "")
    if choice == "off":
        return None
    if choice:
        if choice not in ISAS or not supported(choice):
            raise ValueError(
                f"LANESERVE_CPU_MATMUL={choice}: this CPU runs {[n for n in ISAS if supported(n)] + ['off']}"
            )
        return ISAS[choice]
    return next((ISAS[n] for n in reversed(ISAS) if supported(n)), None)


def int4_groups(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A [n, k] weight as 4-bit codes q ([n, k] int32, 0..15), and per `group` inputs a scale and a min ([n, k /
    group] float32), w ≈ q * scale + min. Round-to-nearest, asymmetric, as GGUF's Q4_1: each group's min and max
    become q = 0 and 15, so a Q4_1 checkpoint's dequantized weights give back its codes, scales and mins."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4 quantization needs matmul input sizes divisible by {group}, got {k}")
    g = w.float().view(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-10)  # clamped: a constant group must not divide by 0
    q = ((g - lo[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.int32).view(n, k)
    return q, scale, lo


def int4_zeros(scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The kernel's int4 form, w = (q - 8) * scale + zero (q - 8 centred, so that x's 8-bit rounding weighs less)."""
    return lo.float() + 8 * scale.float()


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """int4_groups' weight in float64, as the kernel multiplies by it: the reference's."""
    n, k = q.shape
    zero = int4_zeros(scale, lo).double()[..., None]
    return ((q.double().view(n, scale.shape[1], -1) - 8) * scale.double()[..., None] + zero).view(n, k)


def int8_groups(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A [n, k] weight as 8-bit codes q ([n, k] int8, -127..127) and per `group` inputs a scale ([n, k / group]
    float32), w ≈ q * scale. Round-to-nearest, symmetric, as GGUF's Q8_0: a Q8_0 checkpoint's dequantized weights
    (in float32) give back its codes and scales."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"int8 quantization needs matmul input sizes divisible by {group}, got {k}")
    g = w.float().view(n, k // group, group)
    scale = g.abs().amax(-1) / 127
    q = (g / scale.clamp_min(1e-30)[..., None]).round_().clamp_(-127, 127).to(torch.int8).view(n, k)
    return q, scale


def pack(w: torch.Tensor) -> torch.Tensor:
    """A float32 or bfloat16 [n, k] weight in matmul.cpp's layout: [n / 16, k, 16], bfloat16 [n / 16, k / 2, 16, 2]."""
    n, k = w.shape
    w = F.pad(w, (0, 0, 0, -n % COLUMNS))
    if w.dtype == torch.float32:
        return w.view(-1, BLOCK, k).transpose(1, 2).contiguous()
    return w.view(-1, BLOCK, k // 2, 2).transpose(1, 2).contiguous()


def pack_int4(q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """int4_groups' codes, scales and mins (groups of 32) as [n / 16, k / 32, 384] bytes: per block of 16 columns
    and group, the 16 scales, the 16 zeros (float32, int4_zeros), then per quad p < 4 the 16 columns' 4 bytes,
    byte i holding the codes of k = 4p + i (low nibble) and 16 + 4p + i (high)."""
    n, k = q.shape
    q, scale, lo = (F.pad(t, (0, 0, 0, -n % COLUMNS)) for t in (q, scale.float(), lo.float()))
    blocks, groups = q.shape[0] // BLOCK, k // 32
    codes = q.to(torch.uint8).view(blocks, BLOCK, groups, 2, 4, 4)  # [block, column, group, half, quad, k in quad]
    codes = (codes[:, :, :, 0] | codes[:, :, :, 1] << 4).permute(0, 2, 3, 1, 4).reshape(blocks, groups, 256)

    def per_group(t: torch.Tensor) -> torch.Tensor:  # [n, groups] float32 as [blocks, groups, 64] bytes
        return t.view(blocks, BLOCK, groups).transpose(1, 2).contiguous().view(torch.uint8)

    return torch.cat((per_group(scale), per_group(int4_zeros(scale, lo)), codes), -1).contiguous()


def pack_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8_groups' codes and scales (groups of 32) as [n / 16, k / 32, 576] bytes: per block of 16 columns and
    group, the 16 scales (float32), then per k quad j < 8 the 16 columns' codes of k = 4j to 4j + 3, each stored as
    q + 128 (unsigned, as vpdpbusd takes one side)."""
    n, k = q.shape
    q, scale = F.pad(q, (0, 0, 0, -n % COLUMNS)), F.pad(scale.float(), (0, 0, 0, -n % COLUMNS))
    blocks, groups = q.shape[0] // BLOCK, k // 32
    codes = (q.to(torch.int16) + 128).to(torch.uint8).view(blocks, BLOCK, groups, 8, 4).permute(0, 2, 3, 1, 4)
    scales = scale.view(blocks, BLOCK, groups).transpose(1, 2).contiguous().view(torch.uint8)
    return torch.cat((scales, codes.reshape(blocks, groups, 512)), -1).contiguous()


class Linear(nn.Module):
    """A bias-free linear layer by the kernel, its weight packed once. quant "int4" or "int8": the weight quantized
    in groups of 32 (int4_groups, int8_groups), computed against activations in float32. isa: an ISAS value the
    CPU supports."""

    def __init__(self, weight: torch.Tensor, isa: int, quant: str | None = None):
        super().__init__()
        if weight.dtype not in KINDS:
            raise ValueError(f"cpu_matmul.Linear: float32 or bfloat16 weights, got {weight.dtype}")
        if not any(v == isa and supported(n) for n, v in ISAS.items()):
            raise ValueError(f"cpu_matmul.Linear: instruction set {isa} unavailable here")
        self.n, self.k, self.isa = weight.shape[0], weight.shape[1], isa
        self.kind = {"int4": INT4, "int8": INT8}[quant] if quant else KINDS[weight.dtype]
        w = weight.detach()
        packed = (
            pack_int4(*int4_groups(w, 32))
            if quant == "int4"
            else pack_int8(*int8_groups(w, 32))
            if quant == "int8"
            else pack(w)
        )
        # A plain attribute, not a buffer, and no hooks (__call__ is forward): a one-stream step makes 121 of these
        # calls, and nn.Module's lookups would weigh on each.
        self.packed, self.op = packed, torch.ops.laneserve_cpu.linear.default

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T, plus residual (x's shape but n features, in x's dtype) if given, rounded as torch's add."""
        if x.shape[-1] != self.k:
            raise ValueError(f"cpu_matmul.Linear: input of {x.shape[-1]} features does not fit {self.k}")
        if x.dim() == 2:  # the model's case: no reshaping (this runs 4 times a layer in every step)
            return self.op(x.contiguous(), self.packed, self.kind, self.n, self.isa, residual)
        if residual is not None:
            residual = residual.reshape(-1, self.n).contiguous()
        return self.op(x.reshape(-1, self.k).contiguous(), self.packed, self.kind, self.n, self.isa, residual).view(
            *x.shape[:-1], self.n
        )

    __call__ = forward


class RMSNorm(nn.Module):
    """nn.RMSNorm's result, rounded where Hugging Face's rounds, by rows.cpp: one op, each row on its own."""

    def __init__(self, norm: nn.RMSNorm):
        super().__init__()
        self.weight, self.eps = norm.weight.detach(), norm.eps  # plain tensors and no hooks, as Linear
        self.op = torch.ops.laneserve_cpu.rms_norm.default

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x.contiguous(), self.weight, self.eps)

    __call__ = forward
