"""Tool calling: tools through the chat template, tool_choice none, auto (the model's own call format, parsed),
required and a named function (the reply held to a call with valid arguments by the grammar), OpenAI's tool_calls
in replies and stream deltas, and the next turn's tool messages back through the template."""

import json
import random

import openai
import pytest

from config import EngineConfig
from conftest import serving
from engine import LLM, SamplingParams
from server import openai_api

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "days": {"type": "integer"}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOPICS = ("cats", "rivers", "kings", "ships", "bread", "stars", "rain")
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


@pytest.fixture(scope="module")
def client():
    with serving(EngineConfig(num_kv_blocks=512, max_num_seqs=8, device="cpu", dtype="float32")) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)


def called(city: str, result: str) -> list[dict]:
    """An assistant turn that called get_weather for city, and the tool's answer."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
    }
    return [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": result},
    ]


def check_weather_call(call) -> dict:
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "days"} and isinstance(arguments["days"], int), arguments
    return arguments


@pytest.mark.slow
def test_a_named_tool_choice_answers_with_a_call_of_valid_arguments(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model="smollm2-135m", messages=ASK, tools=[WEATHER, TIME], tool_choice=named, temperature=0, max_tokens=40
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    arguments = check_weather_call(call)
    # Streamed: the same call, in one tool_calls delta, then the finish.
    chunks = list(
        client.chat.completions.create(
            model="smollm2-135m",
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice=named,
            temperature=0,
            max_tokens=40,
            stream=True,
        )
    )
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas] == ["get_weather"] and json.loads(
        deltas[0].function.arguments
    ) == arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)


@pytest.mark.slow
def test_required_calls_one_of_the_tools(client):
    r = client.chat.completions.create(
        model="smollm2-135m",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        temperature=0.7,
        seed=1,
        max_tokens=60,
    )
    [call] = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name in ("get_weather", "get_time")
    if call.function.name == "get_weather":
        check_weather_call(call)


@pytest.mark.slow
def test_auto_and_none_answer_in_text_where_the_model_has_no_call_format(client):
    """SmolLM2 has no tool-call format of its own: auto answers in text, as none does."""
    for choice in ("auto", "none"):
        r = client.chat.completions.create(
            model="smollm2-135m", messages=ASK, tools=[WEATHER], tool_choice=choice, temperature=0, max_tokens=12
        )
        assert r.choices[0].message.content and not r.choices[0].message.tool_calls, choice


@pytest.mark.slow
def test_the_next_turn_goes_back_through_the_template(client):
    """The assistant's call and the tool's result are a conversation the template renders, and the reply goes on."""
    turn = [*ASK, *called("Paris", '{"forecast": "sunny"}')]
    r = client.chat.completions.create(
        model="smollm2-135m", messages=turn, tools=[WEATHER], temperature=0, max_tokens=8
    )
    assert r.choices[0].message.content


def test_tools_and_calls_reach_the_template(tiny):
    """A template that reads tools and an earlier call's arguments (as objects, as Hugging Face templates take them)."""
    from engine import LLM

    llm = LLM(model=tiny, dummy_weights=True, device="cpu", num_kv_blocks=16)
    llm.tokenizer = llm.tokenizer.with_chat_template(
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<{{ c.function.name }} {{ c.function.arguments.city }}>{% endfor %}"
        "{{ m.name or '' }}{{ m.tool_call_id or '' }}{% endfor %}"
    )
    body = {
        "messages": [{"role": "user", "content": "hi", "name": "Ann"}, *called("Oslo", "rain")],
        "tools": [WEATHER, TIME],
    }
    text = llm.tokenizer.decode(openai_api.chat_prompt(body, llm, add_generation_prompt=False))
    assert text == "[get_weather][get_time]user:hiAnnassistant:<get_weather Oslo>tool:raincall_1"


