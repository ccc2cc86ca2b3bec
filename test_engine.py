"""The core engine against Hugging Face transformers on the same GGUF, plus the rules that keep sequences apart:
independence, the continuous-batching trace, and KV blocks returned after every generation."""

import random

import pytest
import torch

import cpu
import cpu_matmul
import weights
from config import EngineConfig
from conftest import traced
from cpu import Int4Linear, quantize_int4
from engine import LLM, SamplingParams
from runner import StepBatch
from sequence import Sequence
from server import openai_api

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three primary colors."},
    ],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "user", "content": "What is 12 times 7?"},
        {"role": "assistant", "content": "84."},
        {"role": "user", "content": "And divided by 4?"},
    ],
    [{"role": "user", "content": "Translate 'good morning' into Spanish and German."}],
    [
        {
            "role": "user",
            "content": "Explain in one paragraph why the sky is blue, mentioning "
            "Rayleigh scattering, wavelengths and the atmosphere.",
        }
    ],
    [{"role": "user", "content": "List the planets of the solar system in order from the sun."}],
]
GREEDY = SamplingParams(temperature=0, max_tokens=32)


@pytest.fixture(scope="module")
def hf(hf_tokenizer, hf_model):
    return hf_tokenizer, hf_model


@pytest.fixture(scope="module")
def llm():
    # A budget of 32 tokens forces every one of these chat prompts through chunked prefill. Sixteen
    # sequences at most: matmuls then run in 16-row tiles (cpu.row_tile), not 64, for these few prompts.
    return LLM(max_num_batched_tokens=32, num_kv_blocks=256, max_num_seqs=16, dtype="float32", device="cpu")


@pytest.fixture(autouse=True)
def blocks_returned(request):
    yield
    if "llm" in request.fixturenames:
        engine = request.getfixturevalue("llm")
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        assert not any(engine.block_manager.ref_counts)
        assert not engine.has_unfinished()


def assert_hf_greedy(hf, ids: list[int], ours: list[int], n: int) -> None:
    """ours is transformers' greedy continuation of ids, at most n tokens ending at its EOS: each token is
    the argmax of its logits given the prompt and the tokens before it. One forward over the whole text
    checks every position at once, where generate() would take n forwards."""
    tok, model = hf
    with torch.no_grad():
        logits = model(torch.tensor([ids + ours])).logits[0, len(ids) - 1 : -1]
    assert logits.argmax(-1).tolist() == ours, (tok.decode(ours), tok.decode(logits.argmax(-1).tolist()))
    assert tok.eos_token_id not in ours[:-1] and (len(ours) == n or ours[-1] == tok.eos_token_id)


def test_paris(llm):
    out = llm.chat([[{"role": "user", "content": "What is the capital of France?"}]], GREEDY)[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"


@pytest.mark.slow
def test_greedy_parity_batched_with_chunked_prefill(llm, hf):
    prompts = [llm.tokenizer.apply_chat_template(c) for c in CHATS]
    assert max(map(len, prompts)) > llm.config.max_num_batched_tokens
    outs = llm.generate(prompts, GREEDY)
    for ids, out in zip(prompts, outs):
        assert_hf_greedy(hf, ids, out.token_ids, 32)


def test_last_position_logits(llm, hf):
    # One whole prompt through the runner's own batch building and our model, against transformers.
    for chat in CHATS[:3]:
        seq = Sequence("logits", llm.tokenizer.apply_chat_template(chat), SamplingParams())
        ids = seq.token_ids
        llm.block_manager.allocate(seq.block_table, len(ids))
        try:
            batch, *_ = StepBatch.build([(seq, len(ids))], llm.config.block_size)
            tokens, positions, meta = batch.to_device(llm.runner.device)
            ours = llm.runner.model(tokens, positions, meta, llm.runner.kv_cache.layers)[0]
        finally:
            llm.block_manager.free(seq.block_table)
        with torch.no_grad():
            ref = hf[1](torch.tensor([ids])).logits[0, -1]
        assert (ours - ref).abs().max().item() < 1e-3


def test_seeded_sampling_independent_of_batch(llm):
    prompt = llm.tokenizer.apply_chat_template(CHATS[6])
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=24)
    alone = llm.generate([prompt], seeded)[0]
    others = [llm.tokenizer.apply_chat_template(c) for c in CHATS[:4]]
    batch = llm.generate(others + [prompt], [SamplingParams(temperature=1.0, max_tokens=30)] * 4 + [seeded])
    assert batch[-1].text == alone.text
    assert llm.generate([prompt], SamplingParams(temperature=0.8, seed=99, max_tokens=24))[0].text != alone.text


