"""The sampler: the sampled rows' logits in, each sequence's next tokens (and logprobs) out. Every step is a batched
tensor op over all rows, the same code on CPU and GPU, and each row is computed on its own: per-row parameters,
reductions within a row only, and random numbers from the row's own (seed, output position)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from sequence import Sequence
from structured import Masks

HEAD = 64  # a row's likeliest tokens, where top-k, min-p and top-p look first: a fixed count, so a fixed shape
TOP_LOGPROBS = 20  # top logprobs come from one topk of this size for every row (SamplingParams' most), then cut


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the k most likely (token_id, logprob), best first
    rank: int  # 1 + how many tokens are likelier


@dataclass
class Sampled:
    """A sequence's tokens from one step: its next token, then the token after each of its draft tokens (kept by
    the engine while the draft agrees), each row's logprob when asked, and why a row failed (NaN logits)."""

    seq: Sequence
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    errors: list[str | None]
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # of the prompt tokens this step scored


def sample(
    logits: torch.Tensor,
    seqs: list[Sequence],
    scored: list[tuple[Sequence, list[int]]] = (),
    masks: Masks | None = None,
) -> list[Sampled]:
    """logits: each sequence's row, then its draft rows (speculation.py), then the rows of `scored`, each scoring
    a prompt token (prompt_logprobs). A draft row is sampled as if the drafts before it had been emitted: its
    penalties, min_tokens and random number see them. Plain greedy rows take the first maximal index (widening
    bfloat16 first changes no order). masks: the grammars' (structured.masks)."""
    rows = [(s, j) for s in seqs for j in range(len(s.draft) + 1)]
    n, k = len(rows), TOP_LOGPROBS
    x = _process(logits[:n], rows, masks)
    best = x.max(dim=-1)  # NaN anywhere in a row makes its max NaN
    tokens = best.indices
    drawn = [r for r, (s, _) in enumerate(rows) if s.params.temperature]
    if drawn:
        # A row's key: its sequence's seed, and which output token it samples (the drafts before it counted).
        keys = [(s.seed, s.num_tokens - s.num_prompt_tokens + j) for s, j in (rows[r] for r in drawn)]
        some = len(drawn) < len(rows)
        tokens[drawn] = _draw(
            x[drawn] if some else x,
            [rows[r][0].params for r in drawn],
            uniforms(keys, x.device),
            best.values[drawn] if some else best.values,
        )
    # From the model's own distribution, before penalties, bias and temperature, as vLLM's default.
    asked = [r for r, (s, _) in enumerate(rows) if s.params.logprobs is not None]
    targets = [t for _, ids in scored for t in ids]
    parts = [tokens, best.values.isnan()]
    if asked or targets:
        lp = logits[asked + list(range(n, len(logits)))].float().log_softmax(-1)
        chosen = lp.gather(1, torch.cat([tokens[asked], to_device(targets, torch.int64, x.device)]).unsqueeze(1))
        top = lp.topk(k)
        # Per row: its token's logprob and rank, the top ids (exact in float32: below 2**24), the top logprobs.
        rank = (lp > chosen).sum(1, keepdim=True) + 1
        parts.append(torch.cat([chosen, rank, top.indices, top.values], 1).flatten())
    # One transfer: ids (exact in float64), NaN flags, then the asked rows and the scored ones.
    flat = torch.cat([t.double() for t in parts]).tolist()
    ids, width = [int(t) for t in flat[:n]], 2 + 2 * k
    want = [(ids[r], rows[r][0].params.logprobs) for r in asked]
    want += [(t, s.params.prompt_logprobs) for s, targets in scored for t in targets]
    entries = []
    for at, (token, top_k) in zip(range(2 * n, len(flat), width), want):
        row = flat[at : at + width]
        top = list(zip(map(int, row[2 : 2 + k]), row[2 + k :]))
        entries.append(TokenLogprob(token, row[0], top[:top_k], int(row[1])))
    entries = iter(entries)  # the asked rows' in row order, then the scored ones'
    logprobs = [next(entries) if s.params.logprobs is not None else None for s, _ in rows]
    prompt = {s: [next(entries) for _ in targets] for s, targets in scored}
    errors = ["the model's logits are NaN" if nan else None for nan in flat[n : 2 * n]]
    out, end = [], 0
    for s in seqs:
        mine = slice(end, end := end + 1 + len(s.draft))
        out.append(Sampled(s, ids[mine], logprobs[mine], errors[mine], prompt.pop(s, [])))
    return out + [Sampled(s, [], [], [], lps) for s, lps in prompt.items()]


