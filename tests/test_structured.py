"""Structured output (structured.py, llguidance): every grammar kind and every spelling of it, the output following
its grammar, the refusals, and the lanes rule with it: a constrained request alone and among unconstrained ones, with
and without speculation, gives the same bits."""

import json
import random
import re

import openai
import pydantic
import pytest
import torch

import structured
import weights
from config import EngineConfig
from conftest import serving
from engine import LLM, SamplingParams
from sequence import Sequence
from server import openai_api

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
QUESTION = [{"role": "user", "content": "Describe a person: their name and age."}]
SHORT = [
    {"role": "user", "content": 'Reply in JSON with one key, "answer", whose value is yes or no: is the sky blue?'}
]


@pytest.fixture(scope="module")
def smol():
    return LLM(num_kv_blocks=512, max_num_seqs=16, dtype="float32", device="cpu")


def constrained(spec: dict, **knobs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 48, "structured_outputs": spec, **knobs})


@pytest.mark.slow
def test_each_kind_holds_its_output_to_its_grammar(smol):
    specs = [
        {"json": PERSON},
        {"json_object": True},
        {"regex": r"[0-9]{3}-[a-z]{2,5}"},
        {"choice": ["Paris", "London", "a city I do not know"]},
        {"grammar": 'root ::= "The answer is " ("yes" | "no") "."'},
    ]
    # Sampled where a wrong token would show (a regex, a choice); a free JSON object: a question with a short answer.
    questions = [QUESTION, SHORT, QUESTION, QUESTION, QUESTION]
    out = smol.chat(questions, [constrained(s, temperature=t) for s, t in zip(specs, (0, 0.8, 0.8, 1, 0.8))])
    assert all(o.finish_reason == "stop" for o in out), [(o.text, o.finish_reason) for o in out]
    person, anything, code, city, answer = (o.text for o in out)
    person = json.loads(person)
    assert set(person) == {"name", "age"} and isinstance(person["name"], str) and isinstance(person["age"], int)
    assert isinstance(json.loads(anything), dict)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", code)
    assert city in ("Paris", "London", "a city I do not know")
    assert answer in ("The answer is yes.", "The answer is no.")


def test_a_grammar_that_does_not_compile_is_refused_by_name(smol):
    for spec, words in [
        ({"json": {"type": "nonsense"}}, "json"),
        ({"regex": "(("}, "regex"),
        ({"grammar": "root ::= ("}, "grammar"),
        ({"choice": []}, "choice"),
        ({"choice": "Paris"}, "choice"),
        ({"regex": "a[^\\s\\S]"}, "regex matches no text"),  # an empty language: no first token to sample
        ({"yaml": "a: 1"}, "exactly one of"),
        ({"json": PERSON, "regex": "a"}, "exactly one of"),
    ]:
        with pytest.raises(ValueError, match=words):
            smol.add_request("Hello", constrained(spec))
    assert not smol.has_unfinished()
    with pytest.raises(ValueError, match="structured_outputs must be dict"):
        SamplingParams(structured_outputs="json")


def run(llm: LLM, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, list]:
    for i, (ids, params) in enumerate(requests):
        llm.add_request(ids, params, str(i))
    got: dict[str, list] = {}
    while llm.has_unfinished():
        for out in llm.step():
            got.setdefault(out.request_id, []).append((out.token_ids[-1], out.logprob and out.logprob.logprob))
    return got


@pytest.mark.slow
def test_constrained_lanes_alone_equal_lanes_among_unconstrained(smol):
    """Four constrained requests (greedy and seeded) among 24 unconstrained ones: each is its lone run, bit for bit."""
    rng = random.Random(56)
    prompts = [
        smol.tokenizer.apply_chat_template([{"role": "user", "content": f"Tell me about {w}."}])
        for w in ("cats", "rivers", "kings", "ships", "bread", "stars", "rain")
    ]
    requests = [
        (rng.choice(prompts), SamplingParams(temperature=rng.choice([0, 0.8]), seed=i, max_tokens=12, logprobs=1))
        for i in range(24)
    ]
    requests[3:3] = [(prompts[0], constrained({"json": PERSON}, logprobs=1, max_tokens=20))]
    requests[9:9] = [(prompts[1], constrained({"regex": "[a-z ]{5,30}\\."}, temperature=0.9, seed=7, logprobs=1))]
    requests[15:15] = [(prompts[2], constrained({"choice": ["yes", "no"]}, temperature=1, seed=3, logprobs=1))]
    requests[20:20] = [(prompts[3], constrained({"json_object": True}, temperature=0.5, seed=1, max_tokens=16))]
    together = run(smol, requests)
    for i, request in enumerate(requests):
        if request[1].structured_outputs:
            assert run(smol, [request])["0"] == together[str(i)], i


