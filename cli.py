"""Command lines, as a vLLM user expects them: `--max_num_seqs` is `--max-num-seqs`, and a mistyped flag
gets the usage line, the closest real flag, and where the rest are listed."""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from dataclasses import fields

from config import EngineConfig

# Other servers' names for our flags (llama.cpp server, TGI), which a close spelling would not find.
KNOWN_AS = {
    "--max-batch-size": "--max-num-seqs",
    "--batch-size": "--max-num-seqs",
    "--parallel": "--max-num-seqs",
    "--ctx-size": "--max-model-len",
    "--max-total-tokens": "--max-model-len",
    "--threads": "--torch-threads",
    "--model-name": "--served-model-name",
    "--alias": "--served-model-name",
}


# vLLM's spellings of our flags' values.
VALUES = {("--dtype", "half"): "float16", ("--dtype", "float"): "float32"}


class ArgumentParser(argparse.ArgumentParser):
    def parse_known_args(self, args=None, namespace=None):
        args = [_dashed(a) for a in (sys.argv[1:] if args is None else args)]  # vLLM takes underscores too
        return super().parse_known_args(_values(args), namespace)

    def error(self, message: str):
        if not message.startswith("unrecognized arguments: "):  # a flag's value: one line says what is wrong
            self.exit(2, f"{self.prog}: error: {message}\n")
        flags = [s for action in self._actions for s in action.option_strings if s.startswith("--")]
        unknown = message.removeprefix("unrecognized arguments: ").split()
        if hints := [c for arg in unknown if arg.startswith("-") and (c := _closest(arg.split("=")[0], flags))]:
            message += f" (did you mean {' and '.join(hints)}?)"
        names = [(a.metavar or a.dest, a.nargs == "?") for a in self._actions if not a.option_strings]
        positionals = "".join(f" [{name}]" if optional else f" {name}" for name, optional in names)
        usage = self.format_usage() if self.usage else f"usage: {self.prog} [options]{positionals}\n"
        self.exit(2, f"{usage}{self.prog}: error: {message}; see {self.prog} --help\n")


def _closest(name: str, flags: list[str]) -> str | None:
    """The flag a mistyped one most likely meant: ours for another server's name, else the closest spelling."""
    if KNOWN_AS.get(name) in flags:
        return KNOWN_AS[name]
    return next(iter(difflib.get_close_matches(name, flags, 1, 0.7)), None)


def _values(args: list[str]) -> list[str]:
    """'--dtype half' and '--dtype=half' -> float16: vLLM's spellings of our flags' values."""
    out = []
    for before, arg in zip(["", *args], args):
        flag, eq, value = arg.partition("=")
        out.append(flag + eq + VALUES.get((flag, value), value) if eq else VALUES.get((before, arg), arg))
    return out


def _dashed(arg: str) -> str:
    """'--max_num_seqs=8' -> '--max-num-seqs=8'; values and single-dash flags untouched."""
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value


def speculative_config(text: str) -> dict:
    """vLLM's JSON form of the speculation knobs: '{"method": "ngram", "num_speculative_tokens": 8,
    "prompt_lookup_max": 4, "prompt_lookup_min": 2}'"""  # the --speculative-config flag's help; as EngineConfig fields
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e})") from None
    known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
    if not isinstance(spec, dict) or spec.get("method") not in ("ngram", None) or not set(spec) <= known:
        raise argparse.ArgumentTypeError(
            f'a JSON object with "method": "ngram" and any of {", ".join(sorted(known - {"method"}))}'
        )
    spec.pop("method", None)
    return spec


def add_cli_args(parser: argparse.ArgumentParser, title: str = "engine") -> None:
    """One flag per knob, vLLM-style: max_num_seqs becomes --max-num-seqs, a boolean gets --x and --no-x."""
    group = parser.add_argument_group(title)
    for f in fields(EngineConfig):
        if "help" not in f.metadata:
            continue
        flag, default = "--" + f.name.replace("_", "-"), f.default
        if isinstance(default, bool):
            group.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=f.metadata["help"] + (" (default on)" if default else ""),
            )
            continue
        group.add_argument(
            flag,
            type=f.metadata.get("type", type(default)),
            default=default,
            choices=f.metadata.get("choices"),
            help=f.metadata["help"] + ("" if default is None else f" (default {default})"),
        )
    group.add_argument("--speculative-config", type=speculative_config, help=speculative_config.__doc__)


def from_cli_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    """The config a command line asked for (None: the field's default); ValueError names a bad knob."""
    given = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if getattr(args, f.name, None) is not None}
    spec = getattr(args, "speculative_config", None) or {}
    defaults = {f.name: f.default for f in fields(EngineConfig)}
    for k, v in spec.items():  # a flag set otherwise beside the JSON: which one was meant is a guess
        if given.get(k, defaults[k]) not in (v, defaults[k]):
            flag = "--" + k.replace("_", "-")
            raise ValueError(f"{flag} {given[k]} and --speculative-config's {k} {v} disagree: give one")
    given |= spec
    config = EngineConfig(**{**given, **overrides})
    if config.prefix_cache_isolation and not config.enable_prefix_caching:  # alone it would do nothing, silently
        raise ValueError("--prefix-cache-isolation acts on the prefix cache: add --enable-prefix-caching")
    return config
