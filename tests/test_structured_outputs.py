"""Structured outputs below the HTTP layer: grammars from each kind of constraint (sampling/grammar.py), the
token masks that keep a walk through the tiny tokenizer's vocabulary inside the grammar
(sampling/token_grammar.py), and the tiny Reasoner's chats under each constraint: what they produce parses,
their logprobs are those of the masked logits (as vLLM reports them), and min_tokens does not fight a
grammar that is already complete.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from reasoner_helpers import run_to_end

from worldserve.chat_params import ChatMessage, ChatParams, StructuredOutput
from worldserve.params import ParamError
from worldserve.sampling.grammar import check, closed_objects, grammar_text
from worldserve.sampling.token_grammar import GrammarCompiler, constrain_rows

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["color", "count", "tags"],
    "additionalProperties": False,
}


def conforms(doc) -> bool:
    """`doc` satisfies SCHEMA (checked by hand: no jsonschema dependency)."""
    return (
        isinstance(doc, dict) and set(doc) == {"color", "count", "tags"} and doc["color"] in ("red", "green", "blue")
        and isinstance(doc["count"], int) and 0 <= doc["count"] <= 99 and isinstance(doc["tags"], list)
        and len(doc["tags"]) <= 3 and all(isinstance(t, str) and len(t) <= 6 for t in doc["tags"])
    )  # fmt: skip


@pytest.fixture(scope="module")
def compiler(reasoner):
    """The tiny Reasoner's grammar compiler (its LM head is wider than the tokenizer, as Qwen's is)."""
    return reasoner.grammars


def allowed(grammar) -> torch.Tensor:
    """[V] bool: the tokens `grammar` allows next (finite after its mask)."""
    return torch.isfinite(grammar.constrain(torch.zeros(grammar._vocab)))


def walk(
    compiler: GrammarCompiler, so: StructuredOutput, seed: int, max_tokens: int = 80
) -> tuple[str, bool]:
    """Draw uniformly among the tokens the grammar allows, as a model with flat logits would: (text, whether
    it ended on an end id)."""
    grammar = compiler.grammar(so)
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    for _ in range(max_tokens):
        mask = allowed(grammar)
        assert mask.shape == (compiler.vocab_size,) and mask.any()
        token = int(torch.multinomial(mask.float(), 1, generator=gen))
        if token in compiler.end_ids:
            return compiler.hf_tokenizer.decode(ids), True
        grammar.accept(token)
        ids.append(token)
    return compiler.hf_tokenizer.decode(ids), False


def test_masks_keep_a_random_walk_inside_a_json_schema(compiler):
    for seed in range(12):
        text, ended = walk(compiler, StructuredOutput(kind="json", spec=json.dumps(SCHEMA), any_whitespace=False),
                           seed, max_tokens=400)  # fmt: skip
        assert ended, text
        assert conforms(json.loads(text)), text


@pytest.mark.parametrize(
    ("so", "accepts"),
    [
        (StructuredOutput(kind="regex", spec=r"[a-c]{2,4}-[0-9]{1,3}"),
         lambda t: re.fullmatch(r"[a-c]{2,4}-[0-9]{1,3}", t)),
        (StructuredOutput(kind="choice", spec=json.dumps(["yes", "no", "été", 'say "hi"'])),
         lambda t: t in ("yes", "no", "été", 'say "hi"')),
        (StructuredOutput(kind="grammar", spec='root ::= "A" ("b" | "c")* "."'),
         lambda t: re.fullmatch(r"A[bc]*\.", t)),
        (StructuredOutput(kind="grammar", spec='start: "x" NUM\nNUM: /[0-9]+/'),
         lambda t: re.fullmatch(r"x[0-9]+", t)),
    ],
)  # fmt: skip
def test_masks_keep_a_random_walk_inside_each_kind_of_constraint(compiler, so, accepts):
    finished = 0
    for seed in range(10):
        text, ended = walk(compiler, so, seed)
        finished += ended
        if ended:
            assert accepts(text), text
    assert finished >= 5  # most walks reach an end (the regex and grammar are short)


def test_json_object_allows_an_object_and_nothing_else(compiler):
    """Any JSON object (a flat random walk rarely closes one, so a known document is fed instead): every first
    token opens an object, each token of a nested object is allowed in turn, then only the end."""
    grammar = compiler.grammar(StructuredOutput(kind="json_object", any_whitespace=False))
    firsts = allowed(grammar).nonzero()[:, 0].tolist()
    assert firsts and all(compiler.hf_tokenizer.decode([t]).startswith("{") for t in firsts)
    for token in compiler.hf_tokenizer('{"a":[1,{"b":null}],"c":"x"}', add_special_tokens=False)["input_ids"]:
        assert allowed(grammar)[token]
        grammar.accept(token)
    assert set(allowed(grammar).nonzero()[:, 0].tolist()) == set(compiler.end_ids)


def test_the_end_ids_are_allowed_only_once_the_grammar_accepts(compiler):
    grammar = compiler.grammar(StructuredOutput(kind="choice", spec='["ab"]'))
    ends = torch.tensor(compiler.end_ids)
    assert not allowed(grammar)[ends].any()
    for token in compiler.hf_tokenizer("ab", add_special_tokens=False)["input_ids"]:
        assert not allowed(grammar)[ends].any()
        grammar.accept(token)
    mask = allowed(grammar)  # the grammar is complete: only the end ids
    assert mask[ends].all() and int(mask.sum()) == len(compiler.end_ids)


def test_ids_past_the_tokenizer_are_never_allowed(compiler):
    """An LM head wider than the tokenizer (Qwen's 151,936 rows for 151,669 ids): its padding rows stay out."""
    tok = compiler.hf_tokenizer
    nano = GrammarCompiler(tok, 151936, compiler.end_ids)  # Nano's LM head (llguidance's mask: 4749 words)
    masked = constrain_rows(
        torch.zeros(2, 151936), [nano.grammar(StructuredOutput(kind="json_object")), None]
    )
    assert torch.isinf(masked[0, len(tok) :]).all() and not torch.isinf(masked[1]).any()
    wide = GrammarCompiler(tok, len(tok) + 64, compiler.end_ids)
    for so in (StructuredOutput(kind="regex", spec="(.|\n)*"), StructuredOutput(kind="json_object")):
        mask = allowed(wide.grammar(so))
        assert mask.shape == (len(tok) + 64,) and mask[: len(tok)].any() and not mask[len(tok) :].any()


def test_a_batch_is_masked_row_by_row_in_one_pass(compiler):
    """constrain_rows: each constrained row as its grammar masks it alone, the free rows untouched."""
    grammars = [compiler.grammar(StructuredOutput(kind="regex", spec="[0-9]+")), None,
                compiler.grammar(StructuredOutput(kind="choice", spec='["up", "down"]'))]  # fmt: skip
    logits = torch.randn(3, compiler.vocab_size, generator=torch.Generator().manual_seed(0))
    masked = constrain_rows(logits, grammars)
    assert torch.equal(masked[1], logits[1])
    for i in (0, 2):
        assert torch.equal(masked[i], grammars[i].constrain(logits[i]))
        assert torch.isinf(masked[i]).sum() == compiler.vocab_size - int(allowed(grammars[i]).sum())
    assert constrain_rows(logits, [None, None, None]) is logits


def test_a_token_outside_the_mask_leaves_only_the_end(compiler):
    grammar = compiler.grammar(StructuredOutput(kind="regex", spec="[0-9]+"))
    letter = compiler.hf_tokenizer("z", add_special_tokens=False)["input_ids"][0]
    grammar.accept(letter)  # logged as an error: the grammar is in its error state
    mask = allowed(grammar)
    assert set(mask.nonzero()[:, 0].tolist()) == set(compiler.end_ids)


@pytest.mark.parametrize(
    ("so", "needle"),
    [
        (StructuredOutput(kind="regex", spec="[a-", field="structured_outputs.regex"), "regex"),
        (StructuredOutput(kind="json", spec='{"type": "nonsense"}', field="guided_json"), "nonsense"),
        (StructuredOutput(kind="json", spec="[1, 2]", field="guided_json"), "JSON object"),
        (StructuredOutput(kind="grammar", spec="root ::= undefined_rule", field="structured_outputs.grammar"),
         "undefined_rule"),
        (StructuredOutput(kind="structural_tag", spec='{"structures": []}', field="response_format"), "structures"),
        (StructuredOutput(kind="structural_tag", field="response_format",
                          spec='{"type": "structural_tag", "format": {"type": "triggered_tags"}}'),
         '"format" form (xgrammar\'s newer one) is not supported'),
        (StructuredOutput(kind="structural_tag", field="response_format",
                          spec='{"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}], "triggers": ["<b"]}'),
         "triggers"),
        (StructuredOutput(kind="structural_tag", field="response_format",
                          spec='{"structures": [{"begin": "<a>", "schema": false, "end": "</a>"}], "triggers": ["<a"]}'),
         "structures[0].schema false"),
    ],
)  # fmt: skip
def test_invalid_constraints_name_their_field(so, needle):
    with pytest.raises(ParamError) as info:
        check(so)
    assert info.value.param == so.field and needle in str(info.value), str(info.value)


def test_closed_objects_and_valid_structural_tags():
    schema = {"type": "object", "properties": {"a": {"type": "object"}, "b": {"items": {"properties": {}}}}}
    closed = closed_objects(schema)
    assert (
        closed["additionalProperties"] is False and closed["properties"]["a"]["additionalProperties"] is False
    )
    assert closed["properties"]["b"]["items"]["additionalProperties"] is False
    assert closed_objects({"type": "object", "additionalProperties": True})["additionalProperties"] is True
    tag = {
        "structures": [{"begin": "<f=x>", "schema": {"type": "object"}, "end": "</f>"}],
        "triggers": ["<f="],
    }
    check(StructuredOutput(kind="structural_tag", spec=json.dumps(tag)))
    assert "%llguidance" in grammar_text(StructuredOutput(kind="structural_tag", spec=json.dumps(tag)))
    # a schema of true is any JSON document, as in a json_schema constraint (llguidance itself takes no bool)
    tag["structures"][0]["schema"] = True
    check(StructuredOutput(kind="structural_tag", spec=json.dumps(tag)))


@pytest.mark.parametrize("trigger", ["<tool_call>", "<a>"])
def test_structural_tag_triggers_of_the_form_of_a_token_are_text(compiler, trigger):
    """A trigger spelled like a special token's name (Qwen's hermes "<tool_call>", any "<a>") is the text it
    spells, as vLLM's default xgrammar backend takes it (llguidance's default looked it up among the special
    tokens: a 400 naming response_format); once the model writes it, the body follows the schema."""
    end = "</" + trigger[1:]
    tag = {"structures": [{"begin": trigger, "schema": {"type": "object", "properties": {"n": {"type": "integer"}},
                                                        "required": ["n"], "additionalProperties": False},
                           "end": end}], "triggers": [trigger]}  # fmt: skip
    so = StructuredOutput(kind="structural_tag", spec=json.dumps(tag), field="response_format")
    grammar = compiler.grammar(so)
    tok = compiler.hf_tokenizer
    assert allowed(grammar)[tok.encode("x")].all()  # free text before the trigger
    for token in tok.encode(f"Sure. {trigger}"):
        assert allowed(grammar)[token], token
        grammar.accept(token)
    after = allowed(grammar)
    assert after[tok.encode("{")[0]] and not after[tok.encode("x")].any()  # the schema's body now


def _chat(so: StructuredOutput, **kw) -> ChatParams:
    return ChatParams(messages=(ChatMessage(role="user", content="Describe it."),), structured=so, **kw)


def test_chats_follow_a_json_schema(reasoner):
    so = StructuredOutput(kind="json", spec=json.dumps(SCHEMA), any_whitespace=False)
    for seed in range(2):
        text, session = run_to_end(reasoner, _chat(so, max_tokens=300, seed=seed))
        assert session.finish_reason == "stop" and conforms(json.loads(text)), text


def test_logprobs_are_those_of_the_masked_logits(reasoner):
    """With a two-way choice, the tokens that start either word carry all the probability; the top
    alternatives past them are -inf (the API lists them at -9999)."""
    so = StructuredOutput(kind="choice", spec='["alpha", "beta"]')
    text, session = run_to_end(reasoner, _chat(so, max_tokens=20, seed=3, logprobs=True, top_logprobs=5))
    assert text in ("alpha", "beta")
    tok = reasoner.tokenizer
    starts = {
        t
        for t in range(len(tok))
        if (w := tok.decode([t])) and ("alpha".startswith(w) or "beta".startswith(w))
    }
    first = session_logprobs(reasoner, _chat(so, max_tokens=1, seed=3, logprobs=True, top_logprobs=20))
    finite = [(t, lp) for t, lp in first.top if math.isfinite(lp)]
    assert {t for t, _ in finite} == {tok.decode([t]) for t in starts}
    assert math.isclose(sum(math.exp(lp) for _, lp in finite), 1.0, rel_tol=1e-5)
    assert all(lp == float("-inf") for _, lp in first.top[len(finite) :])


def session_logprobs(reasoner, params):
    session = reasoner.start(params)
    delta = session.step()
    session.close()
    return delta.logprobs[0]


def test_min_tokens_gives_way_to_a_complete_grammar(reasoner):
    """min_tokens masks the end ids; once the grammar allows nothing else the end wins (no NaN draw)."""
    so = StructuredOutput(kind="choice", spec='["ok"]')
    text, session = run_to_end(reasoner, _chat(so, max_tokens=10, min_tokens=8, seed=0))
    assert text == "ok" and session.finish_reason == "stop"


def test_every_choice_follows_the_grammar_and_an_invalid_one_fails_the_start(reasoner):
    so = StructuredOutput(kind="regex", spec="(yes|no|maybe)!")
    params = _chat(so, max_tokens=10, seed=11)
    sessions = reasoner.start_many(params.choices(4))
    live = list(sessions)
    while live:
        deltas = reasoner.step_all(live)
        live = [s for s, d in zip(live, deltas, strict=True) if d.finish_reason is None]
    for s in sessions:
        assert re.fullmatch("(yes|no|maybe)!", reasoner.tokenizer.decode(s.token_ids)), s.token_ids
    with pytest.raises(ParamError) as info:
        reasoner.start(_chat(StructuredOutput(kind="regex", spec="(", field="guided_regex"), max_tokens=4))
    assert info.value.param == "guided_regex"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_constrained_chats_on_cuda_equal_the_cpu(tiny_ckpt, reasoner):
    """The mask unpacked on the GPU (a pinned copy of the host's bits) gives the CPU's tokens: seeded chats
    under a JSON schema, four at once, the same on both devices."""
    from worldserve.runner.reasoner import Reasoner
    from worldserve.weights.loader import load_transformer

    model = load_transformer(tiny_ckpt, dtype=torch.float32, device="cuda", progress=False)
    gpu = Reasoner.from_pretrained(tiny_ckpt, model, reasoner.tokenizer)
    so = StructuredOutput(kind="json", spec=json.dumps(SCHEMA), any_whitespace=False)
    outs = []
    for r in (reasoner, gpu):
        sessions = r.start_many(_chat(so, max_tokens=200, seed=7).choices(4))
        live = list(sessions)
        while live:
            deltas = r.step_all(live)
            live = [s for s, d in zip(live, deltas, strict=True) if d.finish_reason is None]
        outs.append([s.token_ids for s in sessions])
    assert outs[0] == outs[1]
    for ids in outs[1]:
        assert conforms(json.loads(reasoner.tokenizer.decode(ids)))


def test_grammars_deep_enough_to_overflow_a_thread_stack_compile_or_are_refused():
    """llguidance recurses once per rule of a chain: 5,000 chained Lark rules (or a 2,000-deep $ref chain)
    killed the process on an 8 MiB stack; they compile on the big-stack thread, and a spec past
    MAX_SPEC_BYTES is a 400 before any compile."""
    from worldserve.sampling.grammar import MAX_SPEC_BYTES

    chain = "start: r0\n" + "".join(f'r{i}: r{i + 1} | "x"\n' for i in range(5000)) + 'r5000: "y"\n'
    check(StructuredOutput(kind="grammar", spec=chain))
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"type": "null"}]} for i in range(2000)}
    defs["d2000"] = {"type": "integer"}
    check(StructuredOutput(kind="json", spec=json.dumps({"$ref": "#/$defs/d0", "$defs": defs})))
    with pytest.raises(ParamError, match="longer than"):
        check(StructuredOutput(kind="regex", spec="a" * (MAX_SPEC_BYTES + 1), field="guided_regex"))


