"""The OpenAI API's side of the server, without sockets or threads (serve.py carries it over HTTP): request bodies
checked field by field and turned into prompts and SamplingParams, replies and errors shaped as OpenAI's."""

from __future__ import annotations

import codecs
import json
import math
import os
import re
import uuid

from engine import Engine, RequestOutput, SamplingParams, TokenLogprob
from server.errors import ApiError
from structured import KINDS as GRAMMARS
from weights import HF_REPOS

ROLES = ("system", "developer", "user", "assistant", "tool")
# The request fields implemented, with JSON types (/openapi.json's source); any other non-null one gets a 400.
SAMPLING_FIELDS = {
    "model": "string",
    "n": "integer",
    "stream": "boolean",
    "stream_options": "object",
    "max_tokens": "integer",
    "temperature": "number",
    "top_p": "number",
    "top_k": "integer",
    "min_p": "number",
    "seed": "integer",
    "stop": ["string", "array"],
    "stop_token_ids": "array",
    "ignore_eos": "boolean",
    "min_tokens": "integer",
    "presence_penalty": "number",
    "frequency_penalty": "number",
    "repetition_penalty": "number",
    "logit_bias": "object",
    "skip_special_tokens": "boolean",
    "response_format": "object",
    "structured_outputs": "object",  # vLLM's; and the older spellings its clients still send:
    "guided_json": ["object", "string"],
    "guided_regex": "string",
    "guided_choice": "array",
    "guided_grammar": "string",
    "cache_salt": "string",
    "prompt_logprobs": "integer",  # vLLM's
    "user": "string",
}  # user: the client's own end-user id, for its records; changes nothing here
FIELDS = {
    "/v1/chat/completions": {
        "messages": "array",
        "max_completion_tokens": "integer",
        "logprobs": "boolean",
        "top_logprobs": "integer",
        "tools": "array",
        "tool_choice": ["string", "object"],
        "parallel_tool_calls": "boolean",  # one call a reply at most, here
        **SAMPLING_FIELDS,
    },
    "/v1/completions": {"prompt": ["string", "array"], "logprobs": "integer", "echo": "boolean", **SAMPLING_FIELDS},
    "/tokenize": {
        "model": "string",
        "prompt": "string",
        "messages": "array",
        "add_special_tokens": "boolean",
        "add_generation_prompt": "boolean",
    },
    "/detokenize": {"model": "string", "tokens": "array"},
}
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")
REQUIRED = {"/v1/chat/completions": ["messages"], "/v1/completions": ["prompt"], "/detokenize": ["tokens"]}
# A field of the other generation endpoint: the client called the wrong one.
WRONG_ENDPOINT = {
    ("/v1/chat/completions", "prompt"): "a prompt goes to /v1/completions; this endpoint takes 'messages'",
    ("/v1/completions", "messages"): "messages go to /v1/chat/completions; this endpoint takes 'prompt'",
}


def parse_body(raw: bytes, route: str) -> dict:
    """A POST body: a JSON object whose fields are all among FIELDS[route] (null counts as absent)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:  # bad JSON, invalid UTF-8, hostile nesting
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    if unknown := sorted(k for k, v in body.items() if v is not None and k not in FIELDS[route]):
        hint = "".join(f" ({WRONG_ENDPOINT[route, k]})" for k in unknown if (route, k) in WRONG_ENDPOINT)
        raise ApiError(400, f"unsupported field(s): {', '.join(unknown)}{hint}", unknown[0], "unsupported_field")
    return body


def get(body: dict, name: str, kind: type, default=None):
    """body[name] checked against kind with JSON's types (a bool is no number; NaN and Infinity, which
    Python's json accepts, are none either); null means default."""
    value = body.get(name)
    if value is None:
        return default
    if kind is float and type(value) is int:
        value = float(value)
    if (
        not isinstance(value, kind)
        or (kind is not bool and isinstance(value, bool))
        or (kind is float and not math.isfinite(value))
    ):
        what = {
            int: "an integer",
            float: "a number",
            bool: "a boolean",
            str: "a string",
            dict: "an object",
            list: "an array",
        }
        raise ApiError(400, f"'{name}' must be {what[kind]}", name)
    return value