def test_the_families_call_formats_are_parsed():
    names = ["get_weather", "get_time"]
    hermes = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    )
    llama = '<|python_tag|>{"name": "get_time", "parameters": {}}'
    for text, expected in [
        (hermes, [("get_weather", {"city": "Paris", "days": 3})]),
        (llama, [("get_time", {})]),
        ('{"name": "get_time", "parameters": {}}', [("get_time", {})]),
        ('{"name": "rm_rf", "arguments": {}}', []),  # not a tool of the request: text
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Par', []),  # cut short: text
        ("The weather is fine.", []),
    ]:
        calls = openai_api.parse_calls(text, "auto", names)
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == expected, text
    named = {"name": "get_weather", "parameters": {}}
    assert openai_api.parse_calls('{"city": "Oslo", "days": 1}', named, names)[0]["function"]["name"] == "get_weather"
    assert openai_api.parse_calls('{"city": "Os', named, names) == []
    assert openai_api.parse_calls(hermes, None, names) == []
    assert openai_api.maybe_call("<tool", "auto") and openai_api.maybe_call(' {"na', "auto")
    assert not openai_api.maybe_call("The weather", "auto") and not openai_api.maybe_call("<tool", None)


def test_bad_tools_and_choices_are_400s(client):
    for kwargs, words in [
        (dict(tools=[{"type": "function"}]), "tools: each must be"),
        (dict(tools=[WEATHER, WEATHER]), "appears twice"),
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "one of the tools"),
        *(  # a function that is no object, or a name that is no string: a 400, not a dropped connection
            (dict(tools=[WEATHER], tool_choice={"type": "function", "function": f}), "one of the tools")
            for f in ("get_weather", None, 5, [], {"name": ["get_weather"]})
        ),
        (dict(tool_choice="required"), "needs 'tools'"),
        (dict(messages=[{**ASK[0], "name": 7}]), r"messages\[0\].name must be a string"),
        (dict(messages=[*ASK, {"role": "tool", "tool_call_id": 1, "content": "x"}]), "tool_call_id must be a string"),
        (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "one grammar"),
        (
            dict(
                messages=[
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"function": {"name": "x", "arguments": "{"}}],
                    }
                ]
            ),
            "arguments must be a JSON string",
        ),
    ]:
        with pytest.raises(openai.BadRequestError, match=words):
            client.chat.completions.create(**{"model": "smollm2-135m", "messages": ASK, "max_tokens": 4, **kwargs})


@pytest.mark.slow
def test_tool_calls_alone_equal_tool_calls_among_unconstrained():
    """A named call (greedy) and a required one (seeded) among 24 unconstrained requests: each its lone run."""
    llm = LLM(num_kv_blocks=512, max_num_seqs=32, dtype="float32", device="cpu")
    named = {"type": "function", "function": {"name": "get_weather"}}
    bodies = [
        {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": named, "temperature": 0, "max_tokens": 40},
        {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required", "temperature": 0.7, "seed": 1},
    ]
    calls = []
    for body in bodies:
        prompt = openai_api.chat_prompt({**body, "max_tokens": 60}, llm)
        calls.append((prompt, openai_api.sampling_params({"max_tokens": 60, **body}, True, len(prompt), llm, 0)))
    rng = random.Random(57)
    others = [
        (
            llm.tokenizer.apply_chat_template([{"role": "user", "content": f"Tell me about {rng.choice(TOPICS)}."}]),
            SamplingParams(temperature=rng.choice([0, 0.8]), seed=i, max_tokens=rng.randint(8, 40)),
        )
        for i in range(24)
    ]
    requests = others[:5] + calls[:1] + others[5:17] + calls[1:] + others[17:]
    together = llm.generate(*map(list, zip(*requests)))
    for i in (5, 18):
        [alone] = llm.generate([requests[i][0]], requests[i][1])
        assert (alone.token_ids, alone.text) == (together[i].token_ids, together[i].text)
        assert openai_api.parse_calls(alone.text, openai_api.tool_choice(bodies[i > 5]), ["get_weather", "get_time"])