@pytest.mark.slow
def test_a_grammar_with_speculation_is_the_grammar_without():
    """n-gram drafts are checked against the grammar (a refused draft's rows are never reached) and the matcher
    rolls back what it took on for them: the same tokens with speculation on as off."""
    text = '{"name": "Ada Lovelace", "age": 36}'
    question = [{"role": "user", "content": f"Repeat this exactly: {text} {text}"}]
    outs = []
    for k in (0, 4):
        llm = LLM(num_kv_blocks=256, dtype="float32", device="cpu", num_speculative_tokens=k)
        params = [constrained({"json": PERSON}, max_tokens=40), constrained({"regex": '\\{"name": "[A-Za-z ]+"'})]
        outs.append([o.token_ids for o in llm.chat([question, question], params)])
        assert k == 0 or llm.num_accepted_tokens > 0
    assert outs[0] == outs[1]


@pytest.fixture(scope="module")
def client():
    with serving(EngineConfig(num_kv_blocks=512, max_num_seqs=8, device="cpu", dtype="float32")) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.mark.slow
def test_every_spelling_over_http(client):
    chat = dict(model="smollm2-135m", messages=QUESTION, temperature=0, max_tokens=40)
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for kwargs in [
        dict(response_format=schema),
        dict(extra_body={"structured_outputs": {"json": PERSON}}),
        dict(extra_body={"guided_json": PERSON}),
        dict(extra_body={"guided_json": json.dumps(PERSON)}),
    ]:
        reply = client.chat.completions.create(**chat, **kwargs).choices[0].message.content
        assert set(json.loads(reply)) == {"name", "age"}, kwargs
    reply = client.chat.completions.create(**{**chat, "messages": SHORT}, response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    for extra, check in [
        ({"guided_regex": "[0-9]{4}"}, lambda t: re.fullmatch("[0-9]{4}", t)),
        ({"structured_outputs": {"regex": "[0-9]{4}"}}, lambda t: re.fullmatch("[0-9]{4}", t)),
        ({"guided_choice": ["red", "blue"]}, lambda t: t in ("red", "blue")),
        ({"structured_outputs": {"choice": ["red", "blue"]}}, lambda t: t in ("red", "blue")),
        ({"guided_grammar": 'root ::= "ok"'}, lambda t: t == "ok"),
        ({"structured_outputs": {"grammar": 'root ::= "ok"'}}, lambda t: t == "ok"),
    ]:
        text = client.completions.create(model="smollm2-135m", prompt="Say:", max_tokens=8, extra_body=extra)
        assert check(text.choices[0].text), (extra, text.choices[0].text)


@pytest.mark.slow
def test_the_openai_clients_parse_with_a_pydantic_model(client):
    class Person(pydantic.BaseModel):
        name: str
        age: int

    reply = client.chat.completions.parse(
        model="smollm2-135m", messages=QUESTION, temperature=0, max_tokens=40, response_format=Person
    )
    person = reply.choices[0].message.parsed
    assert isinstance(person, Person) and person.name


def test_bad_grammars_are_400s_naming_the_problem(client):
    chat = dict(model="smollm2-135m", messages=QUESTION, max_tokens=8)
    for kwargs, words in [
        (dict(extra_body={"guided_regex": "(("}), "regex does not compile"),
        (dict(extra_body={"guided_regex": "[^\\s\\S]"}), "regex matches no text"),
        (dict(extra_body={"structured_outputs": {"json": {"type": "nonsense"}}}), "json does not compile"),
        (dict(extra_body={"structured_outputs": {"yaml": "x"}}), "unsupported key"),
        (dict(extra_body={"guided_regex": "a", "guided_choice": ["a"]}), "one grammar"),
        (dict(response_format={"type": "xml"}), "json_object or json_schema"),
        (dict(response_format={"type": "json_schema", "json_schema": {"schema": 3}}), "'schema' object"),
    ]:
        with pytest.raises(openai.BadRequestError, match=words):
            client.chat.completions.create(**chat, **kwargs)


def test_grammar_spellings_that_ask_for_none_hold_none():
    """json_object false asks for no grammar; a response_format type that is no string is a 400, not text."""
    assert openai_api.structured_outputs({"structured_outputs": {"json_object": False}}) is None
    assert openai_api.structured_outputs({"response_format": {"type": None}}) is None
    assert openai_api.structured_outputs({"structured_outputs": {"json_object": True}}) == {"json_object": True}
    for kind in ({}, "", 0):
        with pytest.raises(openai_api.ApiError, match="json_object or json_schema"):
            openai_api.structured_outputs({"response_format": {"type": kind}})


def test_structured_outputs_need_no_checkpoint_of_their_own(smollm2_shapes):
    """On random weights (the byte tokenizer) a grammar holds as well: the vocabulary comes from the tokenizer."""
    assert "smollm2-shapes" in weights.PRESETS
    llm = LLM(model="smollm2-shapes", dummy_weights=True, device="cpu", num_kv_blocks=64)
    [out] = llm.generate([[1, 2, 3]], constrained({"regex": "[ab]{3}"}, temperature=1, seed=0))
    assert re.fullmatch("[ab]{3}", out.text), out.text


def test_masks_overlapping_the_forward_pass_are_the_masks_computed_after(smol):
    """A GPU's step computes the grammar masks on a thread while the model runs (overlap), a CPU's when the sampler
    needs them: the same rows, drafts included, and each matcher where it began."""
    seqs = []
    for spec, draft in (({"json": PERSON}, []), ({"regex": "[a-z]{2,6}"}, [64, 65, 12]), ({"json_object": True}, [90])):
        seq = Sequence("r", [1, 2, 3], constrained(spec))
        seq.grammar, seq.draft = smol.grammars.matcher(spec), draft
        seqs.append(seq)
    seqs.insert(1, Sequence("free", [4], constrained({"json": PERSON}, structured_outputs=None)))
    vocab, got = smol.model_config.vocab_size, []
    for overlap in (True, False, True):
        logits = torch.zeros(1 + 1 + 4 + 2, vocab)
        structured.masks(seqs, vocab, overlap).apply(logits)
        got.append(logits)
    assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])
    assert got[0][1].isfinite().all() and not got[0][0].isfinite().all()  # the free row untouched