def _is_ids(x) -> bool:
    return isinstance(x, list) and bool(x) and all(type(t) is int for t in x)


def chat_prompt(body: dict, engine: Engine, add_generation_prompt: bool = True) -> list[int]:
    """The conversation in messages, rendered by the chat template, as token ids."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty array", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}", "messages")
        content = m.get("content")
        if isinstance(content, list):
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages")
            content = "\n".join(p["text"] for p in content)
        elif content is not None and not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or an array of parts", "messages")
        # Chat templates know "system"; "developer" is OpenAI's newer name for it.
        message = {"role": "system" if m["role"] == "developer" else m["role"], "content": content or ""}
        for key in ("name", "tool_call_id"):  # a participant's name; a tool's result, for the call of that id
            if (value := m.get(key)) is None:
                continue
            if not isinstance(value, str):
                raise ApiError(400, f"messages[{i}].{key} must be a string", "messages")
            message[key] = value
        if m.get("tool_calls") is not None:  # an earlier turn's calls, arguments as objects (as templates read them)
            message["tool_calls"] = _calls_for_template(m["tool_calls"], i)
        clean.append(message)
    try:
        return engine.tokenizer.apply_chat_template(clean, add_generation_prompt, tools(body))
    except ValueError as e:  # the checkpoint's template refuses the conversation (say, roles out of order)
        raise ApiError(400, str(e), "messages") from e


def _calls_for_template(calls, i: int) -> list[dict]:
    def ok(c) -> bool:
        f = c.get("function") if isinstance(c, dict) else None
        return isinstance(f, dict) and isinstance(f.get("name"), str) and isinstance(f.get("arguments", "{}"), str)

    if not isinstance(calls, list) or not all(map(ok, calls)):
        raise ApiError(400, f"messages[{i}].tool_calls must be OpenAI's function calls", "messages")
    out = []
    for c in calls:
        try:
            arguments = json.loads(c["function"].get("arguments", "{}"))
        except ValueError:
            raise ApiError(400, f"messages[{i}].tool_calls: arguments must be a JSON string", "messages") from None
        out.append({**c, "function": {"name": c["function"]["name"], "arguments": arguments}})
    return out


def tools(body: dict) -> list[dict] | None:
    """The request's tools, checked: OpenAI's function tools, each named once, with a JSON schema's parameters."""
    given = get(body, "tools", list)
    if given is None:
        return None
    names = []
    for t in given:
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not (isinstance(f, dict) and isinstance(f.get("name"), str) and f["name"]):
            raise ApiError(400, "tools: each must be {'type': 'function', 'function': {'name': ...}}", "tools")
        if not isinstance(f.get("parameters", {}), dict):
            raise ApiError(400, f"tool {f['name']!r}: 'parameters' must be a JSON schema object", "tools")
        names.append(f["name"])
    if len(set(names)) < len(names):
        raise ApiError(400, "tools: a function name appears twice", "tools")
    return given


def tool_choice(body: dict) -> str | dict | None:
    """None (no tools, or tool_choice "none"), "auto" (the model's own call format, parsed), or the grammar that
    holds the reply to a call: {"name": ..., "parameters": schema} for a named tool, or "required": one of them."""
    given, choice = tools(body), body.get("tool_choice")
    if choice is None:
        choice = "auto" if given else "none"
    if choice == "none":
        return None
    if not given:
        raise ApiError(400, "'tool_choice' needs 'tools'", "tool_choice")
    functions = {t["function"]["name"]: t["function"] for t in given}
    if choice in ("auto", "required"):
        return choice
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or name not in functions:
        raise ApiError(
            400,
            f"'tool_choice' must be none, auto, required or one of the tools: {', '.join(functions)}",
            "tool_choice",
        )
    return {"name": name, "parameters": functions[name].get("parameters", {"type": "object"})}


def call_grammar(body: dict) -> dict | None:
    """The structured_outputs a named or required tool_choice holds the reply to."""
    choice = tool_choice(body)
    if isinstance(choice, dict):
        return {"json": choice["parameters"]}  # the reply is the call's arguments
    if choice == "required":
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["function"]["name"]},
                    "arguments": t["function"].get("parameters", {"type": "object"}),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in tools(body)
        ]
        return {"json": {"anyOf": calls}}
    return None


