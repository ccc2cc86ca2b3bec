"""Text <-> token ids: byte-level BPE run by tiktoken (SentencePiece vocabularies, Gemma's, by Hugging Face
tokenizers), chat templates, and streaming detokenization."""

import codecs
import copy
import json
import os
import re
from datetime import datetime
from functools import cached_property

import jinja2
import numpy as np
import regex
import tiktoken
from jinja2.sandbox import ImmutableSandboxedEnvironment

from weights import read_gguf

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# GPT-2's pattern after HF's Digits(individual_digits=True) has cut the text at every digit: a digit
# stands alone, and a whitespace run before a digit ends its chunk, so it stays whole.
GPT2_DIGITS_PATTERN = r"""\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?=\p{N})|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen2's, Qwen2.5's and Qwen3's: Llama 3's with one digit to a chunk.
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# tokenizer.ggml.pre values. 'smollm' gets GPT-2's pattern as in transformers, although llama.cpp and
# SmolLM2's own tokenizer.json split digits first; the ids differ only for whitespace before a digit.
# transformers splits every other byte-level GGUF with GPT-2's pattern too; we refuse those rather than guess.
GGUF_PATTERNS = {
    "gpt2": GPT2_PATTERN,
    "smollm": GPT2_PATTERN,
    "llama3": LLAMA3_PATTERN,
    "llama-v3": LLAMA3_PATTERN,
    "llama-bpe": LLAMA3_PATTERN,
    "qwen2": QWEN2_PATTERN,
}
END_OF_TURN = ["<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|endoftext|>", "<|end_of_text|>", "<end_of_turn>"]
# For a checkpoint that brings no chat template (and for --dummy-weights' byte tokenizer).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Gemma 3's (google/gemma-3-*-it), for a Gemma vocabulary whose checkpoint brings none (the base GGUFs).
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}{%- endif -%}"
    '{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = "" -%}'
    "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    '{{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}{%- endif -%}'
    "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}{%- else -%}"
    "{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}{%- elif item['type'] == 'text' -%}"
    "{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}{%- else -%}{{ raise_exception(\"Invalid content type\") }}"
    "{%- endif -%}{{ '<end_of_turn>\n' }}{%- endfor -%}{%- if add_generation_prompt -%}"
    "{{'<start_of_turn>model\n'}}{%- endif -%}"
)


# GPT-2's bytes_to_unicode, read back: byte-level vocabularies spell each byte as a printable character, itself
# if it is printable, else one from U+0100 on, in byte order.
_PRINTABLE = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
_UNPRINTABLE = [b for b in range(256) if b not in _PRINTABLE]
_UNSPELL = {chr(b): b for b in _PRINTABLE} | {chr(256 + i): b for i, b in enumerate(_UNPRINTABLE)}


def _token_bytes(token: str) -> bytes:
    # Added tokens may be written in plain text rather than the byte alphabet; HF decodes them as such.
    return bytes(_UNSPELL[c] for c in token) if all(c in _UNSPELL for c in token) else token.encode()


class Tokenizer:
    """Byte-level BPE. tiktoken does the splitting and merging; this class owns ids, specials and chat."""

    def __init__(
        self,
        vocab: dict[bytes, int],
        merges: list[tuple[bytes, bytes]],
        pattern: str,
        special: dict[str, int],
        control: set[int],
        bos_id: int | None,
        eos_id: int | None,
        add_bos_token: bool = False,
        chat_template: str | None = None,
        extra_stops: tuple[int, ...] = (),
    ):
        """vocab: ordinary tokens; merges: HF's list; special: texts matched whole in the input; control: the
        ids skip_special_tokens drops."""
        pieces = {i: piece for piece, i in vocab.items()} | {i: _token_bytes(t) for t, i in special.items()}
        self._set_ids(
            [pieces.get(i, b"") for i in range(max(pieces) + 1)],
            special,
            control,
            bos_id,
            eos_id,
            add_bos_token,
            chat_template,
            extra_stops,
        )
        ranks, rank_to_id = _merge_ranks(vocab, merges)
        # tiktoken returns ranks; specials get ranks past the mergeable ones and map back to their ids.
        self._rank_to_id = np.concatenate([rank_to_id, np.fromiter(special.values(), np.int64, len(special))])
        self._special_ranks = {t: len(rank_to_id) + i for i, t in enumerate(special)}
        self._enc = tiktoken.Encoding(
            "laneserve", pat_str=pattern, mergeable_ranks=ranks, special_tokens=self._special_ranks
        )
        # HF drops a byte its vocabulary lacks (SmolLM has no token for some control characters) after
        # splitting text into words, then merges across the gap. Texts with such a character take a
        # slower path that does the same. A missing non-ASCII byte (SmolLM's 0xF1 and 0xF2 lead only the
        # unassigned planes 4-11) is dropped after merging, so the ids next to such a code point can differ
        # from HF's; so can the slower path's word splits next to code points that the regex module's
        # Unicode tables assign and HF's do not (found by fuzzing against transformers).
        absent = "".join(chr(b) for b in range(128) if rank_to_id[b] < 0)
        self._absent = re.compile(f"[{re.escape(absent)}]") if absent else None
        self._words = regex.compile(pattern)
        longest_first = sorted(special, key=len, reverse=True)
        self._specials = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")") if special else None

    def _set_ids(
        self,
        pieces: list[bytes],
        special: dict[str, int],
        control: set[int],
        bos_id: int | None,
        eos_id: int | None,
        add_bos_token: bool,
        chat_template: str | None,
        extra_stops: tuple[int, ...],
    ) -> None:
        """What every vocabulary has: each id's bytes (pieces), specials, the ids that end a turn, the template."""
        self._pieces, self.special, self.control = pieces, special, control
        self.vocab_size = len(self._pieces)
        turn_ends = [special[t] for t in END_OF_TURN if t in special]
        if eos_id is None:
            if not turn_ends:
                raise ValueError("the tokenizer names no eos token and has none of " + ", ".join(END_OF_TURN))
            eos_id = turn_ends[0]
        self.bos_id = bos_id
        self.eos_id: int = eos_id
        self.add_bos_token = add_bos_token  # what the checkpoint asks for on plain (non-chat) prompts
        self.stop_token_ids = {eos_id, *extra_stops, *turn_ends}
        self.chat_template = chat_template or (GEMMA3_TEMPLATE if "<start_of_turn>" in special else CHATML_TEMPLATE)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ranks = (
            self._encode_dropping_absent(text)
            if self._absent and self._absent.search(text)
            else self._enc.encode(text, allowed_special="all")
        )
        ids = self._rank_to_id[ranks]
        ids = ids[ids >= 0].tolist()
        return [self.bos_id, *ids] if add_bos and self.bos_id is not None else ids

    def _encode_dropping_absent(self, text: str) -> list[int]:
        ranks: list[int] = []
        for i, chunk in enumerate(self._specials.split(text) if self._specials else [text]):
            if i % 2:
                ranks.append(self._special_ranks[chunk])
                continue
            for word in self._words.finditer(chunk):
                # Dropping them leaves text that the pattern splits into this same one word again.
                ranks += self._enc.encode_ordinary(self._absent.sub("", word.group()))
        return ranks

    def decode_bytes(self, ids: list[int]) -> bytes:
        return b"".join(self._pieces[i] for i in ids if 0 <= i < self.vocab_size)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.control]
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    @cached_property
    def _template(self) -> jinja2.Template:
        return compile_chat_template(self.chat_template)

    def with_chat_template(self, template: str) -> "Tokenizer":
        """A copy that renders chats with this Jinja template (read_chat_template's)."""
        tok = copy.copy(self)
        tok.__dict__.pop("_template", None)  # compiled lazily from chat_template
        tok.chat_template = template
        return tok

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> list[int]:
        if not (isinstance(messages, list) and messages and all(map(_is_message, messages))):
            raise ValueError("a conversation is a non-empty list of {'role': str, 'content': str} messages")
        names = {"bos_token": self.bos_id, "eos_token": self.eos_id}
        tokens = {k: self.decode([i]) for k, i in names.items() if i is not None}
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]  # as transformers does
        try:
            text = self._template.render(
                messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **tokens
            )
        except Exception as e:  # the template refuses the conversation (raise_exception), or breaks on it
            raise ValueError(f"cannot apply the chat template: {e}") from e
        # transformers tokenizes the rendered chat without adding BOS: templates that want one write it.
        return self.encode(text)


