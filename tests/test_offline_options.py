"""`worldserve.Engine(model, **options)`'s option values (offline/options.py `engine_config`, no model loaded):
flag text read by the flag's own type and choices, as `worldserve serve` reads it (a `torch.dtype` taken for
`dtype`), Python values of the wrong type or a bad value refused with the option's name first, and all of it
before any load starts.
"""

from __future__ import annotations

import contextlib
import io

import pytest


def config(**options):
    from worldserve.offline.options import engine_config

    return engine_config(None, options)


def serve_refuses(*argv: str) -> bool:
    """Whether `worldserve serve ARGV`'s parser (argparse) refuses the flags."""
    from worldserve.cli import build_parser

    argv = ("serve", *argv)
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit) as refused:
        build_parser(list(argv)).parse_args(list(argv))
    return refused.value.code == 2


def test_a_torch_dtype_is_its_flag_value():
    torch = pytest.importorskip("torch")

    assert config(dtype=torch.float16).model.dtype == "float16"
    assert config(dtype=torch.bfloat16).model.dtype == "bfloat16"
    assert config(dtype=torch.float32).model.dtype == "float32"
    assert config(device=torch.device("cuda", 1)).model.device == "cuda:1"
    with pytest.raises(ValueError, match=r"^dtype: invalid choice: 'int8' \(choose from 'auto', 'bfloat16'"):
        config(dtype=torch.int8)


def test_numpy_scalars_are_taken_as_python_values():
    np = pytest.importorskip("numpy")

    cfg = config(vae_tiling=np.True_, max_batch_size=np.int64(3), init_timeout=np.float32(5))
    assert cfg.model.vae_tiling is True and type(cfg.model.vae_tiling) is bool
    assert cfg.scheduler.max_batch_size == 3 and type(cfg.scheduler.max_batch_size) is int
    assert cfg.model.init_timeout == 5.0


@pytest.mark.parametrize(
    "name, value, flag, shown",
    [("dtype", "int8", "--dtype", "'int8'"), ("quantization", "int4", "-q", "'int4'"),
     ("max_lora_rank", "7", "--max-lora-rank", "7"),
     ("diffusion_attention_backend", "xformers", "--diffusion-attention-backend", "'xformers'")],
)  # fmt: skip
def test_a_choice_the_flag_does_not_offer_is_refused_as_the_cli_refuses_it(name, value, flag, shown):
    assert serve_refuses(flag, value)
    with pytest.raises(ValueError, match=rf"^{name}: invalid choice: {shown} \(choose from "):
        config(**{name: value})


def test_a_python_value_not_among_the_choices_is_refused():
    with pytest.raises(ValueError, match=r"^max_lora_rank: invalid choice: 7 \(choose from 1, 8, 16"):
        config(max_lora_rank=7)
    assert config(max_lora_rank=16).lora.max_lora_rank == 16


def test_flag_text_of_an_int_float_or_optional_option_is_read_as_the_cli_reads_it():
    parsed = config(max_batch_size="2", tensor_parallel_size="2", device="cpu", init_timeout="5", seed="7",
                    max_lora_rank="16", lora_path="/a", lora_scale="0.5", max_model_len="32k")  # fmt: skip
    assert parsed.scheduler.max_batch_size == 2 and parsed.parallel.tensor_parallel_size == 2
    assert parsed.model.init_timeout == 5.0 and type(parsed.model.init_timeout) is float
    assert parsed.chat.seed == 7 and parsed.lora.max_lora_rank == 16 and parsed.lora.lora_scale == 0.5
    assert parsed.reasoner.max_model_len == 32000
    # "None" is an optional flag's None, as `--seed None` is
    assert config(seed="None").chat.seed is None
    # a whole float is its integer
    assert config(max_batch_size=2.0).scheduler.max_batch_size == 2


@pytest.mark.parametrize(
    "name, text, said",
    [("seed", "x", "invalid int value: 'x'"), ("max_batch_size", "2.5", "invalid int value: '2.5'"),
     ("init_timeout", "soon", "invalid float value: 'soon'"), ("max_model_len", "lots", "expected a whole number")],
)  # fmt: skip
def test_flag_text_the_cli_refuses_is_refused_naming_the_option(name, text, said):
    assert serve_refuses("--" + name.replace("_", "-"), text)
    with pytest.raises(ValueError, match=rf"^{name}: {said}"):
        config(**{name: text})