def test_step_trace():
    engine = LLM(num_kv_blocks=16, dtype="float32", device="cpu")
    steps = traced(engine)
    ignore = dict(temperature=0, ignore_eos=True)
    engine.add_request([10, 11, 12, 13], SamplingParams(max_tokens=3, **ignore), "A")
    engine.add_request([20, 21, 22, 23, 24, 25], SamplingParams(max_tokens=5, **ignore), "B")
    engine.add_request([30, 31], SamplingParams(max_tokens=2, **ignore), "C")
    while engine.has_unfinished():
        engine.step()
    table = [{seq.request_id: (seq.num_generated, seq.kv_tokens, seq.finished) for seq in step} for step in steps]
    assert table == [
        {"A": (1, 5, False), "B": (1, 7, False), "C": (1, 3, False)},
        {"A": (2, 6, False), "B": (2, 8, False), "C": (2, 4, True)},
        {"A": (3, 7, True), "B": (3, 9, False)},
        {"B": (4, 10, False)},
        {"B": (5, 11, True)},
    ]
    assert engine.block_manager.num_free_blocks == 16


@pytest.mark.slow  # the inner loop keeps a lighter test of its kind
def test_long_prompt_chunked_while_others_decode(llm):
    short = llm.add_request(
        llm.tokenizer.apply_chat_template(CHATS[3]), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    )
    llm.step()  # the short request is decoding before the long one arrives
    long_prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Summarise: " + "the cat sat on the mat. " * 40}]
    )
    assert len(long_prompt) > 3 * llm.config.max_num_batched_tokens
    long = llm.add_request(long_prompt, SamplingParams(temperature=0, max_tokens=4))
    steps_until_long_first_token = 0
    short_tokens_meanwhile = 0
    while True:
        outs = {o.request_id: o for o in llm.step()}
        steps_until_long_first_token += 1
        short_tokens_meanwhile += short in outs
        if long in outs:
            break
    assert steps_until_long_first_token >= 3
    assert short_tokens_meanwhile == steps_until_long_first_token  # the short sequence never stalled
    while llm.has_unfinished():
        llm.step()


def test_abort_frees_blocks(llm):
    rid = llm.add_request("Tell me a long story.", SamplingParams(max_tokens=100, ignore_eos=True))
    llm.step()
    llm.step()
    assert llm.block_manager.num_free_blocks < llm.block_manager.num_blocks
    llm.abort(rid)
    assert not llm.has_unfinished()