def test_closed_objects_keeps_literals_and_survives_deep_nesting():
    schema = {
        "type": "object",
        "properties": {"k": {"const": {"type": "object"}, "enum": [{"properties": {}}]}},
    }
    closed = closed_objects(schema)
    assert closed["properties"]["k"]["const"] == {"type": "object"} and closed["properties"]["k"]["enum"] == [
        {"properties": {}}]  # fmt: skip
    deep = '{"type": "object", "properties": {"a": ' * 700 + '{"type": "string"}' + "}}" * 700
    try:  # compiled, or refused by Python's recursion limit or llguidance's depth limit: never a RecursionError
        check(
            StructuredOutput(
                kind="json", spec=deep, additional_properties=False, field="structured_outputs.json"
            )
        )
    except ParamError as exc:
        assert exc.param == "structured_outputs.json"


def test_thousands_of_choices_and_grammars_failing_at_their_first_token(reasoner, compiler):
    choices = [f"option {i}" for i in range(3000)]  # past the Earley row limit as one rule per choice
    text, session = run_to_end(reasoner, _chat(StructuredOutput(kind="choice", spec=json.dumps(choices)),
                                               max_tokens=20, seed=1))  # fmt: skip
    assert text in choices and session.finish_reason == "stop"
    loop = json.dumps({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}})
    for kind, spec in (("grammar", "start: start"), ("json", loop)):  # no text matches them: a 400 at their
        with pytest.raises(ParamError) as info:  # first token, not an empty answer with finish_reason "stop"
            compiler.compile(StructuredOutput(kind=kind, spec=spec, field="guided_x"))
        assert info.value.param == "guided_x"


