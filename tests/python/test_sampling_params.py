"""SamplingParams: vLLM's fields and defaults, validated once, in C++."""

import pytest

from tessera import SamplingParams

# vLLM's defaults for the fields Tessera has (vllm/sampling_params.py).
VLLM_DEFAULTS = dict(
    n=1, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, seed=None, repetition_penalty=1.0,
    presence_penalty=0.0, frequency_penalty=0.0, logprobs=None, max_tokens=16,
    ignore_eos=False, stop_token_ids=[], stop=[], skip_special_tokens=True,
)


def test_defaults_are_vllms():
    p = SamplingParams()
    for field, value in VLLM_DEFAULTS.items():
        assert getattr(p, field) == value, field


def test_every_field_is_kept():
    given = dict(n=3, temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, seed=7,
                 repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=-0.5,
                 logprobs=5, max_tokens=99, ignore_eos=True, stop_token_ids=[1, 2],
                 stop=["a", "bc"], skip_special_tokens=False)
    p = SamplingParams(**given)
    for field, value in given.items():
        assert getattr(p, field) == pytest.approx(value), field
    assert "max_tokens=99" in repr(p)


def test_stop_takes_a_string_or_a_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("x", "y")).stop == ["x", "y"]
    with pytest.raises(TypeError, match="stop"):
        SamplingParams(stop=3)


@pytest.mark.parametrize(
    "field,value",
    [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", 0), ("min_p", 1.5),
     ("repetition_penalty", 0.0), ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
     ("logprobs", 21), ("max_tokens", 0), ("n", 0), ("n", 129)],
)
def test_out_of_range_is_a_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_unknown_and_positional_arguments_are_type_errors():
    with pytest.raises(TypeError):
        SamplingParams(best_of_all=2)
    with pytest.raises(TypeError):
        SamplingParams(0.5)
    with pytest.raises(TypeError):
        SamplingParams(max_tokens="many")