def test_bad_requests(llm):
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.add_request([1, 2, 3], SamplingParams(max_tokens=10**6))
    with pytest.raises(ValueError, match="empty"):
        llm.add_request([], SamplingParams())


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_tokens=2.5),
        dict(top_k=2.5),
        dict(logprobs=2.5),
        dict(seed=1.5),
        dict(seed=2**70),
        dict(seed="a"),
        dict(stop=[1]),
        dict(stop_token_ids=5),
        dict(logit_bias=[1, 2]),
        dict(logit_bias={5: "x"}),
        dict(temperature=None),
        dict(max_tokens="5"),
        dict(temperature=True),
        dict(ignore_eos="yes"),
        dict(skip_special_tokens=0),
        dict(logit_bias={"\u0663": 1}),
        dict(repetition_penalty=float("inf")),
    ],
)
def test_sampling_params_of_the_wrong_type_name_their_field(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_the_python_api_refuses_bad_input_whole(tiny):
    for kwargs in (
        dict(max_num_seqs=2.5),
        dict(block_size=16.0),
        dict(num_kv_blocks=2.5),
        dict(torch_threads=10**5),
        dict(kv_cache_memory=float("inf")),
        dict(max_model_len=2.5),
    ):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            LLM(model=tiny, dummy_weights=True, **kwargs)
    with pytest.raises(ValueError, match="--dummy-weights needs a preset name, one of .*tiny.*: not 'nosuch'"):
        LLM(model="nosuch", dummy_weights=True)
    llm = LLM(EngineConfig(model=tiny, dummy_weights=True, num_kv_blocks=64), max_num_seqs=3)  # kwargs win
    assert llm.config.max_num_seqs == 3 and llm.config.num_kv_blocks == 64
    assert LLM(tiny, dummy_weights=True, num_kv_blocks=8).config.model == tiny  # vLLM's LLM("model")
    greedy = SamplingParams(max_tokens=2, temperature=0)
    for prompts, match in (
        (b"hello", "prompts"),
        (None, "prompts"),
        (torch.tensor([1, 2]), "prompts"),
        ([[1.5, 5]], "token ids"),
        ([[True, 5]], r"token ids \(Python ints\), got \[True, 5\]"),
    ):
        with pytest.raises(ValueError, match=match):
            llm.generate(prompts, greedy)
    with pytest.raises(ValueError, match="3 prompts but 1 sampling params"):
        llm.generate(["a", "b", "c"], [greedy])
    with pytest.raises(ValueError, match="empty"):  # the first prompt was fine: it must not stay queued
        llm.generate(["a fine prompt", ""], greedy)
    assert not llm.has_unfinished() and not llm.requests
    for conversation in (
        ["hi"],
        "hello",
        [{"role": "user", "content": 5}],
        [{"role": "user"}],
        [[]],
        {"role": "user", "content": "hi"},
        None,
        5,
    ):
        with pytest.raises(ValueError, match="conversation"):
            llm.chat(conversation, greedy)
    for params in ({"max_tokens": 2}, [{"max_tokens": 2}], {}):
        with pytest.raises(TypeError, match="SamplingParams"):
            llm.generate("a", params)
    for rid in ("", 123):
        with pytest.raises(ValueError, match="request_id"):
            llm.add_request("a", greedy, rid)
    assert not llm.has_unfinished() and not llm.requests
    # generate() steps until its own requests finish: it would take the outputs of one added before.
    llm.add_request("early", greedy, "early")
    with pytest.raises(ValueError, match="add_request"):
        llm.generate(["a", "b"], greedy)
    assert list(llm.requests) == ["early"]
    llm.abort("early")

    def interrupted():
        raise KeyboardInterrupt

    llm.step = interrupted  # Ctrl-C during generate(): its requests must not stay queued
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["a", "b"], greedy)
    del llm.step
    assert not llm.has_unfinished() and not llm.requests
    # A template that refuses a conversation (raise_exception) is a ValueError, as a malformed one is.
    strict = llm.tokenizer.with_chat_template("{{ raise_exception('no system role here') }}")
    with pytest.raises(ValueError, match="no system role here"):
        strict.apply_chat_template([{"role": "system", "content": "hi"}])