def test_an_end_only_grammar_with_min_tokens_and_ignore_eos_after_the_grammar(reasoner):
    """min_tokens cannot mask the only tokens a grammar allows (an empty choice: the end at once); with
    ignore_eos, a finished grammar constrains nothing more (vLLM's): free text follows its end."""
    text, session = run_to_end(reasoner, _chat(StructuredOutput(kind="choice", spec='[""]'), max_tokens=5,
                                               min_tokens=3, seed=0))  # fmt: skip
    assert text == "" and session.finish_reason == "stop"
    text, session = run_to_end(reasoner, _chat(StructuredOutput(kind="choice", spec='["yes"]'), max_tokens=8,
                                               ignore_eos=True, seed=0))  # fmt: skip
    assert text.startswith("yes") and session.completion_tokens == 8 and session.grammar.ended


def test_grammars_that_fail_past_their_first_token_are_refused(compiler):
    """Found by fuzzing: a grammar past llguidance's limits failed at its second token (an answer cut with
    "stop"), a regex's dangling escape was taken as a literal: each is a 400 now. JSON schema true is any
    document, false none. A constraint spelling a special token's text writes that text (ordinary tokens)."""
    bad = [
        StructuredOutput(kind="regex", spec="a{99999999}", field="f"),
        StructuredOutput(kind="grammar", spec='start: "a"~99999999', field="f"),
        StructuredOutput(
            kind="json", spec=json.dumps({"type": "string", "pattern": "^a{99999999}$"}), field="f"
        ),
        StructuredOutput(kind="regex", spec="ab\\", field="f"),
        StructuredOutput(kind="json", spec="false", field="f"),
    ]
    for so in bad:
        with pytest.raises(ParamError) as info:
            compiler.compile(so)
        assert info.value.param == "f", so
    for so in (StructuredOutput(kind="regex", spec="ab\\\\"), StructuredOutput(kind="json", spec="true")):
        compiler.compile(so)
    # a constraint no text matches: said in words, not llguidance's parser dump (<state> counters, <grammar>)
    recursive = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
    for so in (StructuredOutput(kind="grammar", spec="start: start", field="f"),
               StructuredOutput(kind="json", spec=json.dumps(recursive), field="f")):  # fmt: skip
        with pytest.raises(ParamError, match="matches no text") as info:
            compiler.compile(so)
        assert "<state>" not in info.value.message and "compute_time_us" not in info.value.message
    for so in (StructuredOutput(kind="choice", spec='["a<|image_pad|>b"]'),
               StructuredOutput(kind="regex", spec="a<\\|im_end\\|>b")):  # fmt: skip
        for seed in range(3):  # (walk decodes skipping special tokens: the text is there, so it is no token)
            assert walk(compiler, so, seed) == (so.spec.strip('[]"').replace("\\", ""), True), so