def parse_as_sent(client, model: type[pydantic.BaseModel], question: str, max_tokens: int):
    """The openai client's .parse() with a Pydantic model, greedy: the request body as the client sent it, the
    raw content and the parsed reply."""
    raw = client.chat.completions.with_raw_response.parse(
        model="smollm2-135m",
        messages=[{"role": "user", "content": question}],
        temperature=0,
        max_tokens=max_tokens,
        response_format=model,
    )
    message = raw.parse().choices[0].message
    return json.loads(raw.http_request.content), message.content, message.parsed


@pytest.mark.slow
def test_parse_gives_the_model_and_json_of_its_schema(client):
    """.parse() sends the model's schema as a strict json_schema; the reply is JSON of exactly that schema, and
    message.parsed an instance of the model."""

    class Person(pydantic.BaseModel):
        name: str
        age: int

    sent, content, person = parse_as_sent(client, Person, "Describe a person: their name and age.", 32)
    fmt = sent["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["name"] == "Person"
    assert fmt["json_schema"]["strict"] is True and fmt["json_schema"]["schema"]["additionalProperties"] is False
    assert isinstance(person, Person) and person.name.strip() and isinstance(person.age, int)
    data = json.loads(content)
    assert set(data) == {"name", "age"} and isinstance(data["name"], str) and type(data["age"]) is int
    assert Person.model_validate(data) == person


@pytest.mark.slow
def test_parse_strict_holds_nested_models_enums_and_bounds(client):
    """In strict mode, as the openai client sends it (every property required, additionalProperties false at every
    level, $defs and $ref for a nested model), the grammar holds the enum, the string lengths and the integer's
    bounds, and no key outside the schema appears."""
    from typing import Literal

    class Pet(pydantic.BaseModel):
        kind: Literal["cat", "dog"]
        name: str = pydantic.Field(max_length=12)

    class Owner(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=12)
        age: int = pydantic.Field(ge=0, le=120)
        pet: Pet

    sent, content, owner = parse_as_sent(client, Owner, "Describe a pet owner: name, age and pet.", 64)
    schema = sent["response_format"]["json_schema"]
    assert schema["strict"] is True and schema["schema"]["$defs"]["Pet"]["additionalProperties"] is False
    assert schema["schema"]["properties"]["pet"] == {"$ref": "#/$defs/Pet"}
    assert isinstance(owner, Owner) and isinstance(owner.pet, Pet)
    data = json.loads(content)
    assert set(data) == {"name", "age", "pet"} and set(data["pet"]) == {"kind", "name"}
    assert data["pet"]["kind"] in ("cat", "dog") and 0 <= data["age"] <= 120
    assert len(data["name"]) <= 12 and len(data["pet"]["name"]) <= 12
    assert Owner.model_validate(data) == owner
