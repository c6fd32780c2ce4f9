"""`worldserve chat [MODEL] [--message TEXT]`: the Reasoner in this process, no server.

With `--message` it answers once (streaming the reply to stdout) and exits; without, it reads one user turn
per line from stdin and keeps the conversation (an empty line or end of input ends it). `--image F` /
`--video F` (repeatable) attach media to the first user turn, as `image_url` / `video_url` parts would
(videos sampled at 2 fps as Qwen3-VL's processor does). Sampling flags are the chat completion fields; a
flag left out takes the checkpoint's generation_config.json value where it sets one (as serve's
--generation-config auto; its min_p, repetition_penalty and eos_token_id too), else NVIDIA's suggested
temperature 0.7, top_p 0.8, top_k 20, presence_penalty 1.5 and 512 completion tokens (--temperature 0 for
greedy). Bad input fails with the flag named, exit code 2. Token counts and speed go to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worldserve.chat_params import ChatMessage, ChatParams, ChatPart, VideoSampling
from worldserve.commands.cli_inputs import MAX_MEDIA_FILE_BYTES, read_input, text_arg
from worldserve.config import ModelConfig, ParallelConfig
from worldserve.config_flags import add_config_arguments, config_from_args, none_or
from worldserve.config_values import TokenCount, int64_seed
from worldserve.params import ParamError
from worldserve.sampling.chat_defaults import NEUTRAL, ChatDefaults

if TYPE_CHECKING:
    from worldserve.runner.reasoner import Reasoner


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model", nargs="?", default=None, help="folder or HF repo id (default: embedded tiny model)"
    )
    p.add_argument("--message", type=text_arg, default=None, help="answer this one user message and exit")
    p.add_argument("--system", type=text_arg, default=None, help="a system message")
    p.add_argument("--image", type=Path, action="append", default=[], help="image for the first turn")
    p.add_argument("--video", type=Path, action="append", default=[], help="video for the first turn")
    # (left out: the checkpoint's generation_config.json value where it sets one, as serve's, else NVIDIA's)
    p.add_argument("--max-tokens", type=int, default=None,
                   help="completion tokens a turn (default: the generation config's max_new_tokens, else 512)")  # fmt: skip
    p.add_argument("--temperature", type=float, default=None,
                   help="0: greedy (default: the generation config's, else 0.7)")  # fmt: skip
    p.add_argument("--top-p", type=float, default=None, help="default: the generation config's, else 0.8")
    p.add_argument("--top-k", type=int, default=None,
                   help="-1 or 0: off (default: the generation config's, else 20)")  # fmt: skip
    p.add_argument("--presence-penalty", type=float, default=None, help="default 1.5")
    p.add_argument(
        "--seed", type=none_or(int64_seed), default=None, help="sampling seed (default: random; None: random)"
    )
    p.add_argument("--max-model-len", type=TokenCount, default=TokenCount(), metavar="N",
                   help="context length (prompt + completion), as serve's: 32768, 32k (32000), 32K, auto "
                   "(default: 32768)")  # fmt: skip
    # serve's flags of the same name (config.py)
    add_config_arguments(p, ModelConfig, only=("revision", "device", "dtype", "enforce_eager"))
    add_config_arguments(p, ParallelConfig, only=("enable_layerwise_offload",))


def media_parts(images: list[Path], videos: list[Path]) -> tuple[ChatPart, ...]:
    """The decoded --image / --video files as chat parts; ParamError naming the flag when one is unreadable."""
    from worldserve.media.image import decode_image
    from worldserve.media.processor_cache import content_key
    from worldserve.media.video_input import decode_chat_video

    parts = []
    for flag, paths in (("--image", images), ("--video", videos)):
        for path in paths:
            data = read_input(path, flag, MAX_MEDIA_FILE_BYTES)  # (read_bytes had no bound: /dev/zero)
            if flag == "--image":
                image = decode_image(data, param=flag)  # (its key: later turns reuse its resized patches)
                parts.append(ChatPart(type="image", image=image, media_key=content_key(data)))
            else:
                parts.append(
                    ChatPart(type="video", video=decode_chat_video(data, VideoSampling(), param=flag))
                )
    return tuple(parts)


SUGGESTED = {"max_tokens": 512, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "presence_penalty": 1.5}
"""The sampling flags' values when left out and the checkpoint's generation_config.json does not set them
(NVIDIA's suggested Reasoner settings; 512 completion tokens a turn)."""


def turn_params(
    args: argparse.Namespace, messages: list[ChatMessage], defaults: ChatDefaults = NEUTRAL
) -> ChatParams:
    """A turn's params: each sampling flag given, else what the checkpoint's generation config (`defaults`)
    sets, else SUGGESTED. The config's max_new_tokens is a bound, as serve takes it: the room the context
    leaves bounds it further without an error (--max-tokens past the room is one)."""

    def pick(name: str) -> Any:
        if getattr(args, name) is not None:
            return getattr(args, name)
        return getattr(defaults, name) if name in defaults.given else SUGGESTED[name]

    sampling = {name: pick(name) for name in SUGGESTED if name != "max_tokens"}
    # a budget left out (the config's, else SUGGESTED's 512) is the bound of a request that sends none, as
    # serve's: the room a short --max-model-len leaves cuts it (it was sent, and refused naming --max-tokens)
    sent = args.max_tokens
    bound = defaults.budget(sent)
    if sent is None and "max_tokens" not in defaults.given:
        suggested = int(SUGGESTED["max_tokens"])
        bound = suggested if bound is None else min(bound, suggested)
    return ChatParams(
        messages=tuple(messages), **sampling, max_tokens=sent, max_tokens_bound=bound,
        seed=args.seed, min_p=defaults.min_p, repetition_penalty=defaults.repetition_penalty,
    ).validate()  # fmt: skip


def run(args: argparse.Namespace) -> int:
    try:
        if args.max_model_len < 2:  # checked before loading (the K/V pool refused it, naming no flag)
            raise ParamError("--max-model-len", f"must be >= 2, got {args.max_model_len}")
        media = media_parts(args.image, args.video)
        messages = [] if args.system is None else [ChatMessage(role="system", content=args.system)]
        # the flags fail before loading (the message too; stdin turns come later)
        first = args.message if args.message is not None else "(stdin)"
        turn_params(args, [*messages, ChatMessage(role="user", content=first)])
    except ParamError as e:
        print(f"worldserve chat: error: {_said(e, args)}", file=sys.stderr)
        return 2
    loaded = _load(args)
    if loaded is None:
        return 2
    reasoner, defaults = loaded
    turns = [args.message] if args.message is not None else _stdin_turns()
    try:
        for text in turns:
            content = (*media, ChatPart(type="text", text=text)) if media else text
            media = ()
            messages.append(ChatMessage(role="user", content=content))
            reply = _answer(reasoner, turn_params(args, messages, defaults))
            messages.append(ChatMessage(role="assistant", content=reply))
    except ParamError as e:
        print(f"worldserve chat: error: {_said(e, args)}", file=sys.stderr)
        return 2
    return 0


SAMPLING_FLAGS = (*SUGGESTED, "seed")
"""ChatParams fields set by the flag of the same name (--max-tokens ...)."""


PROMPT_FIELDS = ("input_tokens", "messages")
"""The fields a context refusal names for the conversation itself (worldserve/context_limits.py: vLLM's
`input_tokens` for a prompt and budget past the context, `messages` for a text past its byte bound)."""


def _said(e: ParamError, args: argparse.Namespace) -> str:
    """The error as a line, named by the flag that set the field (ChatParams names the API's fields): a
    refusal of the conversation's length names --message (or the stdin turn), and so does a budget refusal
    when --max-tokens was left out (no room left for the default one)."""
    about_prompt = e.param in PROMPT_FIELDS or (e.param == "max_tokens" and args.max_tokens is None)
    if about_prompt:
        name = "--message" if args.message is not None else "stdin turn"
    else:
        name = "--" + e.param.replace("_", "-") if e.param in SAMPLING_FLAGS else e.param
    return f"{name}: {e.message}"


def _stdin_turns() -> Iterator[str]:
    """The user turns typed on stdin, one a line, to the first empty line or the end (a closed stdin: none)."""
    if sys.stdin is None:  # (started with stdin closed: `<&-`, as the end of input)
        return
    while True:
        if sys.stdin.isatty():
            print("> ", end="", file=sys.stderr, flush=True)
        try:  # bytes that are not UTF-8: a decode error, or lone surrogates (the tokenizer's traceback before)
            line = sys.stdin.readline()
            line.encode("utf-8")
        except (UnicodeDecodeError, UnicodeEncodeError):
            raise ParamError("message", "a stdin line is not valid UTF-8 text") from None
        if not line.strip():
            return
        yield line.rstrip("\r\n")  # (a Windows line's \r went to the model)


def _load(args: argparse.Namespace) -> tuple[Reasoner, ChatDefaults] | None:
    """(the Reasoner on the checkpoint's transformer, the sampling defaults of its generation_config.json, as
    serve's --generation-config auto reads them), or None after printing why it cannot load."""
    import torch

    from worldserve.models.cosmos3.prompt import PromptEncoder
    from worldserve.runner.devices import check_device, default_device, default_dtype
    from worldserve.runner.reasoner import Reasoner
    from worldserve.runner.video_pipeline import load_configured_transformer
    from worldserve.weights.checkpoint import read_layout, resolve_model
    from worldserve.weights.load_lock import model_loads

    try:  # serve's checks of the same flags, before the checkpoint is resolved (an HF id may download it)
        model = config_from_args(ModelConfig, args)
        offload = config_from_args(ParallelConfig, args).enable_layerwise_offload
        check_device(model.device)
    except ValueError as e:
        print(f"worldserve chat: error: {e}", file=sys.stderr)
        return None
    root = resolve_model(model.model, model.revision)
    # (a broken tokenizer, template or config: one line naming it, before any weight)
    layout = read_layout(root)
    media = [flag for flag, given in (("--image", args.image), ("--video", args.video)) if given]
    if media and "vision_encoder" not in layout.components:  # (it was "messages: ..." after the load)
        print(f"worldserve chat: error: {media[0]}: this checkpoint has no vision_encoder/ to read images and "
              "videos with", file=sys.stderr)  # fmt: skip
        return None
    if model.model is None:
        print(f"using the embedded tiny random checkpoint {root}: its replies are noise", file=sys.stderr)
    kernels = model.kernel_options(enable_layerwise_offload=offload)
    device = torch.device(model.device) if model.device else default_device()
    dtype = getattr(torch, model.dtype) if model.dtype else default_dtype(device)
    try:  # the transformer and the tokenizer only: no VAEs, nothing of video generation
        kernels.check(device, dtype)
        with model_loads("the Reasoner's transformer"):  # (as every load: weights/load_lock.py)
            transformer = load_configured_transformer(root, dtype, device, kernels)
        defaults = ChatDefaults.load("auto", root)  # (its eos_token_id ends chats too, as serve's)
        reasoner = Reasoner.from_pretrained(root, transformer, PromptEncoder.from_pretrained(root).tokenizer,
                                            max_model_len=args.max_model_len, max_num_seqs=1,
                                            enforce_eager=model.enforce_eager, sampling_defaults=defaults,
                                            chat_sm_margin=0)  # no video here to leave SMs to  # fmt: skip
    except ValueError as e:
        print(f"worldserve chat: error: {e}", file=sys.stderr)
        return None
    if device.type == "cuda":
        reasoner.warm_up()
    return reasoner, defaults


def _answer(reasoner: Reasoner, params: ChatParams) -> str:
    """Stream one reply to stdout; its text."""
    t0 = time.perf_counter()
    session = reasoner.start(params)
    t1, text = time.perf_counter(), []
    while session.finish_reason is None:
        delta = session.step()
        text.append(delta.text)
        print(delta.text, end="", flush=True)
    print()
    took = time.perf_counter() - t1
    print(f"[{session.prompt_tokens} prompt + {session.completion_tokens} completion tokens, "
          f"{session.finish_reason}; prefill {(t1 - t0) * 1e3:.0f} ms, "
          f"{session.completion_tokens / max(took, 1e-9):.1f} tok/s]", file=sys.stderr)  # fmt: skip
    return "".join(text)
