"""`--chat-template`: the Reasoner's chat template in place of the checkpoint's, read as vLLM reads the flag.

The value is a file path, or the template itself in one line: a path that cannot be opened is an error unless
the text holds `{`, `}` or a newline (then it is the template, its backslash escapes such as `\\n` decoded, as
vLLM's `load_chat_template` does). The template must parse as Jinja (checked before the model loads); the
Reasoner then renders one plain conversation with it and stops the start if that fails
(`ChatPromptBuilder.check_template`). Images and videos need the template to write Qwen3-VL's
`<|vision_start|><|image_pad|><|vision_end|>` placeholders for image parts (and the video pad for videos), as
the checkpoint's does: a request whose rendered prompt lacks them is a 400. Imports no torch.
"""

from __future__ import annotations

import codecs
from pathlib import Path

FLAG = "--chat-template"
JINJA_CHARS = "{}\n"
"""A value holding one of these is a template when it is no readable file (vLLM's rule)."""


def load_chat_template(value: str) -> str:
    """The template `value` names or is (ValueError naming the flag: an unreadable path, an empty template,
    Jinja syntax errors)."""
    try:
        text = Path(value).read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:  # (ValueError: a NUL byte in the path, or not UTF-8 text)
        if not any(c in value for c in JINJA_CHARS):
            raise ValueError(
                f"{FLAG}: the supplied chat template ({value}) looks like a file path, but it failed to be "
                f"opened. Reason: {exc}"
            ) from None
        text = codecs.decode(value, "unicode_escape")
    if not text.strip():
        raise ValueError(f"{FLAG}: the chat template is empty")
    check_syntax(text)
    return text


def check_syntax(text: str) -> None:
    """ValueError naming the flag and line when `text` is no Jinja template (transformers renders chat templates
    in a sandboxed Jinja environment with the loop controls extension)."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    try:
        env.parse(text)
    except TemplateSyntaxError as exc:
        raise ValueError(
            f"{FLAG}: the chat template is not valid Jinja (line {exc.lineno}): {exc.message}"
        ) from None
