"""`worldserve chat` as a user runs it (the tiny checkpoint, CPU): one message (a real subprocess), a
conversation on stdin, an image, and bad input named before the model loads (those through the same `main` in
this process, tests/cli_helpers.py)."""

from __future__ import annotations

import io
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from cli_helpers import run_cli
from PIL import Image

from worldserve.chat_params import ChatMessage, ChatParams


def _chat(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
    """`worldserve chat ARGS` in this process (tests/cli_helpers.py), `stdin` as its standard input."""
    return run_cli("chat", *args, stdin=stdin)


def test_one_message_prints_the_reasoners_reply(tiny_ckpt):
    """The streamed stdout (of a real `python -m worldserve.cli chat` subprocess, as a user starts it) is what
    the Reasoner answers in-process for the same greedy request."""
    from transformers import AutoTokenizer

    from worldserve.runner.reasoner import Reasoner
    from worldserve.weights.loader import load_transformer

    argv = [tiny_ckpt, "--message", "Hello there", "--max-tokens", 12, "--temperature", 0, "--device", "cpu"]
    out = subprocess.run([sys.executable, "-m", "worldserve.cli", "chat", *map(str, argv)],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    model = load_transformer(tiny_ckpt, dtype=torch.float32, progress=False)
    tok = AutoTokenizer.from_pretrained(str(tiny_ckpt / "text_tokenizer"))
    s = Reasoner.from_pretrained(tiny_ckpt, model, tok, max_model_len=32768).start(
        ChatParams(
            messages=(ChatMessage(role="user", content="Hello there"),), max_tokens=12, temperature=0.0
        )
    )
    text = ""
    while s.finish_reason is None:
        text += s.step().text
    assert out.stdout == text + "\n"
    assert re.search(r"\[\d+ prompt \+ 12 completion tokens, length", out.stderr)


def test_a_conversation_on_stdin_keeps_its_history(tiny_ckpt, tmp_path):
    """Two turns (the first with an image) and an empty line: two replies; the second turn's prompt holds
    the first turn and its reply."""
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 56, 3), dtype=np.uint8)).save(buf, "PNG")
    (tmp_path / "cat.png").write_bytes(buf.getvalue())
    out = _chat(tiny_ckpt, "--image", tmp_path / "cat.png", "--max-tokens", 5, "--device", "cpu", "--seed", 1,
                stdin="What is this?\nAnd then?\n\nignored\n")  # fmt: skip
    assert out.returncode == 0, out.stderr
    usage = [tuple(map(int, m)) for m in re.findall(r"\[(\d+) prompt \+ (\d+) completion", out.stderr)]
    assert len(usage) == 2 and usage[1][0] > usage[0][0] + usage[0][1]


def test_bad_input_is_named_before_loading(tmp_path):
    missing = _chat("--message", "x", "--image", tmp_path / "none.png")
    assert missing.returncode == 2 and "--image" in missing.stderr
    zero = _chat("--message", "x", "--max-tokens", 0)
    assert zero.returncode == 2 and "error: --max-tokens: " in zero.stderr
    (tmp_path / "junk.png").write_bytes(b"not an image")
    junk = _chat("--message", "x", "--image", tmp_path / "junk.png")
    assert junk.returncode == 2 and "--image" in junk.stderr and "Loading" not in junk.stderr
    for stdin in ("hi\n", ""):  # stdin turns: the flags were checked after the load, or never (exit 0)
        cold = _chat("--temperature", "-5", stdin=stdin)
        assert cold.returncode == 2 and cold.stderr.startswith("worldserve chat: error: --temperature: "), (
            cold
        )
        assert "Loading" not in cold.stderr