@pytest.mark.slow  # the inner loop keeps a lighter test of its kind
def test_int4_gives_back_the_checkpoints_own_q4_blocks():
    # The default GGUF keeps every layer matmul in Q4_1: requantizing its dequantized weights must
    # recover them exactly (read back through the 4-bit matmul with the identity as input).
    _, state = weights.load_weights(weights.resolve_checkpoint(), torch.float32)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.29.mlp.down_proj.weight"):
        w = state[name]
        assert torch.equal(Int4Linear(w)(torch.eye(w.shape[1])).T, w)
    # Any other weight lands within half a step of its group's 16 levels.
    w = torch.randn(64, 96)
    step = (w.view(64, 3, 32).amax(-1) - w.view(64, 3, 32).amin(-1)) / 15
    err = (Int4Linear(w)(torch.eye(96)).T - w).abs().view(64, 3, 32)
    assert (err <= step[..., None] / 2 + 1e-6).all()
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_int4(torch.randn(8, 48))
    # Its LM head (the tied embedding) is Q8_0, which the kernel's int8 groups give back exactly.
    w = state["model.embed_tokens.weight"]
    q, scale = cpu_matmul.int8_groups(w, 32)
    assert torch.equal((q.float().view(w.shape[0], -1, 32) * scale[..., None]).view(w.shape), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int4_rows_do_not_depend_on_the_batch(dtype):
    # The 4-bit kernel computes a row the same way whatever rows run beside it (in float32 the engine's
    # other parts are covered by test_lanes_independent, and this kernel is slow on CPUs without AVX-512).
    g = torch.Generator().manual_seed(0)
    linear = Int4Linear(torch.randn(96, 1536, generator=g).to(dtype))
    x = torch.randn(40, 1536, generator=g).to(dtype)
    full = linear(x)
    for start, stop in [(0, 1), (5, 6), (0, 2), (3, 10), (0, 17), (7, 40), (0, 33)]:
        assert torch.equal(linear(x[start:stop]), full[start:stop]), (start, stop)


def test_int4_is_the_same_model(smollm2_4_layers):
    # In float32 the 4-bit weights are the checkpoint's own; the activations go to 8-bit codes per group of 32, as
    # llama.cpp's Q8_1: logprobs move about as much as bfloat16 activations move them (on the first 4 layers).
    dense, q4, bf16 = (
        LLM(model_path=smollm2_4_layers, quantization=q, num_kv_blocks=256, dtype=d, device="cpu")
        for q, d in ((None, "float32"), ("int4", "float32"), (None, "bfloat16"))
    )
    prompt = q4.tokenizer.apply_chat_template(CHATS[0])
    top5 = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    logits = [dict(engine.generate([prompt], top5)[0].logprob.top) for engine in (dense, q4, bf16)]
    assert list(logits[0]) == list(logits[1])
    moved = [max(abs(lp[t] - logits[0][t]) for t in logits[0]) for lp in logits[1:]]
    assert 0 < moved[0] < 0.15 and moved[0] < 3 * moved[1], moved  # here 0.099 and 0.078
    with pytest.raises(ValueError, match="CPU only"):
        LLM(quantization="int4", device="cuda")


def test_one_failing_sequence_fails_alone(tiny, monkeypatch):
    """NaN logits (greedy and sampled) and a detokenizer that raises each end their own request with an
    error; the requests beside them produce the tokens and logprobs of a run without them, bit for bit."""
    import runner

    llm = LLM(model=tiny, dummy_weights=True, device="cpu", dtype="float32", num_kv_blocks=64)
    good = {
        f"ok{i}": (
            [7 + i, 50, 9 * i + 1],
            SamplingParams(temperature=i % 2, seed=i, max_tokens=8, ignore_eos=True, logprobs=2),
        )
        for i in range(6)
    }
    bad = {
        "nan-greedy": ([5, 6], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)),
        "nan-sampled": ([5, 6], SamplingParams(temperature=1, max_tokens=8, ignore_eos=True, top_p=0.5)),
        "detok": ([5, 6], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)),
    }

    def run(requests: dict) -> dict:
        for rid, (ids, params) in requests.items():
            llm.add_request(ids, params, rid)
        if "detok" in requests:

            def broken(token_id: int, stops_armed: bool = True) -> str:
                raise UnicodeError("injected")

            llm.requests["detok"].detokenizer.feed = broken
        got: dict = {}
        while llm.has_unfinished():
            for o in llm.step():
                got.setdefault(o.request_id, []).append((o.token_ids[-1:], o.logprob, o.finish_reason, o.error))
        return got

    expected = run(good)

    sample = runner.sample

    def poisoned(logits: torch.Tensor, seqs: list[Sequence], *rest):
        for i, seq in enumerate(seqs):
            if seq.request_id.startswith("nan") and len(seq.output_token_ids) == 2:
                logits[i] = float("nan")
        return sample(logits, seqs, *rest)

    monkeypatch.setattr(runner, "sample", poisoned)
    got = run({**good, **bad})
    assert {rid: got[rid] for rid in good} == expected
    for rid, steps in [("nan-greedy", 3), ("nan-sampled", 3), ("detok", 1)]:
        assert len(got[rid]) == steps and got[rid][-1][2] == "error"
        assert ("NaN" if rid.startswith("nan") else "injected") in got[rid][-1][3]
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_min_tokens_logit_bias_and_special_tokens(tiny):
    llm = LLM(model=tiny, dummy_weights=True, device="cpu", dtype="float32", num_kv_blocks=64)
    start, eos = llm.tokenizer.special["<|im_start|>"], llm.tokenizer.eos_id
    forced = SamplingParams(temperature=0, max_tokens=3, logit_bias={start: 100})
    assert llm.generate([[1, 2, 3]], forced)[0].token_ids == [start] * 3
    out = llm.generate(
        [[1, 2, 3]] * 2,
        [forced, SamplingParams(temperature=0, max_tokens=3, logit_bias={start: 100}, skip_special_tokens=False)],
    )
    assert out[0].text == "" and out[1].text == "<|im_start|>" * 3
    # Logprobs are the model's own, as vLLM's default: the bias changes the token, not the distribution.
    plain, biased = llm.generate(
        [[1, 2, 3]] * 2,
        [
            SamplingParams(temperature=0, max_tokens=1, logprobs=3),
            SamplingParams(temperature=0, max_tokens=1, logprobs=3, logit_bias={start: 100}),
        ],
    )
    assert biased.token_ids == [start] and biased.logprob.top == plain.logprob.top
    # An ignored EOS is text like any special token, as in vLLM: dropped unless skip_special_tokens is off.
    eos_forced = dict(temperature=0, max_tokens=2, logit_bias={eos: 100}, ignore_eos=True)
    out = llm.generate(
        [[1, 2, 3]] * 2, [SamplingParams(**eos_forced), SamplingParams(**eos_forced, skip_special_tokens=False)]
    )
    assert [(o.text, o.finish_reason) for o in out] == [("", "length"), ("<|endoftext|>" * 2, "length")]
    # EOS made the likeliest token: banned for the first 3 tokens, then it ends the request.
    out = llm.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=10, min_tokens=3, logit_bias={eos: 100}))[0]
    assert len(out.token_ids) == 4 and eos not in out.token_ids[:3] and out.finish_reason == "stop"
    assert out.stop_reason is None  # EOS, as vLLM: a stop token or string the request named is its stop_reason
    out = llm.generate(
        [1, 2, 3],
        SamplingParams(
            temperature=0.8, max_tokens=10, min_tokens=5, seed=1, stop_token_ids=[start], logit_bias={start: 100}
        ),
    )[0]
    assert out.token_ids[5] == start and start not in out.token_ids[:5] and out.finish_reason == "stop"
    assert out.stop_reason == start
    with pytest.raises(ValueError, match="logit_bias"):
        llm.add_request([1], SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)