def _is_message(m) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece BPE vocabulary from a GGUF (Gemma's: '▁' for spaces, byte fallback, no merges listed), run by
    Hugging Face tokenizers, built as transformers builds it from the same file so that the ids are its ids: token
    texts of spaces alone respelled with '▁', merges recovered from the vocabulary in the file's order, control
    tokens (type 3) and user-defined ones (type 4) matched whole."""

    def __init__(
        self,
        tokens: list[str],
        types: list[int],
        bos_id: int | None,
        eos_id: int | None,
        add_bos_token: bool,
        chat_template: str | None,
    ):
        from tokenizers import AddedToken, decoders, normalizers, pre_tokenizers
        from tokenizers import Tokenizer as Backend
        from tokenizers.models import BPE

        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = []  # transformers' generate_merges, its scores the file's order
        for piece, i in vocab.items():  # a token's merges rank by its id, then by the longer left part
            merges += [
                (i, -k, piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab
            ]
        merges.sort(key=lambda m: m[:2])
        unk = tokens[3] if len(tokens) > 3 and tokens[3] == "<unk>" else None
        self._backend = Backend(BPE(vocab, [m[2:] for m in merges], fuse_unk=True, unk_token=unk, byte_fallback=True))
        self._backend.normalizer = normalizers.Replace(" ", "\u2581")
        self._backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        self._backend.decoder = decoders.Sequence(
            [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        )
        self._backend.add_special_tokens(
            [AddedToken(t, normalized=False, special=True) for t, kind in zip(tokens, types) if kind == 3]
        )
        self._backend.add_tokens(
            [AddedToken(t, normalized=False, special=False) for t, kind in zip(tokens, types) if kind == 4]
        )
        byte = re.compile(r"<0x([0-9A-F]{2})>")
        pieces = [
            bytes([int(m.group(1), 16)])
            if kind == 6 and (m := byte.fullmatch(t))
            else t.replace("\u2581", " ").encode()
            for t, kind in zip(tokens, types)
        ]
        self._set_ids(
            pieces,
            {t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind in (3, 4)},
            {i for i, kind in enumerate(types) if kind == 3},
            bos_id,
            eos_id,
            add_bos_token,
            chat_template,
            (),
        )

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self._backend.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos and self.bos_id is not None else ids


def _raise_template_error(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def compile_chat_template(template: str) -> jinja2.Template:
    """A chat template compiled in the environment transformers renders it in, so that it gives the same text."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def read_chat_template(path: str) -> str:
    """The Jinja chat template in the file at path, compiled once to check it (ValueError if it cannot be)."""
    try:
        with open(path, encoding="utf-8") as f:
            template = f.read()
        if not template.strip():
            raise ValueError("the file is empty")
        compile_chat_template(template)
    except (OSError, ValueError, jinja2.TemplateSyntaxError) as e:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"chat template {path}: {e}") from None
    return template


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' version: unlike Jinja's own, it does not HTML-escape, which would change the prompt.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _merge_ranks(vocab: dict[bytes, int], merges: list[tuple[bytes, bytes]]) -> tuple[dict[bytes, int], np.ndarray]:
    """tiktoken ranks for a BPE given as a merges list, and the table from rank to real id. tiktoken merges the
    adjacent pair whose concatenation has the lowest rank; HF merges the pair listed first. Ranking each token by
    the merge that makes it makes the two agree. All 256 bytes need a rank; one the vocabulary lacks maps to -1."""
    ranks = {bytes([b]): b for b in range(256)}
    for left, right in merges:
        ranks.setdefault(left + right, len(ranks))
    return ranks, np.array([vocab.get(piece, -1) for piece in ranks], dtype=np.int64)