def _process(logits: torch.Tensor, rows: list[tuple[Sequence, int]], masks: Masks | None) -> torch.Tensor:
    """The logits in float32 as each row's request asks: stop tokens banned before min_tokens, logit_bias added,
    then vLLM's repetition penalty, OpenAI's presence and frequency penalties, and the grammar's mask. Each rule
    touches only the (row, token) entries listed for its row, gathered on the host into one flat index per rule."""
    vocab = logits.shape[-1]
    ban, bias, repeat, penalty = [], [], [], []  # flat indices row * vocab + token (with their values)
    for r, (seq, drafted) in enumerate(rows):
        p, base = seq.params, r * vocab
        if seq.num_tokens - seq.num_prompt_tokens + drafted < p.min_tokens:
            ban += [base + t for t in seq.stop_ids]
        bias += [(base + t, b) for t, b in p.logit_bias.items()]
        if p.repetition_penalty == 1 and not (p.presence_penalty or p.frequency_penalty):
            continue  # the rest reads the row's output: copied only when a rule needs it
        out = seq.output_token_ids + seq.draft[:drafted]
        if p.repetition_penalty != 1:
            repeat += [(base + t, p.repetition_penalty) for t in set(seq.token_ids[: seq.num_prompt_tokens] + out)]
        if p.presence_penalty or p.frequency_penalty:
            counts = np.unique(out, return_counts=True) if out else ([], [])
            penalty += [(base + t, p.frequency_penalty * c + p.presence_penalty) for t, c in zip(*counts)]
    if not (ban or bias or repeat or penalty or masks):
        return logits.float()
    x = logits.float().clone()
    flat, dev = x.view(-1), x.device
    if ban:
        flat[to_device(ban, torch.int64, dev)] = float("-inf")
    for pairs, rule in (
        (bias, lambda v, b: v + b),
        (repeat, lambda v, r: torch.where(v > 0, v / r, v * r)),
        (penalty, lambda v, c: v - c),
    ):
        if pairs:
            at, value = zip(*pairs)
            at = to_device(list(at), torch.int64, dev)
            flat[at] = rule(flat[at], to_device(list(value), x.dtype, dev))
    if masks:
        masks.apply(x)
    return x


def _draw(x: torch.Tensor, params: list, u: torch.Tensor, top: torch.Tensor, head: int | None = None) -> torch.Tensor:
    """One token per row from softmax(x / temperature) after top-k (ties with the k-th stay), min-p, then top-p over
    the mass they leave, as vLLM: the inverse CDF at the row's u, over its kept tokens from the likeliest down. The
    rules are looked for among the row's `head` likeliest tokens; a row they do not settle there goes again with 16
    times the head (at last its whole vocabulary), except a row without top-p, which draws in vocabulary order
    instead. On a GPU the whole vocabulary is sorted at once: no row asks the host which way it goes."""
    dev, vocab = x.device, x.shape[-1]
    head = vocab if x.is_cuda else min(head or HEAD, vocab)
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    table = [[p.temperature, p.top_p, p.min_p, min(k, head), k > head] for p, k in zip(params, top_k)]
    temperature, top_p, min_p, k, far = to_device(table, x.dtype, dev).T.unsqueeze(-1)  # a column each
    # A row of NaN draws garbage, never out of bounds (a CUDA assert would end every sequence); sample() flags it.
    # Tokens e^60 times less likely than the row's best (top: x's row maxima; no rule keeps them, no draw reaches
    # them) get exactly 0, so that the softmax makes no subnormal floats: a CPU takes ~100 cycles over each, and a low
    # temperature makes them by the million (benchmarks/README.md).
    z = x / temperature
    probs = z.masked_fill_(z < top[:, None] / temperature - 60, float("-inf")).softmax(-1)
    hp, order = probs.topk(head)  # best first
    kth = hp.gather(1, (k - 1).clamp(min=0).long())
    floor = torch.maximum(kth * (k > 0), min_p * hp[:, :1])
    keep = hp >= floor
    # Kept tokens may reach past the head: their mass is then known only when all are kept (no top-k, no min-p).
    past = keep[:, -1:] & (head < vocab)
    kept = (hp * keep).cumsum(-1)[:, -1:]  # a cumsum's last: a sum in one order, whatever the rows
    q = hp * keep / torch.where(past, 1, kept)
    cum = q.cumsum(-1)
    # Drop a token once the mass before it reaches top_p; the first always stays (a top_p rounding to 0 drops it).
    nucleus = keep & ((cum - q < top_p) | (top_p == 1))
    nucleus[:, 0] = True
    far = far > 0  # a top-k past the head
    whole = (past & (top_p == 1) & ~far)[:, 0]  # every kept token, in vocabulary order
    again = (far | past & (top_p < 1) & ((floor > 0) | (cum[:, -1:] < top_p)))[:, 0]
    cdf = (q * nucleus).double().cumsum(-1)
    tokens = order.gather(1, torch.searchsorted(cdf, u[:, None] * cdf[:, -1:]).clamp(max=head - 1))[:, 0]
    if head < vocab and bool(whole.any()):
        rows = whole.nonzero()[:, 0]
        cdf = (probs[rows] * (probs[rows] >= floor[rows])).double().cumsum(-1)
        tokens[rows] = torch.searchsorted(cdf, u[rows, None] * cdf[:, -1:])[:, 0]
    if head < vocab and bool(again.any()):
        rows = again.nonzero()[:, 0].tolist()
        tokens[rows] = _draw(x[rows], [params[r] for r in rows], u[rows], top[rows], head * 16)  # at last all
    return tokens


MASK32 = 0xFFFFFFFF


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer on int64 tensors holding 32-bit values (a product's low 32 bits are exact)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


def uniforms(keys: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """A number in (0, 1] for each (seed, position), a function of that pair alone: counter-based, hashed for all
    rows at once, so a row's draw never depends on its neighbours, the batch, or the device's kernels."""
    words = to_device([(s & MASK32, s >> 32 & MASK32, p & MASK32) for s, p in keys], torch.int64, device)
    h = _mix32(words[:, 2] ^ _mix32(words[:, 1] ^ _mix32(words[:, 0])))
    hi, lo = _mix32(h ^ 0x68E31DA4), _mix32(h ^ 0xB5297A4D)  # two words of the pair's own stream
    return ((hi >> 6) * 2**27 + (lo >> 5) + 1).double() / 2**53  # 53 bits, as a double holds


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list (or list of equal-length lists) as a tensor on device, through pinned memory so that the copy
    never waits on a GPU; through numpy, which reads nested lists faster than torch.tensor."""
    host = torch.from_numpy(np.array(values)).to(dtype)  # torch.tensor(array, pin_memory=True) refuses numpy
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
