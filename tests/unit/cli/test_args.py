"""The aps command's shared parsing: one-line errors naming the flag, and every default shown."""

import argparse
import os

import pytest

from aps.cli import build_parser, main
from aps.cli._args import HelpFormatter, format_size, parse_size, size_list


def subparsers():
    parser = build_parser()
    choices = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    return sorted(choices.items())


BAD_VALUES = [
    (["bench", "--sizes", "4X"], "--sizes", "4K,64M"),
    (["bench", "--sizes", "6"], "--sizes", "multiples of 4"),
    (["bench", "--workers", "1,x"], "--workers", "1,2,4"),
    (["bench", "--seconds", "fast"], "--seconds", "a number"),
    (["bench", "--seconds", "0"], "--seconds", "> 0"),
    (["bench", "--repeats", "0"], "--repeats", "at least 1"),
    (["bench", "--transports", "udp"], "--transports", "tcp,shm"),
    (["simulate", "--speeds", "1,x"], "--speeds", "positive numbers"),
    (["simulate", "--iterations", "0"], "--iterations", "at least 1"),
    (["simulate", "--jitter", "-1"], "--jitter", ">= 0"),
    (["simulate", "--sync", "sspp:3"], "--sync", "ssp:S"),
    (["simulate", "--workers", "4", "--hetero", "uniform:1"], "--hetero", "lognormal:SIGMA"),
    (["simulate", "--workers", "many"], "--workers", "int"),
    (["status", "nowhere:x"], "address", "tcp://HOST:PORT"),
    (["status", "tcp://127.0.0.1:9", "--timeout", "0"], "--timeout", "> 0"),
    (["launch", "--workers", "2", "--step-time", "1", "--slowdown", "1,x", "train.py"], "--slowdown", "positive"),
    (["launch", "--step-time", "-1", "train.py"], "--step-time", ">= 0"),
    (["launch", "--max-frame-bytes", "4X", "train.py"], "--max-frame-bytes", "512"),
    (["compare", "--budget", "soon"], "--budget", "a number"),
    (["compare", "--target", "95"], "--target", "(0, 1]"),
    (["serve", "--port", "x"], "--port", "int"),
    (["serve", "--workers", "0"], "--workers", "at least 1"),
    (["serve", "--stream-min-bytes", "-1"], "--stream-min-bytes", "non-negative"),
]


@pytest.mark.parametrize("argv, flag, form", BAD_VALUES, ids=[" ".join(a) for a, _, _ in BAD_VALUES])
def test_a_bad_value_is_one_line_naming_the_flag(argv, flag, form, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"aps {argv[0]}: error: ") and flag in err and form in err, err


@pytest.mark.parametrize("name, parser", subparsers(), ids=lambda x: x if isinstance(x, str) else "")
def test_help_shows_every_default(name, parser):
    formatter = HelpFormatter(parser.prog)
    for action in parser._actions:
        if not action.option_strings or action.nargs == argparse.REMAINDER or isinstance(
                action, (argparse._HelpAction, argparse._StoreTrueAction, argparse._StoreConstAction)):
            continue  # flags, and what stands in for a positional argument, have nothing to default to
        text = formatter._get_help_string(action) % {"default": action.default, "prog": parser.prog}
        assert "default" in text, f"aps {name} {action.option_strings[0]}: {text!r}"


def test_the_help_formatter_adds_defaults_once():
    parser = argparse.ArgumentParser(formatter_class=HelpFormatter)
    parser.add_argument("--a", type=int, default=3, help="three")
    parser.add_argument("--b", default=[1, 2], help="two")
    parser.add_argument("--c", default=4, help="four (default 4)")
    text = parser.format_help()
    assert "three (default 3)" in text and "two (default 1,2)" in text and "(default 4) (default" not in text


def test_sizes():
    assert [parse_size(t) for t in ("512", "4K", "64M", "1.5G", "2KiB")] == [512, 4096, 64 << 20, 3 << 29, 2048]
    assert size_list("4K, 64M") == [4096, 64 << 20]
    assert [format_size(n) for n in (4096, 64 << 20, 1000, 3 << 29)] == ["4K", "64M", "1000", "1536M"]
    for bad in ("4X", "-1", "1.5", "", "K"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_simulate_with_no_arguments_runs_the_default_cluster(capsys):
    assert main(["simulate", "--iterations", "400"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("4 workers, speeds 1,1,1,3, jitter 0, 400 iterations per setting")
    assert "dssp:3:15" in out


def test_bench_writes_nothing_unless_asked(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--sizes", "4K", "--workers", "1", "--transports", "tcp", "--seconds", "0.05",
                 "--min-iters", "2", "--repeats", "1"]) == 0
    assert "x bound" in capsys.readouterr().out
    assert os.listdir(tmp_path) == []


def _error_of(argv, capsys) -> str:
    """The one-line error parsing ``argv`` ends with (parsing only: nothing is run, were it accepted)."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv, flag", [
    (["serve", "--wokers", "2"], "--workers"),
    (["serve", "--stalenes=3"], "--staleness"),
    (["status", "tcp://127.0.0.1:9", "--tokn", "x"], "--token"),
    (["checkpoint", "now", "tcp://127.0.0.1:9", "--timout", "1"], "--timeout"),
])
def test_a_misspelt_flag_is_named_by_its_subcommand_with_the_nearest_flag(argv, flag, capsys):
    err = _error_of(argv, capsys)
    prog = "aps checkpoint now" if argv[0] == "checkpoint" else f"aps {argv[0]}"
    assert err.startswith(f"{prog}: error: unrecognized arguments: "), err
    assert f"(did you mean {flag}?)" in err, err


def test_an_unknown_flag_far_from_every_flag_gets_no_guess(capsys):
    err = _error_of(["serve", "--frobnicate"], capsys)
    assert err.startswith("aps serve: error: unrecognized arguments: --frobnicate") and "did you mean" not in err


@pytest.mark.parametrize("name, parser", subparsers(), ids=lambda x: x if isinstance(x, str) else "")
def test_no_parser_accepts_a_prefix_of_a_flag(name, parser):
    assert parser.allow_abbrev is False, f"aps {name}"
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            assert all(sub.allow_abbrev is False for sub in action.choices.values()), f"aps {name}"


def test_a_prefix_of_a_flag_is_refused(capsys):
    err = _error_of(["serve", "--worker", "2"], capsys)
    assert "unrecognized arguments: --worker 2 (did you mean --workers?)" in err


def test_serve_help_lists_the_choices():
    serve = dict(subparsers())["serve"]
    text = serve.format_help()
    for flag, choices in [("--sync", "{bsp,asp,ssp,dssp,softsync}"), ("--optimizer", "{sgd,adam,adamw,delayed-nesterov}"),
                          ("--lr-staleness", "{none,inverse}")]:
        assert f"{flag} {choices}" in text, text


@pytest.mark.parametrize("argv, flag, form", [
    (["serve", "--staleness=three"], "--staleness", "expected an integer (a whole number such as 3), got 'three'"),
    (["serve", "--lr", "fast"], "--lr", "expected a number"),
    (["serve", "--sync", "fastest"], "--sync", "choose from"),
])
def test_a_bad_serve_value_says_what_it_expects(argv, flag, form, capsys):
    err = _error_of(argv, capsys)
    assert f"argument {flag}: " in err and form in err and "invalid literal" not in err, err


def test_a_bad_environment_value_says_what_it_expects():
    from aps.cli._args import config_from_args
    from aps.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=r"APS_STALENESS='three': expected an integer"):
        config_from_args(None, {"APS_STALENESS": "three"})
