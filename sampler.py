"""The sampler: the sampled rows' logits in, each sequence's next token (and logprobs) out, every row on its own."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sequence import SamplingParams, Sequence

TOP_P_HEAD = 1024  # on CPU, the likeliest tokens _draw sorts first for top-p


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the k most likely (token_id, logprob), best first


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprob | None], list[str | None]]:
    """Next token per sequence: plain greedy rows by one batched max (the first maximal index, as argmax;
    widening bfloat16 first would be exact, so it changes no order); the rest each on its own row in float32,
    drawn from its own generator so that a seeded request draws the same numbers whatever batch it is in. A row
    that fails (NaN logits, say) fails its own sequence alone: the third list says why, per sequence."""
    best = logits.max(dim=-1)  # NaN anywhere in a row makes its max NaN
    tokens = best.indices
    logprobs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # row -> chosen, top ids, top values
    errors: list[str | None] = [None] * len(seqs)
    for i, seq in enumerate(seqs):
        p = seq.params
        processed = bool(
            p.presence_penalty
            or p.frequency_penalty
            or p.repetition_penalty != 1
            or p.logit_bias
            or seq.num_tokens - seq.num_prompt_tokens < p.min_tokens
        )
        if not (p.temperature or p.logprobs is not None or processed):
            continue
        try:
            raw = logits[i].float()
            logit = _process(raw.clone(), seq) if processed else raw
            if p.temperature:
                tokens[i] = _draw(logit / p.temperature, p, seq.generator)
            elif processed:
                tokens[i] = logit.argmax()
            if p.logprobs is not None:
                # From the model's own distribution, before penalties, bias and temperature, as vLLM's default.
                lp = raw.log_softmax(-1)
                top = lp.topk(p.logprobs)
                logprobs[i] = lp.gather(0, tokens[i : i + 1]), top.indices, top.values
        except Exception as e:
            errors[i] = f"sampling failed ({type(e).__name__}: {e})"
            logprobs.pop(i, None)
    # One transfer: token ids (exact in float64), NaN flags and every logprob in one tensor: n ids, n flags,
    # then per sequence with logprobs its token's logprob, its k top ids and their k logprobs.
    n = len(seqs)
    flat = torch.cat(
        [t.double() for t in (tokens, best.values.isnan(), *(t for row in logprobs.values() for t in row))]
    ).tolist()
    ids, at = [int(t) for t in flat[:n]], 2 * n
    out: list[TokenLogprob | None] = [None] * n
    for i in logprobs:
        k = seqs[i].params.logprobs
        top = list(zip(map(int, flat[at + 1 : at + 1 + k]), flat[at + 1 + k : at + 1 + 2 * k]))
        out[i], at = TokenLogprob(ids[i], flat[at], top), at + 1 + 2 * k
    errors = [e or ("the model's logits are NaN" if flat[n + i] else None) for i, e in enumerate(errors)]
    return ids, out, errors


def _process(logit: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """One row of logits (float32, in place) as its request asks: stop tokens banned before min_tokens,
    logit_bias added, then vLLM's repetition penalty and OpenAI's presence and frequency penalties."""
    p, dev, i64 = seq.params, logit.device, torch.int64
    if seq.num_tokens - seq.num_prompt_tokens < p.min_tokens and seq.stop_ids:
        logit[to_device(sorted(seq.stop_ids), i64, dev)] = float("-inf")
    if p.logit_bias:
        logit[to_device(list(p.logit_bias), i64, dev)] += to_device(list(p.logit_bias.values()), logit.dtype, dev)
    if p.repetition_penalty != 1:
        seen = to_device(seq.token_ids, i64, dev).unique()
        x = logit[seen]
        logit[seen] = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
    if p.presence_penalty or p.frequency_penalty:
        out = to_device(seq.output_token_ids, i64, dev)
        counts = torch.zeros_like(logit).index_add_(0, out, torch.ones_like(out, dtype=logit.dtype))
        logit -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return logit


def _draw(row: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """A token drawn from softmax(row) after top-k, min-p and top-p. NaN becomes 0 first: a device
    cannot raise for one row (a CUDA assert would end every sequence), and sample() flags the row."""
    row, ids = row.nan_to_num(), None  # ids: the vocabulary ids of row's entries, when not all of them
    if 0 < p.top_k < len(row):
        # The others get probability 0; ties with the k-th stay, as in vLLM. On CPU draw among these alone
        # (faster); on a GPU mask the others instead: how many tie would have to be read back.
        keep = row >= row.topk(p.top_k).values[-1]
        if row.is_cuda:
            row = row.masked_fill(~keep, float("-inf"))
        else:
            ids = keep.nonzero()[:, 0]
            row = row[ids]
    probs = row.softmax(-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0)
        probs /= probs.sum()  # top_p measures the mass of the tokens min_p leaves, as in vLLM
    if p.top_p < 1:
        # Only the likeliest tokens can make the nucleus. On CPU, where sorting a whole vocabulary is slow,
        # sort just the TOP_P_HEAD likeliest, and all only if they fall short of top_p.
        head, order = probs.topk(probs.numel() if probs.is_cuda else min(TOP_P_HEAD, probs.numel()))
        if len(order) < len(probs) and float(head.sum()) < p.top_p:
            head, order = probs.sort(descending=True)
        # Drop a token once the mass before it already reaches top_p; the first always stays (a top_p
        # that rounds to 0 in float32 would drop it too).
        drop = head.cumsum(-1) - head >= p.top_p
        drop[0].fill_(False)  # not `= False`, which copies from the host and waits on a GPU
        probs, ids = head.masked_fill(drop, 0), order if ids is None else ids[order]
    # Inverse CDF, one uniform u in (0, 1] per draw (torch.multinomial draws one per vocabulary entry): the
    # first token whose cumulative mass reaches u * total, never one of mass 0 (it adds nothing to the sum).
    cdf = probs.double().cumsum(0)
    u = 1 - torch.rand((), dtype=torch.float64, device=row.device, generator=generator)
    token = torch.searchsorted(cdf, u * cdf[-1])
    return token if ids is None else ids.gather(0, token.view(1))[0]  # ids[token] would read token back


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list (or list of equal-length lists) as a tensor on device, through pinned memory so that the copy
    never waits on a GPU; through numpy, which reads nested lists faster than torch.tensor."""
    host = torch.from_numpy(np.array(values)).to(dtype)  # torch.tensor(array, pin_memory=True) refuses numpy
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