# The families' own call formats, for tool_choice "auto": Hermes' <tool_call>{...}</tool_call> (Qwen3), and a
# reply that is one JSON object with a name and parameters (Llama 3.1 and 3.2, after an optional <|python_tag|>).
HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def parse_calls(text: str, choice, names: list[str]) -> list[dict]:
    """The tool calls in a finished reply (OpenAI's shape, each with a fresh id), or [] if it is plain text (or a
    call cut short by max_tokens, which stays text)."""
    if choice is None:
        return []
    if isinstance(choice, dict):
        found = [{"name": choice["name"], "arguments": _loads(text)}]
    elif choice == "required":
        found = [_loads(text)]
    else:
        found = [_loads(m) for m in HERMES.findall(text)]
        if not found and text.strip().removeprefix("<|python_tag|>").lstrip().startswith("{"):
            found = [_loads(text.strip().removeprefix("<|python_tag|>"))]
    found = [
        (c["name"], c.get("arguments", c.get("parameters")))
        for c in found
        if isinstance(c, dict) and c.get("name") in names and isinstance(c.get("arguments", c.get("parameters")), dict)
    ]
    return [
        {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for n, a in found
    ]


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def maybe_call(text: str, choice) -> bool:
    """Whether a streamed reply's text so far may still turn out to be a tool call (held back until it is known)."""
    if choice is None:
        return False
    if choice != "auto":
        return True
    head = text.lstrip()
    return any(m.startswith(head[: len(m)]) for m in ("<tool_call>", "<|python_tag|>", "{"))


def completion_prompts(body: dict, engine: Engine) -> tuple[list[str | list[int]], list[list[int]]]:
    """The prompts as sent (strings or token ids), and as token ids."""
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) or _is_ids(prompt) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) or _is_ids(p) for p in prompts):
        raise ApiError(400, "'prompt' must be a string, an array of strings, or token ids", "prompt")
    tok, vocab = engine.tokenizer, engine.model_config.vocab_size
    if any(not 0 <= t < vocab for p in prompts if not isinstance(p, str) for t in p):
        raise ApiError(400, f"token ids must be in [0, {vocab})", "prompt")
    try:
        ids = [tok.encode(p, add_bos=tok.add_bos_token) if isinstance(p, str) else p for p in prompts]
    except Exception as e:  # text tiktoken refuses, such as lone surrogates
        raise ApiError(400, f"cannot tokenize the prompt: {e}", "prompt") from e
    if not all(ids):
        raise ApiError(400, "a prompt is empty", "prompt")
    return prompts, ids