@pytest.mark.parametrize(
    "name, value, error, said",
    [("max_batch_size", 2.5, ValueError, "expected an integer, got 2.5"),
     ("max_batch_size", True, TypeError, "expected an integer, got True"),
     ("tensor_parallel_size", False, TypeError, "expected an integer, got False"),
     ("max_batch_size", None, TypeError, "expected an integer, got None"),
     ("init_timeout", True, TypeError, "expected a number, got True"),
     ("device", 5, TypeError, r"expected a string, got 5 \(int\)"),
     ("dtype", 16, TypeError, r"expected a string, got 16 \(int\)"),
     ("max_model_len", True, TypeError, "expected the flag's text"),
     ("served_model_name", 3, TypeError, "expected a string or a list of strings"),
     ("served_model_name", [], ValueError, "expected at least one value")],
)  # fmt: skip
def test_a_python_value_of_the_wrong_type_is_refused_naming_the_option(name, value, error, said):
    with pytest.raises(error, match=rf"^{name}: {said}"):
        config(**{name: value})


@pytest.mark.parametrize("name", ["enable_lora", "enable_layerwise_offload", "enforce_eager"])
@pytest.mark.parametrize("value", ["no", "false", "True", 0, 1, None])
def test_a_bool_option_takes_true_or_false_only(name, value):
    """The CLI's bool flags (`--enable-lora` / `--no-enable-lora`, `--enable-layerwise-offload`) take no text:
    a string ("no" had been stored, truthy, turning the option on) or a number is refused."""
    with pytest.raises(TypeError, match=rf"^{name}: expected True or False, got "):
        config(**{name: value})
    section = {"enable_lora": "lora", "enable_layerwise_offload": "parallel", "enforce_eager": "model"}[name]
    assert getattr(getattr(config(**{name: True}), section), name) is True
    assert getattr(getattr(config(**{name: False}), section), name) is False


def test_an_empty_served_model_name_is_refused_as_the_cli_refuses_it():
    """`--served-model-name ""` stops serve; Engine(served_model_name="") had served the model's path."""
    from worldserve.cli import build_parser
    from worldserve.commands.serve import engine_config as serve_engine_config

    argv = ["serve", "--served-model-name", ""]
    with pytest.raises(ValueError, match="--served-model-name: a name must not be empty"):
        serve_engine_config(build_parser(argv).parse_args(argv))
    with pytest.raises(
        ValueError, match=r"^served_model_name \(--served-model-name\): a name must not be empty"
    ):
        config(served_model_name="")
    with pytest.raises(ValueError, match=r"^served_model_name \(--served-model-name\)"):
        config(served_model_name=["a", ""])
    named = config(served_model_name=["a", "b"]).model
    assert (named.served_model_name, named.served_model_aliases) == ("a", ("b",))
    assert config(served_model_name="a").model.served_model_name == "a"


def test_a_configs_own_check_names_the_option_first():
    with pytest.raises(ValueError, match=r"^max_batch_size \(--max-batch-size\) must be >= 1"):
        config(max_batch_size=0)
    with pytest.raises(ValueError, match=r"^init_timeout \(--init-timeout\) must be a finite number"):
        config(init_timeout=float("nan"))


def test_engine_refuses_a_bad_option_before_loading(monkeypatch, tmp_path):
    """The option's error comes before any load: a bad value with a model folder that does not exist is the
    option's error, not the missing checkpoint's (and the load is never called)."""
    import worldserve.offline.engine as offline_engine
    from worldserve import Engine

    def no_load(config):
        raise AssertionError("the model load started")

    monkeypatch.setattr(offline_engine, "load_within", no_load)
    missing = tmp_path / "no-such-model"
    for options, error, said in [
        ({"dtype": "int8"}, ValueError, "^dtype: invalid choice"),
        ({"max_batch_size": "two"}, ValueError, "^max_batch_size: invalid int value"),
        ({"enable_lora": "no"}, TypeError, "^enable_lora: expected True or False"),
        ({"device": 5}, TypeError, "^device: expected a string"),
        ({"served_model_name": ""}, ValueError, "^served_model_name"),
    ]:
        with pytest.raises(error, match=said):
            Engine(missing, **options)
    # (with good options the load is what fails here: the check above ran first)
    with pytest.raises(AssertionError, match="load started"):
        Engine(missing, device="cpu", dtype="float32")