def _from_gguf(path: str) -> Tokenizer:
    fields = read_gguf(path).fields

    def get(key: str, default=None):
        return fields[key].contents() if key in fields else default

    if get("tokenizer.ggml.model") == "llama" and get("general.architecture") == "gemma3":
        return SentencePieceTokenizer(
            get("tokenizer.ggml.tokens"),
            get("tokenizer.ggml.token_type"),
            get("tokenizer.ggml.bos_token_id"),
            get("tokenizer.ggml.eos_token_id"),
            bool(get("tokenizer.ggml.add_bos_token", True)),
            get("tokenizer.chat_template"),
        )
    if get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(
            f"{path}: tokenizer.ggml.model {get('tokenizer.ggml.model')!r} is not supported, "
            "only byte-level BPE ('gpt2') and Gemma's SentencePiece ('llama')"
        )
    pre = get("tokenizer.ggml.pre", "gpt2")
    if pre not in GGUF_PATTERNS:
        raise ValueError(f"{path}: pre-tokenizer {pre!r} is not supported (known: {sorted(GGUF_PATTERNS)})")
    tokens = get("tokenizer.ggml.tokens")
    types = get("tokenizer.ggml.token_type") or [1] * len(tokens)
    # 3 is control (<|im_end|>), 4 user-defined (<think>): both are matched whole in text, only control is skipped.
    special = {t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind in (3, 4)}
    vocab = {_token_bytes(t): i for i, t in enumerate(tokens) if t not in special}
    merges = [tuple(_token_bytes(p) for p in m.split(" ", 1)) for m in get("tokenizer.ggml.merges", [])]
    stops = tuple(i for i in (get("tokenizer.ggml.eot_token_id"), get("tokenizer.ggml.eom_token_id")) if i is not None)
    return Tokenizer(
        vocab,
        merges,
        GGUF_PATTERNS[pre],
        special,
        {i for i, kind in enumerate(types) if kind == 3},
        get("tokenizer.ggml.bos_token_id"),
        get("tokenizer.ggml.eos_token_id"),
        bool(get("tokenizer.ggml.add_bos_token", False)),
        get("tokenizer.chat_template"),
        stops,
    )