def sampling_params(body: dict, chat: bool, prompt_len: int, engine: Engine, i: int) -> SamplingParams:
    """Sequence i of the n for one prompt; a seeded request seeds sequence i with seed + i."""
    field = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    get(body, "max_tokens", int)  # type-checked even where max_completion_tokens wins
    max_tokens = get(body, field, int)
    echo = not chat and get(body, "echo", bool, False)
    if echo and max_tokens == 0:  # scores the prompt alone: the one token generated is not reported (scoring_only)
        max_tokens = 1
    if max_tokens is None:  # OpenAI's defaults: all the room left for chat, 16 for completions
        room = min(engine.max_model_len, engine.block_manager.num_blocks * engine.block_manager.block_size)
        max_tokens = max(1, room - prompt_len) if chat else 16
    d = engine.sampling_defaults  # the checkpoint's generation_config.json, as in vLLM: its max_new_tokens caps
    max_tokens = min(max_tokens, d.get("max_tokens", max_tokens))
    # vLLM's messages, OpenAI's code: clients match them to shorten the request and retry.
    limit, what = engine.max_model_len, "messages" if chat else "prompt"
    if prompt_len >= limit:
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input {what}.",
            what,
            "context_length_exceeded",
        )
    if prompt_len + max_tokens > limit:
        raise ApiError(
            400,
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
            f"context length is {limit} tokens and your request has {prompt_len} input tokens "
            f"({max_tokens} > {limit} - {prompt_len}).",
            field,
            "context_length_exceeded",
        )
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    # Bounded: the engine thread checks every stop string's prefixes after every token.
    if not isinstance(stop, list) or len(stop) > 16 or not all(isinstance(s, str) and len(s) <= 256 for s in stop):
        raise ApiError(400, "'stop' must be a string or an array of at most 16, each at most 256 characters", "stop")
    if chat:
        top, wanted = get(body, "top_logprobs", int, 0), get(body, "logprobs", bool, False)
        if not 0 <= top <= 20 or top and not wanted:
            raise ApiError(400, "'top_logprobs' must be in [0, 20], and above 0 needs 'logprobs': true", "top_logprobs")
        logprobs = top if wanted else None
    else:
        logprobs = get(body, "logprobs", int)
    prompt_logprobs = get(body, "prompt_logprobs", int)
    if echo and logprobs is not None:  # the echoed prompt's tokens carry logprobs too, as OpenAI's and vLLM's
        prompt_logprobs = max(logprobs, prompt_logprobs or 0)
    seed = get(body, "seed", int)
    if seed is not None and not -(2**63) <= seed < 2**64:  # vLLM's int64, and the engine's unsigned 64 bits
        raise ApiError(400, "'seed' must be in [-2**63, 2**64)", "seed")
    bias, stop_ids = get(body, "logit_bias", dict, {}), get(body, "stop_token_ids", list, [])
    vocab = engine.model_config.vocab_size
    if not all(
        k.isascii()
        and k.isdecimal()
        and len(k) <= 10
        and int(k) < vocab
        and type(v) in (int, float)
        and math.isfinite(v)
        for k, v in bias.items()
    ):
        raise ApiError(400, f"'logit_bias' must map token ids in [0, {vocab}) to numbers", "logit_bias")
    if not all(type(t) is int and 0 <= t < vocab for t in stop_ids):
        raise ApiError(400, f"'stop_token_ids' must be an array of token ids in [0, {vocab})", "stop_token_ids")
    try:
        return SamplingParams(
            temperature=get(body, "temperature", float, d.get("temperature", 1.0)),
            top_p=get(body, "top_p", float, d.get("top_p", 1.0)),
            top_k=get(body, "top_k", int, d.get("top_k", 0)),
            min_p=get(body, "min_p", float, d.get("min_p", 0.0)),
            max_tokens=max_tokens,
            seed=None if seed is None else (seed + i) % 2**64,
            ignore_eos=get(body, "ignore_eos", bool, False),
            stop=stop,
            presence_penalty=get(body, "presence_penalty", float, 0.0),
            frequency_penalty=get(body, "frequency_penalty", float, 0.0),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            stop_token_ids=stop_ids,
            min_tokens=get(body, "min_tokens", int, 0),
            repetition_penalty=get(body, "repetition_penalty", float, d.get("repetition_penalty", 1.0)),
            logit_bias=bias,
            skip_special_tokens=get(body, "skip_special_tokens", bool, True),
            cache_salt=get(body, "cache_salt", str),
            structured_outputs=structured_outputs(body),
        )
    except ValueError as e:  # the messages read "<field> must be ..."
        param = str(e).split()[0]
        if param == "max_tokens" and chat and body.get("max_completion_tokens") is not None:
            param = "max_completion_tokens"  # what the request named (it takes precedence)
        raise ApiError(400, str(e), param) from e


