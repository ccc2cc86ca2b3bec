"""cli.ArgumentParser, as serve.py, bench.py and bench_ab.py use it: vLLM's underscore spellings taken, and a
mistyped flag answered with the usage line, the flag it likely meant, and --help."""

import pytest

import bench
import serve
from benchmarks import bench_ab
from cli import ArgumentParser


def refusal(main, argv: list[str], capsys) -> list[str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    return err.splitlines()


@pytest.mark.parametrize(
    "main, prog",
    [(serve.main, "serve.py"), (bench.main, "bench.py"), (lambda argv: bench_ab.main([".", *argv]), "bench_ab.py")],
)
def test_an_unknown_flag_gets_usage_did_you_mean_and_help(main, prog, capsys):
    # llama.cpp's and TGI's name (with its value attached: serve.py takes a lone word as its MODEL, as vLLM does)
    *usage, error = refusal(main, ["--max-batch-size=8"], capsys)
    assert usage[0].startswith(f"usage: {prog} ") and error == (
        f"{prog}: error: unrecognized arguments: --max-batch-size=8 (did you mean --max-num-seqs?); see {prog} --help"
    )
    *_, error = refusal(main, ["--max-nun-seqs=4", "--num_kv_blcks", "9"], capsys)  # misspelt, one with underscores
    assert "(did you mean --max-num-seqs and --num-kv-blocks?)" in error, error
    *_, error = refusal(main, ["--zzz"], capsys)  # nothing close: no guess
    assert error == f"{prog}: error: unrecognized arguments: --zzz; see {prog} --help"


def test_usage_names_the_positionals_or_the_parsers_own(capsys):
    assert (
        refusal(lambda argv: bench_ab.main(["."] + argv), ["--bogus"], capsys)[0]
        == "usage: bench_ab.py [options] other"
    )
    assert refusal(bench.main, ["--bogus"], capsys)[0].startswith("usage: bench.py --base-url ")  # bench's usage=


def test_another_servers_name_is_suggested_only_where_ours_exists(capsys):
    p = ArgumentParser(prog="p")
    p.add_argument("--port")
    assert (
        refusal(p.parse_args, ["--max-batch-size", "1"], capsys)[-1]
        == "p: error: unrecognized arguments: --max-batch-size 1; see p --help"
    )


def test_underscores_are_dashes_in_flag_names_only():
    p = ArgumentParser()
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--name")
    p.add_argument("--no-flag", action="store_true")
    p.add_argument("-x")
    args = p.parse_args(["--max_num_seqs=3", "--name", "a_b", "--no_flag", "-x", "c_d"])
    assert (args.max_num_seqs, args.name, args.no_flag, args.x) == (3, "a_b", True, "c_d")


def test_a_bad_value_is_still_one_line(capsys):
    lines = refusal(serve.main, ["--max_num_seqs", "x"], capsys)
    assert lines == ["serve.py: error: argument --max-num-seqs: invalid int value: 'x'"]


@pytest.mark.parametrize("main, prog", [(serve.main, "serve.py"), (bench.main, "bench.py")])
def test_a_flag_that_cannot_act_alone_is_refused_with_what_to_add(main, prog, capsys):
    *_, error = refusal(main, ["--prefix-cache-isolation"], capsys)
    assert error == (
        f"{prog}: error: --prefix-cache-isolation acts on the prefix cache: add --enable-prefix-caching"
    ), error