def test_sampling_left_out_follows_the_checkpoint_s_generation_config(tiny_copy, monkeypatch):
    """As serve's --generation-config auto: a checkpoint whose generation_config.json asks for greedy answers
    greedily (the same reply twice) within its max_new_tokens; a flag given still wins; without the file the
    flags left out are NVIDIA's suggested values."""
    import argparse
    import json

    from worldserve.commands.chat import SUGGESTED, turn_params
    from worldserve.sampling.chat_defaults import ChatDefaults

    (tiny_copy / "generation_config.json").write_text(
        json.dumps({"do_sample": False, "temperature": 0.0, "top_k": 1, "max_new_tokens": 5})
    )
    argv = [tiny_copy, "--message", "hi", "--device", "cpu"]
    first, second = _chat(*argv), _chat(*argv)
    assert first.returncode == 0 and first.stdout == second.stdout, first.stderr
    assert re.search(r"\+ 5 completion tokens, length", first.stderr), first.stderr
    defaults = ChatDefaults.load("auto", tiny_copy)
    flags = argparse.Namespace(
        seed=None,
        **dict.fromkeys(SUGGESTED),
    )
    msg = [ChatMessage(role="user", content="hi")]
    p = turn_params(flags, msg, defaults)
    assert (p.temperature, p.top_k, p.top_p, p.presence_penalty) == (0.0, 1, 0.8, 1.5)
    assert (p.max_tokens, p.max_tokens_bound) == (None, 5)  # a bound, as serve's: not a request past the room
    flags.temperature = 0.3
    assert turn_params(flags, msg, defaults).temperature == 0.3
    p = turn_params(argparse.Namespace(seed=None, **dict.fromkeys(SUGGESTED)), msg)
    # (SUGGESTED's budget too is a bound, not a max_tokens sent: test_a_budget_left_out_is_cut_by_the_room)
    assert {k: getattr(p, k) for k in SUGGESTED} == SUGGESTED | {"max_tokens": None}
    assert (p.max_tokens, p.max_tokens_bound) == (None, SUGGESTED["max_tokens"])
    # a max_new_tokens past the context is a bound the room cuts, not a refused request
    (tiny_copy / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": 40000})
    )
    roomy = _chat(tiny_copy, "--message", "hi", "--device", "cpu", "--max-model-len", "64")
    assert roomy.returncode == 0 and "completion tokens, length" in roomy.stderr, roomy.stderr


def test_a_refused_chat_is_one_line(tiny_ckpt):
    """The Reasoner's refusal (no room in the context for max_tokens) is the error line alone: a warning and
    a traceback of an empty prefill batch came before it."""
    argv = [str(tiny_ckpt), "--message", "hi", "--max-tokens", "100000", "--device", "cpu"]
    out = subprocess.run([sys.executable, "-m", "worldserve.cli", "chat", *argv],
                         capture_output=True, text=True, timeout=300)  # (a process's own log, not pytest's)  # fmt: skip
    lines = [
        line for line in out.stderr.splitlines() if line and "Loading safetensors" not in line
    ]  # (the bar)
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0].startswith(
        "worldserve chat: error: --max-tokens: max_tokens=100000 cannot be greater than"
    )


def test_a_budget_left_out_is_cut_by_the_room(tiny_ckpt):
    """--max-tokens left out (no generation config: NVIDIA's suggested 512) bounds the reply, as serve's
    default does: a --max-model-len under 512 answers within the room left (it was refused, naming the
    --max-tokens never given)."""
    out = _chat(tiny_ckpt, "--message", "hi", "--device", "cpu", "--max-model-len", 24, "--seed", 0)
    assert out.returncode == 0, out.stderr
    assert re.search(r"\[\d+ prompt \+ \d+ completion tokens, (length|stop)", out.stderr), out.stderr


