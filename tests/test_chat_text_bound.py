"""TextSizeBound (models/cosmos3/prompt.py), the byte-count refusal of chat, completion and video prompts: on
the checkpoint's tokenizer (byte-level BPE behind NFC, as Qwen's) no text, however adversarial, has more bytes
than its token count times `bytes_per_token`, so a refusal by bytes is never wrong; tokenizers whose parts can
fold unboundedly many bytes into one token (or none) get no bound at all.
"""

from __future__ import annotations

import random
import unicodedata

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from worldserve.models.cosmos3.prompt import TextSizeBound, text_dropper


@pytest.fixture(scope="module")
def tokenizer(tiny_ckpt):
    return AutoTokenizer.from_pretrained(str(tiny_ckpt / "text_tokenizer"))


def _adversarial_texts(tokenizer) -> dict[str, str]:
    """Texts that pack the most bytes into each token: the longest vocabulary entries, special tokens,
    decomposed characters that NFC composes (fewer bytes after normalising), 4-byte characters."""
    vocab = tokenizer.get_vocab()
    longest = sorted(vocab, key=lambda t: -len(t.encode()))[:20]
    as_text = [tokenizer.convert_tokens_to_string([t]) for t in longest]
    rng = random.Random(0)
    hangul = "".join(unicodedata.normalize("NFD", chr(0xAC00 + rng.randrange(11172))) for _ in range(3000))
    return {
        "longest entries": "".join(rng.choice(as_text) for _ in range(3000)),
        "special tokens": "<|im_start|><|vision_start|><|video_pad|>" * 1000,
        "decomposed hangul": hangul,  # 9 bytes a syllable, 3 after NFC
        "combining marks": ("a\u0308\u0301" + "\u1fb7\u0345") * 2000,
        "emoji": "\U0001f600\U0001f3fd" * 2000,
        "spaces": " " * 20000 + "\n" * 20000,
        "prose": "hello world, the quick brown fox " * 1000,
    }


def test_the_bound_holds_on_the_checkpoint_tokenizer(tokenizer):
    """No text packs more than bytes_per_token bytes into a token (for the margin: not even a quarter of it,
    the x4 left for normalisers), so a text over (N + 64) * bytes_per_token bytes never fits in N tokens."""
    bound = TextSizeBound(tokenizer)
    assert text_dropper(tokenizer) is None and bound.bytes_per_token is not None
    for name, text in _adversarial_texts(tokenizer).items():
        size, tokens = len(text.encode()), len(tokenizer(text, add_special_tokens=False)["input_ids"])
        assert size <= tokens * bound.bytes_per_token, name
        assert size <= tokens * bound.bytes_per_token / 4, name  # within the vocabulary's own length
        assert bound.size_over(text, tokens) is None, name  # a text's own token count always fits


def _fast(model, *, normalizer=None, pre_tokenizer=None, added=()) -> PreTrainedTokenizerFast:
    tok = Tokenizer(model)
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    tok.add_special_tokens(list(added))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _bpe(**kw) -> models.BPE:
    return models.BPE({"a": 0, " ": 1, "<unk>": 2}, [], **kw)


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: _fast(_bpe(), added=[AddedToken("<s>", lstrip=True)]), "strips whitespace"),
        (lambda: _fast(_bpe(), pre_tokenizer=pre_tokenizers.WhitespaceSplit()), "WhitespaceSplit"),
        (lambda: _fast(_bpe(), pre_tokenizer=pre_tokenizers.Sequence([pre_tokenizers.Punctuation("removed"),
                                                                      pre_tokenizers.ByteLevel()])), "removes text"),
        (lambda: _fast(_bpe(), normalizer=normalizers.BertNormalizer()), "BertNormalizer"),
        (lambda: _fast(_bpe(), normalizer=normalizers.Replace("aaaa", "a")), "Replace"),
        (lambda: _fast(_bpe(), normalizer=normalizers.Sequence([normalizers.NFC(), normalizers.Strip()])), "Strip"),
        (lambda: _fast(_bpe(unk_token="<unk>", fuse_unk=True)), "unknown"),
        (lambda: _fast(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")), "WordLevel"),
    ],
)  # fmt: skip
def test_tokenizers_that_drop_text_get_no_bound(make, reason):
    """A part that can turn unboundedly many bytes into one token, or none (whitespace swallowed or split
    away, control characters removed, unknown runs fused): no byte count proves a text cannot fit."""
    tok = make()
    assert reason in (text_dropper(tok) or "")
    bound = TextSizeBound(tok)
    assert bound.bytes_per_token is None and bound.size_over("a" + " " * 10**6, 1) is None


def test_safe_parts_keep_the_bound():
    """NFC / NFKC, a Replace that does not shorten, Prepend, an isolating Split and a non-fused unk keep it."""
    normalizer = normalizers.Sequence(
        [normalizers.NFKC(), normalizers.Replace(" ", "\u2581"), normalizers.Prepend("\u2581")]
    )
    split = pre_tokenizers.Split(" ", behavior="isolated")
    tok = _fast(_bpe(unk_token="<unk>"), normalizer=normalizer, pre_tokenizer=split)
    assert text_dropper(tok) is None and TextSizeBound(tok).size_over("a" * 10**6, 10) == 10**6