def structured_outputs(body: dict) -> dict | None:
    """The request's grammar, one of its spellings: OpenAI's response_format (json_object, json_schema), vLLM's
    structured_outputs (json, json_object, regex, choice, grammar) and the older guided_json, guided_regex,
    guided_choice and guided_grammar. Whether it compiles is the engine's to say (a 400 naming the problem)."""
    found = []
    fmt = get(body, "response_format", dict, {})
    if (kind := "text" if fmt.get("type") is None else fmt["type"]) == "json_object":
        found.append({"json_object": True})
    elif kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise ApiError(
                400, "response_format.json_schema must be an object with a 'schema' object", "response_format"
            )
        found.append({"json": spec.get("schema", {})})  # strict or not, the output follows the schema
    elif kind != "text":
        raise ApiError(
            400, f"response_format type must be text, json_object or json_schema, got {kind!r}", "response_format"
        )
    spec = get(body, "structured_outputs", dict, {})
    if unknown := sorted(k for k, v in spec.items() if v is not None and k not in GRAMMARS):
        raise ApiError(400, f"structured_outputs: unsupported key(s) {', '.join(unknown)}", "structured_outputs")
    found += [{k: v} for k, v in spec.items() if v is not None and not (k == "json_object" and v is False)]
    old = {k: body.get(f"guided_{k}") for k in ("json", "regex", "choice", "grammar")}
    found += [{k: v} for k, v in old.items() if v is not None]
    found += [call] if (call := call_grammar(body)) else []  # a named or required tool_choice
    if len(found) > 1:
        raise ApiError(
            400,
            "a request takes one grammar: response_format, structured_outputs, a guided_ field or a tool_choice",
            "structured_outputs",
        )
    return found[0] if found else None


class TextOffsets:
    """Completions' text_offset for one choice, token after token (a stream's chunks in turn): where each token's text
    starts in the choice's text, in characters. A token that ends inside a character starts where the character does:
    its bytes wait in the decoder for the rest."""

    def __init__(self):
        self.at, self.utf8 = 0, codecs.getincrementaldecoder("utf-8")("replace")

    def __call__(self, raw: bytes) -> int:
        start, self.at = self.at, self.at + len(self.utf8.decode(raw))
        return start


def _token_text(raw: bytes) -> str:
    """A token as completions' logprobs name it: its text, or, for part of a character, OpenAI's bytes:\\xNN form (as
    text every such token would be the same U+FFFD, one key in top_logprobs)."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _logprobs(engine: Engine, chat: bool, lps: list[TokenLogprob], offsets: TextOffsets) -> dict | None:
    """OpenAI's two logprobs shapes: chat's per-token entries, completions' parallel arrays."""
    if not lps:
        return None
    tok = engine.tokenizer
    if chat:

        def entry(token_id: int, logprob: float) -> dict:
            raw = tok.decode_bytes([token_id])
            return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}

        return {"content": [{**entry(x.token_id, x.logprob), "top_logprobs": [entry(*t) for t in x.top]} for x in lps]}
    raws = [tok.decode_bytes([x.token_id]) for x in lps]
    tokens = list(map(_token_text, raws))
    return {
        "tokens": tokens,
        "token_logprobs": [x.logprob for x in lps],
        # The chosen token's always, as OpenAI documents: up to logprobs + 1 entries (an echoed prompt's first: null).
        "top_logprobs": [
            None
            if x.logprob is None
            else {**{_token_text(tok.decode_bytes([t])): lp for t, lp in x.top}, text: x.logprob}
            for text, x in zip(tokens, lps)
        ],
        "text_offset": list(map(offsets, raws)),
    }


def echoed_logprobs(out: RequestOutput) -> list[TokenLogprob]:
    """An echoed prompt's logprobs, in the shape of generated tokens': the first token has none."""
    return [TokenLogprob(out.prompt_token_ids[0], None, [], None), *out.prompt_logprobs]