def test_a_conversation_past_the_context_names_the_message(tiny_ckpt):
    """A prompt the context cannot hold is named by where its text came from (--message, or the stdin turn),
    not by vLLM's `input_tokens` field, with and without --max-tokens; --max-tokens past the context still
    names --max-tokens."""
    long = "hello there how are you today my friend"
    base = (tiny_ckpt, "--device", "cpu", "--max-model-len", 16)
    for extra in ((), ("--max-tokens", 4)):
        out = _chat(*base, "--message", long, *extra)
        assert out.returncode == 2 and "worldserve chat: error: --message: This model's maximum context length is 16" in out.stderr, out.stderr  # fmt: skip
    typed = _chat(*base, stdin=long + "\n")
    assert typed.returncode == 2 and "error: stdin turn: This model's maximum context length" in typed.stderr
    over = _chat(*base, "--message", "hi", "--max-tokens", 17)
    assert over.returncode == 2 and "error: --max-tokens: max_tokens=17 cannot be greater" in over.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize(
    ("device", "needle"), [("cuda:3", "needs CUDA GPU 3; 0 visible"), ("foo", "must be cpu, cuda or cuda:N")]
)
def test_a_device_this_machine_lacks_is_one_line_before_loading(capsys, device, needle):
    """(was a 'Torch not compiled with CUDA' / device-string traceback after the checkpoint loaded)"""
    from worldserve.cli import main

    assert main(["chat", "--device", device, "--message", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("worldserve chat: error: --device") and needle in err and "Traceback" not in err


def test_a_max_model_len_under_two_is_named_before_loading(capsys):
    """(was the K/V pool's 'needs at least 2 blocks' after the checkpoint loaded, naming no flag)"""
    from worldserve.cli import main

    assert main(["chat", "--message", "hi", "--max-model-len", "0", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err == "worldserve chat: error: --max-model-len: must be >= 2, got 0\n"
    from worldserve.cli import build_parser

    for text, tokens in (("32k", 32000), ("2K", 2048), ("auto", 32768)):  # serve's spellings
        assert build_parser(["chat"]).parse_args(["chat", "--max-model-len", text]).max_model_len == tokens


def test_a_max_model_len_past_the_checkpoint_s_context_is_refused(tiny_ckpt):
    """vLLM's check against max_position_embeddings (99,999,999,999 tried to allocate a 51 TB K/V pool)."""
    r = _chat(str(tiny_ckpt), "--message", "hi", "--max-model-len", "99999999999", "--device", "cpu")
    assert r.returncode == 2 and r.stderr.endswith(
        "--max-model-len 99999999999 is greater than the derived max_model_len 262144 (max_position_embeddings "
        f"in {tiny_ckpt / 'config.json'})\n"
    ), r.stderr


def test_text_that_is_not_utf8_is_one_line(tiny_ckpt, capsys):
    """argv and stdin bytes that are not UTF-8 reach Python as lone surrogates, which the tokenizer refused
    with a TypeError traceback after the model loaded: now argparse's error, and one line for a stdin turn
    (after the turns before it were answered)."""
    from worldserve.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["chat", "--message", "a \udcff fox", "--device", "cpu"])
    assert exit_.value.code == 2
    assert "error: argument --message: not valid UTF-8 text" in capsys.readouterr().err
    out = _chat(tiny_ckpt, "--max-tokens", "2", "--device", "cpu", stdin=b"hi\na \xff fox\n")
    err = out.stderr
    assert out.returncode == 2 and "Traceback" not in err, err
    assert err.count("completion tokens") == 1
    assert err.endswith("worldserve chat: error: message: a stdin line is not valid UTF-8 text\n")


def test_media_files_and_stdin_are_read_within_bounds(monkeypatch):
    """--image / --video are read at most MAX_MEDIA_FILE_BYTES, as generate's (read_bytes had no bound:
    --image /dev/zero ran the machine out of memory); a closed stdin is the end of the input (it was a
    traceback after the model loaded); a Windows line's \\r does not reach the model; --seed None is random."""
    from pathlib import Path

    from worldserve.cli import build_parser
    from worldserve.commands import chat
    from worldserve.params import ParamError

    monkeypatch.setattr(chat, "MAX_MEDIA_FILE_BYTES", 1 << 20)
    with pytest.raises(ParamError, match="^/dev/zero is larger than 1 MiB") as error:
        chat.media_parts([Path("/dev/zero")], [])
    assert error.value.param == "--image"
    monkeypatch.setattr("sys.stdin", None)
    assert list(chat._stdin_turns()) == []
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\r\nthere\n\n"))
    assert list(chat._stdin_turns()) == ["hi", "there"]
    assert build_parser(["chat"]).parse_args(["chat", "--seed", "None"]).seed is None


def test_a_broken_chat_template_or_component_config_is_one_line_naming_it(tiny_copy):
    """Checked with the layout before any weight loads (they were a jinja2 / transformers traceback after the
    model loaded, or "the chat template refused the messages", exit 2)."""
    (tiny_copy / "text_tokenizer" / "chat_template.jinja").write_text("{% for m in messages %}{{ m }")
    out = _chat(tiny_copy, "--message", "hi", "--max-tokens", 2)
    assert out.returncode == 1 and "chat_template.jinja: not a valid Jinja template" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "Loading" not in out.stderr


def test_media_on_a_checkpoint_without_a_vision_encoder_names_the_flag_before_loading(tiny_copy, tmp_path):
    """(it was "messages: this checkpoint has no vision_encoder/" after the transformer loaded)"""
    import shutil

    shutil.rmtree(tiny_copy / "vision_encoder")
    Image.new("RGB", (32, 24)).save(tmp_path / "a.png")
    out = _chat(tiny_copy, "--message", "hi", "--image", tmp_path / "a.png", "--max-tokens", 2)
    assert out.returncode == 2 and "error: --image: this checkpoint has no vision_encoder/" in out.stderr
    assert "Loading" not in out.stderr, out.stderr