def byte_tokenizer(vocab_size: int) -> Tokenizer:
    """The tokenizer of a model with random weights (--dummy-weights), which needs no file: every byte
    is a token (ids 0-255), then ChatML's specials. The ids past them, up to the model's vocab_size, each
    decode to one printable ASCII character (never produced by encode), so every token streams text."""
    special = {t: 256 + i for i, t in enumerate(("<|endoftext|>", "<|im_start|>", "<|im_end|>"))}
    tok = Tokenizer(
        {bytes([b]): b for b in range(256)},
        [],
        GPT2_PATTERN,
        special,
        set(special.values()),
        None,
        special["<|endoftext|>"],
    )
    tok._pieces += [bytes([33 + i % 94]) for i in range(tok.vocab_size, vocab_size)]
    tok.vocab_size = len(tok._pieces)
    return tok


def _hf_pattern(pre: dict | None) -> str:
    steps = pre["pretokenizers"] if pre and pre["type"] == "Sequence" else [pre or {"type": None}]
    kinds = [s["type"] for s in steps]
    split, last = steps[0], steps[-1]
    if kinds[-1] == "ByteLevel" and not last.get("add_prefix_space", False):
        if kinds == ["ByteLevel"] and last.get("use_regex", True):
            return GPT2_PATTERN
        if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and last.get("use_regex", True):
            return GPT2_DIGITS_PATTERN
        if (
            kinds == ["Split", "ByteLevel"]
            and "Regex" in split["pattern"]
            and split.get("behavior") == "Isolated"
            and not split.get("invert")
            and not last.get("use_regex", True)
        ):
            return split["pattern"]["Regex"]
    raise ValueError(
        f"unsupported pre_tokenizer {kinds}: expected ByteLevel, Digits+ByteLevel or Split(Regex)+ByteLevel"
    )


def _hf_adds_bos(tokenizer_json: dict, config: dict) -> bool:
    if "add_bos_token" in config:
        return bool(config["add_bos_token"])
    post = tokenizer_json.get("post_processor") or {}
    steps = post.get("processors", []) if post.get("type") == "Sequence" else [post]
    return any(s.get("type") == "TemplateProcessing" and "SpecialToken" in s["single"][0] for s in steps)