def prompt_logprobs(engine: Engine, out: RequestOutput) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token, null for the first, then {token id: {logprob, rank, decoded_token}}
    for the token itself and the top k."""
    tok = engine.tokenizer
    return [None] + [
        {
            str(t): {"logprob": lp, "rank": rank, "decoded_token": tok.decode([t])}
            for t, lp, rank in [(x.token_id, x.logprob, x.rank)] + [(t, lp, k + 1) for k, (t, lp) in enumerate(x.top)]
        }
        for x in out.prompt_logprobs
    ]


def choice(
    engine: Engine,
    chat: bool,
    stream: bool,
    i: int,
    text: str,
    lps: list[TokenLogprob],
    last: RequestOutput | None,
    offsets: TextOffsets | None = None,
    calls: list[dict] | None = None,
) -> dict:
    """One choice of a reply or of a stream's chunk; `last` is the engine output it reports the reasons of
    (None for a chunk of no output, such as an echo). With tool calls (parse_calls), they are the reply."""
    if not chat:
        choice = {"index": i, "text": text}
    elif calls:
        tool_calls = [{"index": k, **c} for k, c in enumerate(calls)] if stream else calls
        choice = {"index": i, **({"delta": {"tool_calls": tool_calls}} if stream else {})}
        choice |= {} if stream else {"message": {"role": "assistant", "content": None, "tool_calls": tool_calls}}
    elif stream:
        choice = {"index": i, "delta": {"content": text} if text else {}}
    else:
        choice = {"index": i, "message": {"role": "assistant", "content": text}}
    return {
        **choice,
        "logprobs": _logprobs(engine, chat, lps, offsets or TextOffsets()),
        "finish_reason": "tool_calls" if calls else last and last.finish_reason,
        "stop_reason": last and last.stop_reason,
    }


def reply_options(body: dict, names: list[str]) -> tuple[int, bool, bool, bool, bool]:
    """A generation request's n, stream, echo, whether a usage chunk ends its stream and whether every chunk carries
    the usage so far (vLLM's continuous_usage_stats), each checked; so is the model it names (one of names)."""
    echo = get(body, "echo", bool, False)
    check_model(body, names)
    n = get(body, "n", int, 1)
    if not 1 <= n <= 128:
        raise ApiError(400, "'n' must be in [1, 128]", "n")
    get(body, "user", str)  # the client's own end-user id: checked, then unused
    stream = get(body, "stream", bool, False)
    if stream and body.get("prompt_logprobs") is not None:  # as vLLM
        raise ApiError(400, "'prompt_logprobs' is not available when 'stream' is true", "prompt_logprobs")
    options = get(body, "stream_options", dict, {})
    if body.get("stream_options") is not None and not stream:
        raise ApiError(400, "'stream_options' is only for streamed requests ('stream': true)", "stream_options")
    if unknown := sorted(k for k, v in options.items() if v is not None and k not in STREAM_OPTIONS):
        raise ApiError(
            400,
            f"stream_options: unsupported key(s) {', '.join(unknown)} (only {' and '.join(STREAM_OPTIONS)})",
            "stream_options",
            "unsupported_field",
        )
    return n, stream, echo, *(get(options, k, bool, False) for k in STREAM_OPTIONS)


def model_names(model: str, checkpoint_path: str | None, served: str | list[str] | None = None) -> list[str]:
    """The names a request may give the model, the one replies carry first: --served-model-name's if given, as
    in vLLM; else a preset's Hugging Face id (vLLM's default name, its --model), --model's, the preset's other ids,
    and the checkpoint's file or directory name."""
    if served:
        return [served] if isinstance(served, str) else list(served)
    aliases = [name for preset, repos in HF_REPOS.items() if model in (preset, *repos) for name in (preset, *repos)]
    first = HF_REPOS.get(model, [])[
        :1
    ]  # a preset's Hugging Face id first, as vLLM lists it (clients load its tokenizer)
    files = [
        os.path.basename(p.rstrip("/"))
        for p in (model, checkpoint_path)
        if p and os.path.basename(os.path.dirname(p.rstrip("/"))) != "snapshots"
    ]  # not a HF cache's hash
    return list(dict.fromkeys([*first, model, *aliases, *files]))


def check_model(body: dict, names: list[str]) -> None:
    """A request may name the model (one of its names, the served one first) or not."""
    if (model := get(body, "model", str, names[0])) not in names:
        raise ApiError(
            404,
            f"The model `{model}` does not exist. This server serves: {', '.join(names)}.",
            "model",
            "model_not_found",
        )


def openapi(version: str) -> dict:
    ok = {"200": {"description": "OK"}, "400": {"description": "Bad request, OpenAI's error JSON"}}

    def post(path: str) -> dict:
        schema = {
            "type": "object",
            "required": REQUIRED.get(path, []),
            "properties": {k: {"type": t} for k, t in FIELDS[path].items()},
        }
        return {
            "post": {
                "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
                "responses": ok,
            }
        }

    gets = ("/health", "/metrics", "/version", "/v1/models")
    return {
        "openapi": "3.1.0",
        "info": {"title": "laneserve", "version": version},
        "paths": {**{path: post(path) for path in FIELDS}, **{path: {"get": {"responses": ok}} for path in gets}},
    }
