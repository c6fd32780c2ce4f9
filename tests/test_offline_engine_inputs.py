"""worldserve.Engine's edges, on the tiny random checkpoint (CPU, float32): numpy scalar fields turned into
Python's, `timeout` and `messages` checked up front, a list of conversations answered as a list (vLLM's batched
`LLM.chat`), repr / pickle, and `init_timeout` bounding the load as `worldserve serve`'s does.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import threading

import numpy as np
import pytest
from offline_engines import engine_fixture

TINY = {"width": 64, "height": 64, "num_frames": 5, "num_inference_steps": 2, "fps": 8}
OPTIONS = {"device": "cpu", "dtype": "float32", "max_model_len": 1024, "max_batch_size": 2}


engine = engine_fixture(OPTIONS)


def test_numpy_scalar_fields_become_python_values(engine):
    """seed=np.int64(3), width=np.int64(64)... run as the Python values would (the same MP4) and come back
    as ints, floats and bools: VideoOutput.seed an int, the params JSON-serialisable."""
    from worldserve import ParamError, VideoParams

    fields = {k: np.int64(v) for k, v in TINY.items()}
    out = engine.generate_video(
        "a fox", seed=np.int64(3), guidance_scale=np.float32(5.0), generate_sound=np.bool_(False), **fields
    )
    assert type(out.seed) is int and out.seed == 3
    assert type(out.params.width) is int and type(out.params.fps) is int
    assert type(out.params.guidance_scale) is float and out.params.generate_sound is False
    plain = {f.name: getattr(out.params, f.name) for f in dataclasses.fields(out.params)}
    json.dumps({k: v for k, v in plain.items() if not isinstance(v, np.ndarray)}, default=str)
    same = engine.generate_video("a fox", seed=3, guidance_scale=5.0, generate_sound=False, **TINY)
    assert out.video == same.video
    # a whole VideoParams with a numpy seed too
    assert type(engine.generate_video(VideoParams(prompt="a fox", seed=np.int64(4), **TINY)).seed) is int
    # a float width stays refused, named as the keyword passed
    with pytest.raises(ParamError) as bad:
        engine.generate_video("a fox", **{**TINY, "width": np.float64(64.0)})
    assert bad.value.param == "width"


def test_width_of_the_wrong_type_names_width(engine):
    from worldserve import ParamError

    with pytest.raises(ParamError, match="width must be an integer") as bad:
        engine.generate_video("a fox", **{**TINY, "width": "64"})
    assert bad.value.param == "width"


@pytest.mark.parametrize("timeout", [-1, 0, "5", True, float("inf"), float("nan")])
def test_bad_timeout_is_a_param_error(engine, timeout):
    from worldserve import ParamError

    with pytest.raises(ParamError) as bad:
        engine.generate_video("a fox", timeout=timeout, **TINY)
    assert bad.value.param == "timeout"
    assert engine.num_unfinished_requests == 0


def test_messages_checked_with_readable_messages(engine):
    from worldserve import ParamError

    with pytest.raises(ParamError, match="got NoneType") as bad:
        engine.chat(None)
    assert bad.value.param == "messages"
    with pytest.raises(ParamError) as bad:
        engine.chat([])
    assert bad.value.param == "messages" and "{'type'" not in str(bad.value)
    with pytest.raises(ParamError, match=r"^messages\[0\]\.role: Field required$") as bad:
        engine.chat([{"content": "hi"}])
    # generate_video's timeout has no chat counterpart: said so, not "no such field"
    with pytest.raises(ParamError, match="max_tokens") as bad:
        engine.chat("hi", timeout=5)
    assert bad.value.param == "timeout"


def test_a_list_of_conversations_is_answered_as_a_list(engine):
    """vLLM's LLM.chat(list of conversations): one ChatOutput each, in order, the same greedy answers as one
    call each; a bad conversation is named (messages[i]...) before any runs; stream_chat takes one."""
    from worldserve import ParamError

    first = [{"role": "user", "content": "Describe a fox."}]
    second = [{"role": "user", "content": "Describe a cat."}]
    answers = engine.chat([first, second], max_tokens=4, temperature=0)
    assert [a.text for a in answers] == [
        engine.chat(c, max_tokens=4, temperature=0).text for c in (first, second)
    ]
    with pytest.raises(ParamError) as bad:
        engine.chat([first, [{"content": "no role"}]], max_tokens=4)
    assert (bad.value.param, str(bad.value)) == ("messages[1][0].role", "messages[1][0].role: Field required")
    # a sampling field is every conversation's: named as it is (it had been `messages[0]temperature`)
    for fields, name in (({"temperature": -1}, "temperature"), ({"max_tokenz": 3}, "max_tokenz")):
        with pytest.raises(ParamError) as bad:
            engine.chat([first, second], **fields)
        assert bad.value.param == name
    with pytest.raises(ParamError) as bad:
        next(engine.stream_chat([first, second]))
    assert bad.value.param == "messages"
    assert engine.num_unfinished_requests == 0


def test_a_failing_conversation_cancels_the_rest_of_its_batch(engine):
    """A batch whose first conversation fails when it starts (a file:// image with no
    allowed_local_media_path): the ParamError comes and the other conversation, asked for 1000 tokens with
    ignore_eos, is cancelled (it had run to its last token before the error was raised, as an interrupt's
    KeyboardInterrupt had waited for the whole batch)."""
    from worldserve import ParamError
    from worldserve.engine.chat_observer import NullChatObserver

    class Tokens(NullChatObserver):
        generated = 0

        def on_chat_generated(self, tokens: int) -> None:
            Tokens.generated += tokens

    # (private: a cancelled chat returns nothing, and the Engine has no metrics; the chat worker's observer
    # is the only count of the tokens it made before it stopped, short of a timing assertion)
    worker = engine._parts.client.chat_worker
    worker.observer = Tokens()
    local = {"type": "image_url", "image_url": {"url": "file:///etc/hostname"}}
    bad = [{"role": "user", "content": [local, {"type": "text", "text": "What is this?"}]}]
    long = [{"role": "user", "content": "Count to a thousand."}]
    try:
        with pytest.raises(ParamError, match="allowed-local-media-path"):
            engine.chat([bad, long], max_tokens=1000, ignore_eos=True, temperature=0)
        ended = threading.Event()
        for _ in range(6000):  # (the cancel lands at the chat's next step: a hang guard, no timing asserted)
            if engine.num_unfinished_requests == 0:
                ended.set()
                break
            ended.wait(0.01)
        assert ended.is_set()
    finally:
        worker.observer = NullChatObserver()
    assert Tokens.generated < 1000


def test_an_error_found_as_a_batched_conversation_starts_names_that_conversation(engine):
    """chat([ok, bad]) where the second's file:// image is refused as it starts (its media read): the
    ParamError names `messages[1][0]...` (conversation 1, its message 0), not the field as found inside the one
    conversation (`messages[0]...`, conversation 0's name)."""
    from worldserve import ParamError

    local = {"type": "image_url", "image_url": {"url": "file:///etc/hostname"}}
    bad = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, local]}]
    ok = [{"role": "user", "content": "Hello"}]
    with pytest.raises(ParamError) as error:
        engine.chat([ok, bad], max_tokens=2)
    assert error.value.param == "messages[1][0].content[1].image_url", error.value.param


