"""`worldserve serve --help` and argparse's messages list a flag's choices without the None its "None" reads as
(`--quantization {fp8}`, not `{fp8,None}`: None is the default, said in the help, not a value to type), while
"None" is still taken as the value (vLLM's optional_type)."""

from __future__ import annotations

import argparse
import re

import pytest

from worldserve.cli import build_parser

OPTIONAL_CHOICE_FLAGS = ("--dtype", "--quantization", "--reasoning-parser", "--max-lora-rank")


def _serve_help() -> str:
    (sub,) = [a for a in build_parser(["serve"])._actions if isinstance(a, argparse._SubParsersAction)]  # noqa: SLF001
    return sub.choices["serve"].format_help()


def test_help_lists_no_none_among_choices():
    text = _serve_help()
    assert "None}" not in text and ",None" not in text and ", None" not in text
    assert "--dtype {auto,bfloat16,float16,half,float32,float}" in text
    assert "--quantization {fp8}, -q {fp8}" in text
    assert "--reasoning-parser {qwen3}" in text
    # (a choice flag whose help says nothing of its default says what leaving it out means)
    entry = re.search(r"\n  --max-lora-rank N(.*?)\n  --max-cpu-loras", text, re.S)
    assert entry is not None and "(default: none)" in " ".join(entry.group(1).split())


@pytest.mark.parametrize("flag", OPTIONAL_CHOICE_FLAGS)
def test_none_is_still_read_and_a_bad_choice_lists_no_none(flag, capsys):
    argv = ["serve", flag, "None"]
    dest = flag[2:].replace("-", "_")
    assert getattr(build_parser(argv).parse_args(argv), dest) is None
    argv = ["serve", flag, "7"]
    with pytest.raises(SystemExit):
        build_parser(argv).parse_args(argv)
    message = capsys.readouterr().err
    assert "invalid choice" in message and "None" not in message, message
