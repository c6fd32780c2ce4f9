"""A tiny offline Qwen-style tokenizer carrying the real Cosmos3 special tokens and a Qwen3-VL-like chat template.

Byte-level BPE like Qwen's: the 256 byte symbols (ids 0..255, in byte order), then merges learnt
deterministically from the shipped default negative prompt plus a little English (so prompts compress about
3x, as with the real tokenizer, and the default negative stays under `max_sequence_length`), then
`<|endoftext|>` and the six special tokens Cosmos3 relies on, then Qwen's text tokens <tool_call>, </tool_call>,
<think> and </think>. Saved as a transformers `Qwen2Tokenizer`, so
the same folder loads in `AutoTokenizer` (ours and diffusers').
"""

from __future__ import annotations

from pathlib import Path

from worldserve.sampling.token_bytes import bytes_to_unicode

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
TEXT_TOKENS: tuple[str, ...] = ("<tool_call>", "</tool_call>", "<think>", "</think>")
"""Qwen3-VL's added tokens that are text, not special (kept by skip_special_tokens): each one id, as in the real
vocabulary, so tool calls and thoughts are written and recognised token by token here too."""

# Qwen3-VL-Instruct's template shape: string or part-list content, media placeholders, generation prompt, and
# Qwen3's tool calling: the tools listed in a system turn, an assistant's calls as <tool_call> JSON blocks, tool
# answers as <tool_response> blocks in a user turn (a conversation without tools, tool calls or tool turns
# renders as before).
_CONTENT = (
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- elif message['content'] -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' or part['type'] == 'video_url' -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
)
CHAT_TEMPLATE = (
    "{%- if tools -%}{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}{%- set message = messages[0] -%}"
    + _CONTENT
    + "{{- '\\n\\n' -}}"
    "{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' -}}{{- tool | tojson -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' -}}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if tools and loop.first and message['role'] == 'system' -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' -}}" + _CONTENT + "{{- '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    + _CONTENT
    + "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}{%- set fn = call['function'] -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' -}}"
    "{%- if fn['arguments'] is string -%}{{- fn['arguments'] -}}{%- else -%}{{- fn['arguments'] | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


MERGE_VOCAB_SIZE = 1280
TRAINING_TEXT = (
    "A red fox runs through a snowy forest at dawn. The camera slowly pans to the right as the light changes. "
    "A person walks along the beach while waves crash on the shore, and the sound of seagulls fills the air. "
    "Describe the video. What happens in this image? The robot arm picks up the cup and places it on the table."
)


def _learn_merges() -> list[tuple[str, str]]:
    """BPE merges learnt from the default negative prompt and TRAINING_TEXT (deterministic)."""
    import json
    from importlib import resources

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    negative = json.dumps(
        json.loads(resources.files("worldserve.assets").joinpath("negative_prompt.json").read_text())
    )
    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=MERGE_VOCAB_SIZE, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    learner.train_from_iterator([negative, TRAINING_TEXT], trainer=trainer)
    merges = json.loads(learner.to_str())["model"]["merges"]
    pairs = [m.split(" ", 1) if isinstance(m, str) else m for m in merges]  # (tokenizers' two JSON forms)
    return [(left, right) for left, right in pairs]


def write_tiny_tokenizer(out_dir: Path) -> int:
    """Write the tokenizer into `out_dir`; returns its vocabulary size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import Qwen2TokenizerFast  # type: ignore[attr-defined]  # (a lazy export mypy cannot see)

    byte_map = bytes_to_unicode()
    vocab = {byte_map[b]: b for b in range(256)}
    merges = _learn_merges()
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_TOKENS])
    tok = Qwen2TokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out_dir))
    return len(tok)


def special_token_ids(tokenizer_dir: Path) -> dict[str, int]:
    """Ids of SPECIAL_TOKENS in a written tokenizer."""
    import json

    added = json.loads((tokenizer_dir / "tokenizer.json").read_text())["added_tokens"]
    return {t["content"]: t["id"] for t in added if t["content"] in SPECIAL_TOKENS}