def test_sampling_fields_beside_a_chat_params_are_refused(engine):
    """chat(messages, ChatParams(...), max_tokens=5): a TypeError (the ChatParams' sampling was used and the
    fields dropped in silence: 2 tokens came for max_tokens=5); each alone still works."""
    from worldserve import ChatParams

    with pytest.raises(TypeError, match="not both"):
        engine.chat("hi", ChatParams(max_tokens=2, temperature=0.0), max_tokens=5)
    with pytest.raises(TypeError, match="not both"):
        next(engine.stream_chat("hi", ChatParams(max_tokens=2), temperature=0))
    assert engine.chat("hi", ChatParams(max_tokens=2, temperature=0.0)).usage.completion_tokens == 2
    assert engine.chat("hi", max_tokens=3, ignore_eos=True).usage.completion_tokens == 3


def test_a_start_that_fails_after_the_load_leaves_no_folder(tiny_ckpt, tmp_path, monkeypatch):
    """The job store's temporary folder is removed when the engine's parts fail to build (it was left)."""
    import tempfile

    from worldserve import Engine
    from worldserve.offline import engine as offline_engine

    def broken(*args, **kwargs):
        raise OSError("no client today")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(offline_engine, "EngineClient", broken)
    with pytest.raises(OSError, match="no client today"):
        Engine(tiny_ckpt, **OPTIONS)
    assert not list(tmp_path.glob("worldserve-offline-*"))


def test_repr_and_pickle(engine, tiny_ckpt):
    assert repr(engine) == f"Engine(model={str(tiny_ckpt)!r}, device='cpu', dtype='float32', open)"
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(engine)


def test_init_timeout_bounds_the_load(tiny_ckpt, engine):
    """A load longer than init_timeout is a TimeoutError naming it (serve's load_backend_within bound); the
    abandoned load ends on its own, and the process can load the model again."""
    from worldserve import Engine

    # (a load reads and builds a whole checkpoint: never within a microsecond)
    with pytest.raises(TimeoutError, match="init_timeout=1e-06"):
        Engine(tiny_ckpt, **{**OPTIONS, "init_timeout": 1e-6})
    loaders = [t for t in threading.enumerate() if t.name == "worldserve-offline-load"]
    for loader in loaders:
        loader.join(120)
    assert not any(t.is_alive() for t in loaders)
    with Engine(tiny_ckpt, **OPTIONS) as again:
        assert again.chat("hi", max_tokens=2).usage.completion_tokens == 2
    assert repr(again).endswith("closed)")


def test_an_interrupted_chat_stops_every_sample(engine):
    """A KeyboardInterrupt during a chat with n=4 (asked for 1000 tokens each, ignore_eos) stops all four
    samples at their next step: their streams were read one after another, and the three never read ran to
    their last token, uncounted, after the interrupt (3,000 tokens more)."""
    import signal

    from worldserve.engine.chat_observer import NullChatObserver

    main = threading.get_ident()

    class Interrupting(NullChatObserver):
        generated = 0

        def on_chat_generated(self, tokens: int) -> None:
            Interrupting.generated += tokens
            if Interrupting.generated >= 8 and Interrupting.generated - tokens < 8:  # (once, early on)
                signal.pthread_kill(main, signal.SIGINT)

    # (private: the chat worker's observer is the only count of the tokens it made, as the test above's)
    worker = engine._parts.client.chat_worker
    worker.observer = Interrupting()
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.chat("Count to a thousand.", n=4, max_tokens=1000, ignore_eos=True, temperature=1.0)
        ended = threading.Event()
        for _ in range(6000):  # (the cancels land at the chats' next step: a hang guard, no timing asserted)
            if engine.num_unfinished_requests == 0:
                ended.set()
                break
            ended.wait(0.01)
        assert ended.is_set(), engine.num_unfinished_requests
        assert Interrupting.generated < 1000, Interrupting.generated  # (not three samples to their end)
    finally:
        worker.observer = NullChatObserver()