def test_a_top_p_below_float32_keeps_the_likeliest_token(tiny):
    llm = LLM(model=tiny, dummy_weights=True, device="cpu", dtype="float32", num_kv_blocks=16)
    greedy, tiny_p = (
        llm.generate([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True, **k))[0]
        for k in (dict(temperature=0), dict(temperature=1, top_p=1.7e-289, seed=1))
    )
    assert tiny_p.finish_reason == "length" and tiny_p.token_ids == greedy.token_ids


def test_repetition_penalty_is_vllms():
    """A seen token's logit divided by the penalty when positive, multiplied when not; others untouched."""
    from sampler import _process

    seq = Sequence("r", [0, 1], SamplingParams(repetition_penalty=2.0))
    seq.token_ids.append(3)
    got = _process(torch.tensor([[2.0, -1.0, 3.0, 0.5]]), [(seq, 0)], None)
    assert got.tolist() == [[1.0, -2.0, 3.0, 0.25]]


@pytest.mark.slow  # the inner loop keeps a lighter test of its kind
def test_a_preset_samples_as_its_model_card_says(llm):
    """A preset found by its name, with no generation_config.json (a GGUF), samples the requests that leave the
    fields out as its model card does (SmolLM2: temperature 0.2, top_p 0.9), not at OpenAI's temperature 1."""
    assert llm.sampling_defaults == {"temperature": 0.2, "top_p": 0.9}
    question = [{"role": "user", "content": "What is the capital of France?"}]
    seed = random.Random(7).getrandbits(63)  # what a request without one draws first from Random(7)
    [card] = llm.chat([question], SamplingParams(temperature=0.2, top_p=0.9, seed=seed))
    [openai] = llm.chat([question], SamplingParams(temperature=1.0, top_p=1.0, seed=seed))
    llm.rng = random.Random(7)
    [default] = llm.chat([question])
    assert default.token_ids == card.token_ids != openai.token_ids, (card.text, openai.text)
    path = weights.resolve_checkpoint()
    assert LLM(model_path=path, device="cpu", num_kv_blocks=16).sampling_defaults == {}  # not known as the preset
    assert LLM(device="cpu", num_kv_blocks=16, generation_config="vllm").sampling_defaults == {}


