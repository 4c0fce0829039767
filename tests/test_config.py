import numpy as np
import pytest

from atom_core import Config, SamplingParams, SpeculativeConfig


def test_defaults_follow_the_seed():
    c = Config()
    assert c.max_num_seqs == 512
    assert c.max_num_batched_tokens == 16384
    assert c.kv_cache_block_size == 16
    assert c.enable_prefix_caching is False
    assert c.scheduler_delay_factor == 0.0
    assert c.gpu_memory_utilization == 0.9
    assert c.num_kvcache_blocks is None
    assert c.max_model_len is None
    assert c.bos_token_id is None and c.eos_token_id is None
    assert c.stop_token_ids == []
    assert c.speculative_config is None
    assert c.num_per_req_cache_groups == 0
    assert c.num_speculative_tokens == 0


@pytest.mark.parametrize("size", [1, 16, 32, 256])
def test_valid_block_sizes(size):
    assert Config(kv_cache_block_size=size).kv_cache_block_size == size


@pytest.mark.parametrize("size", [0, 2, 8, 15, 17, 24, -16])
def test_block_size_must_be_multiple_of_16_or_one(size):
    with pytest.raises(
        ValueError, match=rf"kv_cache_block_size must be a positive multiple of 16 or exactly 1, got {size}"
    ):
        Config(kv_cache_block_size=size)


@pytest.mark.parametrize("field", ["max_num_seqs", "max_num_batched_tokens", "num_kvcache_blocks", "max_model_len"])
@pytest.mark.parametrize("value", [0, -3])
def test_counts_must_be_positive(field, value):
    with pytest.raises(ValueError, match=rf"{field} must be a positive integer, got {value}"):
        Config(**{field: value})


def test_other_field_checks_name_the_field():
    with pytest.raises(ValueError, match="scheduler_delay_factor must be a finite number >= 0, got -0.5"):
        Config(scheduler_delay_factor=-0.5)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\], got 1.5"):
        Config(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="num_per_req_cache_groups must be an integer >= 0, got -1"):
        Config(num_per_req_cache_groups=-1)
    with pytest.raises(ValueError, match="stop_token_ids must hold token ids"):
        Config(stop_token_ids=[3, -1])
    with pytest.raises(ValueError, match="eos_token_id must be a token id"):
        Config(eos_token_id=-2)
    with pytest.raises(ValueError, match="num_speculative_tokens must be a positive integer, got 0"):
        SpeculativeConfig(num_speculative_tokens=0)
    # a string would count as True; a number as a name would fail at the registry lookup
    with pytest.raises(ValueError, match="enable_prefix_caching must be True or False, got 'false'"):
        Config(enable_prefix_caching="false")
    with pytest.raises(ValueError, match="enforce_eager must be True or False, got 0"):
        Config(enforce_eager=0)
    with pytest.raises(ValueError, match=r"scheduling_policy must be a name \(a non-empty string\), got 3"):
        Config(scheduling_policy=3)
    with pytest.raises(ValueError, match="sampler must be a name"):
        Config(sampler=5)
    with pytest.raises(ValueError, match="additional_config takes setting names"):
        Config(additional_config={3: "x"})


def test_plugin_settings_are_declared_and_checked_by_their_plugin():
    """A setting a plugin declares (the GDN builder's state dtype, the spyre policy's chunk) is
    checked by that plugin's own validators; one no plugin declares is named as unknown."""
    from atom_core.plugins.options import check_plugin_options, declared_options

    declared = declared_options()
    assert {"gdn_state_dtype", "prefill_chunk_size", "max_batch_tkv_limit"} <= set(declared)
    check_plugin_options({"gdn_state_dtype": "bfloat16", "max_batch_tkv_limit": 4096})
    with pytest.raises(ValueError, match="gdn_state_dtype must be one of 'float32', 'bfloat16', got 'fp8'"):
        check_plugin_options({"gdn_state_dtype": "fp8"})
    with pytest.raises(ValueError, match="max_batch_tkv_limit must be a positive integer, got -1"):
        check_plugin_options({"max_batch_tkv_limit": -1})
    with pytest.raises(TypeError, match="unknown plugin setting.*'gdn_state_dtyp'.*gdn_state_dtype"):
        check_plugin_options({"gdn_state_dtyp": "bfloat16"})


def test_validation_also_runs_on_assignment():
    c = Config()
    with pytest.raises(ValueError, match="max_num_seqs"):
        c.max_num_seqs = 0


def test_unknown_keyword_is_named():
    with pytest.raises(TypeError, match="max_num_seq"):
        Config(max_num_seq=4)


def test_speculative_config_sets_k():
    assert Config(speculative_config=SpeculativeConfig(num_speculative_tokens=2)).num_speculative_tokens == 2


def test_sampling_params_defaults():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens, p.ignore_eos, p.stop_strings, p.seed) == (
        1.0,
        -1,
        1.0,
        64,
        False,
        [],
        None,
    )
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert SamplingParams(stop_strings="END").stop_strings == ["END"]
    # numpy integers are integers (prompts take them too)
    p = SamplingParams(max_tokens=np.int64(5), logprobs=np.int32(2), top_k=np.int64(3), seed=np.uint8(7))
    assert (p.max_tokens, p.logprobs, p.top_k, p.seed) == (5, 2, 3, 7) and type(p.max_tokens) is int
    # and numpy floats numbers (np.float32 is no float subclass)
    p = SamplingParams(temperature=np.float32(0.5), top_p=np.float32(0.25), min_p=np.float16(0.5))
    assert (p.temperature, p.top_p, p.min_p) == (0.5, 0.25, 0.5) and type(p.temperature) is float
    assert SamplingParams(seed=-5).seed == -5 and SamplingParams(seed=2**64 - 1).seed == 2**64 - 1  # torch's range


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "temperature must be a finite number >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
        ({"top_p": 0}, r"top_p must be in \(0, 1\], got 0"),
        ({"top_p": 1.01}, r"top_p must be in \(0, 1\], got 1.01"),
        ({"top_k": -2}, "top_k must be -1 or 0 .* got -2"),
        ({"max_tokens": 0}, r"max_tokens must be an integer >= 1, or None \(up to max_model_len\), got 0"),
        ({"max_tokens": 2.5}, "max_tokens must be an integer >= 1, or None .* got 2.5"),
        ({"seed": "x"}, r"seed must be an integer in \[-2\*\*63, 2\*\*64\) or None"),
        ({"seed": 2**64}, "seed must be an integer in .* got 18446744073709551616"),  # would repeat seed 0's tokens
        ({"seed": -(2**63) - 1}, "seed must be an integer in"),
        ({"temperature": True}, "temperature must be a finite number >= 0"),
        ({"stop_strings": ["ok", ""]}, "stop_strings must be non-empty strings"),
        ({"ignore_eos": "no"}, "ignore_eos must be True or False, got 'no'"),
        ({"ignore_eos": None}, "ignore_eos must be True or False, got None"),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list of token ids, got 5"),
        ({"stop_strings": 5}, "stop_strings must be a string or a list of strings, got 5"),
        ({"logprobs": True}, "logprobs must be None, an integer >= 0"),
        ({"max_tokens": np.float64(3)}, "max_tokens must be an integer >= 1"),
    ],
)
def test_sampling_params_errors_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