def test_at_most_a_few_compile_threads_at_once():
    """Each compile thread reserves a 1 GiB stack: concurrent requests' compiles queue beyond COMPILE_THREADS."""
    import threading
    import time

    from worldserve.sampling import grammar

    running, peak, lock = [0], [0], threading.Lock()

    def slow() -> int:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        return 1

    threads = [threading.Thread(target=grammar.on_big_stack, args=(slow,)) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak[0] == grammar.COMPILE_THREADS


def test_grammars_tokenize_forced_text_without_the_shared_tokenizer(compiler, monkeypatch):
    """Found in review: llguidance tokenized a grammar's forced text through the Reasoner's own tokenizer with
    split_special_tokens, a mode transformers sets on the shared tokenizer, changing how prompts tokenized on
    other threads meanwhile; it has a copy of its own now."""
    fresh = GrammarCompiler(compiler.hf_tokenizer, compiler.vocab_size, compiler.end_ids)
    _ = fresh.tokenizer

    def shared(*args, **kwargs):
        raise AssertionError("the shared tokenizer was used by a grammar")

    monkeypatch.setattr(compiler.hf_tokenizer, "encode", shared)
    for so in (
        StructuredOutput(kind="regex", spec="x<\\|im_end\\|>y"),
        StructuredOutput(kind="choice", spec='["<think>ok"]'),
    ):
        assert fresh.compile(so) is not None


def test_allows_first_reads_the_grammar_s_first_mask(reasoner, compiler):
    """The ids a request's allowed_token_ids give are checked against the grammar's first mask: its text's
    first tokens and its end (a grammar that may write nothing) pass, others fail; with think, <think> passes
    too; ids past the logits' width never do."""
    tok = reasoner.tokenizer
    so = StructuredOutput(kind="choice", spec='["green"]')
    assert compiler.allows_first(so, tok.encode("green", add_special_tokens=False))
    assert not compiler.allows_first(so, tok.encode("zzz", add_special_tokens=False) + [10**9, -1])
    assert not compiler.allows_first(so, [compiler.think_ids[0]])
    assert compiler.allows_first(so, [compiler.think_ids[0]], think=True)
    assert compiler.allows_first(StructuredOutput(kind="choice", spec='["", "a"]'), compiler.end_ids)