def test_generation_config_sets_the_defaults_of_requests(tmp_path, hf_tokenizer):
    """A Hugging Face directory's generation_config.json gives the sampling values a request leaves out, as in
    vLLM: here greedy, which random weights' near-flat logits would otherwise almost never give."""
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=49152,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    ).save_pretrained(tmp_path)
    hf_tokenizer.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "top_p": 0.9, "top_k": 50, "max_length": 9, "max_new_tokens": 5})
    )
    llm = LLM(model_path=str(tmp_path), device="cpu", num_kv_blocks=16)
    # top_k 50 is transformers' default; max_new_tokens becomes max_tokens
    assert llm.sampling_defaults == {"temperature": 0.0, "top_p": 0.9, "max_tokens": 5}
    greedy = SamplingParams(temperature=0, max_tokens=5)
    assert llm.generate([1, 2, 3])[0].token_ids == llm.generate([1, 2, 3], greedy)[0].token_ids
    params = openai_api.sampling_params({"top_p": 0.5}, False, 3, llm, 0)
    assert (params.temperature, params.top_p, params.max_tokens) == (0.0, 0.5, 5)
    # The server caps what a request asks for at max_new_tokens, as vLLM; below it, the request's own.
    assert [openai_api.sampling_params({"max_tokens": n}, False, 3, llm, 0).max_tokens for n in (2, 9)] == [2, 5]
    assert openai_api.sampling_params({}, True, 3, llm, 0).max_tokens == 5
    assert (
        LLM(model_path=str(tmp_path), device="cpu", num_kv_blocks=16, generation_config="vllm").sampling_defaults == {}
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 3.0}))
    with pytest.raises(ValueError, match="generation_config.json: temperature must be in"):
        weights.sampling_defaults(str(tmp_path))


@pytest.mark.slow  # the inner loop keeps a lighter test of its kind
def test_float16_on_cpu_takes_the_torch_forms():
    # The CPU kernels take float32 and bfloat16; a float16 engine runs the torch forms (it failed in
    # token_attention), a request's tokens the same alone and beside another.
    llm = LLM(model="smollm2-135m", dummy_weights=True, device="cpu", dtype="float16", num_kv_blocks=64)
    assert not llm.runner.model.attention.kernel
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    alone = llm.generate(["hello there"], greedy)[0].token_ids
    assert llm.generate(["hello there", "a longer prompt than the first one"], greedy)[0].token_ids == alone


def test_a_q4_1_gguf_is_served_in_its_own_blocks_where_the_kernels_run(monkeypatch):
    # As llama.cpp serves the file: the GGUF's 4-bit stream (int4 gives back its codes) by 8-bit codes of float32
    # activations, on any CPU the kernels run on, bf16 dot products or not. float32 throughout, transformers'
    # numbers, by --dtype float32; without the kernels, the dtype's weights (bfloat16 where the CPU computes it).
    path = weights.resolve_checkpoint()
    monkeypatch.setattr(cpu, "has_bf16_units", lambda: False)
    assert cpu.own_format(path) == "int4" and cpu.own_format(None) is None
    default, asked = LLM(device="cpu", num_kv_blocks=64), LLM(device="cpu", num_kv_blocks=64, quantization="int4")
    assert (default.quantization, default.dtype) == ("int4", torch.float32)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    assert [(o.token_ids, o.logprob) for o in default.generate(["The capital of France is"], params)] == [
        (o.token_ids, o.logprob) for o in asked.generate(["The capital of France is"], params)
    ]
    assert LLM(device="cpu", num_kv_blocks=64, dtype="float32").quantization is None
    assert "Q4_1 GGUF's own blocks" in cpu.choices(torch.float32, "int4")
    monkeypatch.setattr(cpu, "has_bf16_units", lambda: True)
    assert cpu.own_format(path) == "int4" and "bfloat16: this CPU has bf16" in cpu.choices(torch.bfloat16, None)
    assert "float16: as --dtype asks;" in cpu.choices(torch.float16, None, asked=True)
    assert (LLM(device="cpu", num_kv_blocks=64).dtype, asked.dtype) == (torch.float32, torch.float32)
    monkeypatch.setenv("LANESERVE_CPU_MATMUL", "off")
    assert cpu.own_format(path) is None
    assert LLM(device="cpu", num_kv_blocks=64).dtype == torch.bfloat16


def test_a_kv_pool_beyond_the_free_memory_is_refused_not_killed(tiny):
    """Linux grants the pool's allocations and kills the process as their zeros land: the runner asks first."""
    with open("/proc/meminfo") as f:
        free = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))
    with pytest.raises(ValueError, match=r"cannot allocate .*--kv-cache-memory.* GiB free"):
        LLM(model=tiny, dummy_weights=True, kv_cache_memory=1.5 * free / 2**30)
    with pytest.raises(ValueError, match=r"--num-kv-blocks.* GiB free"):
        LLM(model=tiny, dummy_weights=True, num_kv_blocks=free // 1024)  # of 4 KiB or more