def _read(path: str) -> str | None:
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()


def _from_hf(directory: str) -> Tokenizer:
    tj = json.loads(_read(os.path.join(directory, "tokenizer.json")))
    config = json.loads(_read(os.path.join(directory, "tokenizer_config.json")) or "{}")
    model = tj["model"]
    if model.get("type") != "BPE" or model.get("byte_fallback") or (tj.get("decoder") or {}).get("type") != "ByteLevel":
        raise ValueError(
            f"{directory}/tokenizer.json: only byte-level BPE is supported "
            f"(model {model.get('type')}, decoder {(tj.get('decoder') or {}).get('type')})"
        )
    pattern = _hf_pattern(tj.get("pre_tokenizer"))
    added = tj.get("added_tokens", [])
    special = {a["content"]: a["id"] for a in added}
    vocab = {_token_bytes(t): i for t, i in model["vocab"].items() if t not in special}
    merges = [tuple(_token_bytes(p) for p in (m.split(" ", 1) if isinstance(m, str) else m)) for m in model["merges"]]

    def token_id(key: str) -> int | None:
        token = config.get(key)
        return special.get(token["content"] if isinstance(token, dict) else token)

    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one is for plain chat
        template = next((t["template"] for t in template if t["name"] == "default"), None)
    if template is None:  # newer transformers saves it beside the config
        template = _read(os.path.join(directory, "chat_template.jinja"))
    return Tokenizer(
        vocab,
        merges,
        pattern,
        special,
        {a["id"] for a in added if a.get("special")},
        token_id("bos_token"),
        token_id("eos_token"),
        _hf_adds_bos(tj, config),
        template,
    )


def load_tokenizer(path: str) -> Tokenizer:
    """Tokenizer from a .gguf file or a Hugging Face directory (tokenizer.json)."""
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return _from_gguf(path)
        raise ValueError(f"{path}: expected a .gguf file or a directory")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no tokenizer at {path}")
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        raise FileNotFoundError(f"{path} has no tokenizer.json (a Hugging Face tokenizer)")
    return _from_hf(path)


class IncrementalDetokenizer:
    """Token ids in, text out as soon as it is final: whole UTF-8 characters only, and never a tail
    that could still turn out to begin a stop string (that text must not reach the client)."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skipped = tokenizer.control if skip_special_tokens else set()
        self.stop = list(stop or [])
        self.stopped: str | None = None  # the stop string found, once one is
        self.text = ""
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")  # keeps a split character's bytes
        self._held = ""
        self._max_hold = max((len(s) for s in self.stop), default=1) - 1

    def feed(self, token_id: int, stops_armed: bool = True) -> str:
        """The text token_id lets out. Unarmed (before a request's min_tokens), stop strings are not looked
        for yet, but text that could begin one is still held back."""
        if self.stopped or token_id in self.skipped:
            return ""
        return self._take(self._utf8.decode(self.tokenizer.decode_bytes([token_id])), armed=stops_armed)

    def flush(self) -> str:
        """The rest, at the end (a character cut short becomes U+FFFD), up to a stop string if it holds one."""
        return "" if self.stopped else self._take(self._utf8.decode(b"", final=True), final=True)

    def _take(self, text: str, final: bool = False, armed: bool = True) -> str:
        self._held += text
        # Released text never holds a stop string's start, so a stop string can only begin in the held text.
        hits = [(i, s) for s in self.stop if (i := self._held.find(s)) >= 0] if armed else []
        if hits:
            at, self.stopped = min(hits)
            return self._release(at)
        return self._release(len(self._held) - (0 if final else self._stop_prefix_len()))

    def _stop_prefix_len(self) -> int:
        for n in range(min(len(self._held), self._max_hold), 0, -1):
            if any(s.startswith(self._held[-n:]) for s in self.stop):
                return n
        return 0

    def _release(self, n: int) -> str:
        out, self._held = self._held[:n], self._held[n:]
        self.text += out
        return out
