import pytest

from atom_core import SamplingParams, Sequence, SequenceStatus, SequenceType


def test_fields_after_construction():
    params = SamplingParams(temperature=0.5, top_k=5, top_p=0.9, max_tokens=7, ignore_eos=True, stop_strings=["x"])
    s = Sequence([1, 2, 3], 16, params, stop_token_sequences=[[4, 5]], id=42)
    assert s.id == 42
    assert s.status == SequenceStatus.WAITING and s.type == SequenceType.DUMMY
    assert s.token_ids == [1, 2, 3] and s.last_token == 3
    assert (s.num_tokens, s.num_prompt_tokens, s.num_cached_tokens) == (3, 3, 0)
    assert (s.num_blocks, s.last_block_num_tokens) == (1, 3)
    assert s.block_table == []
    assert (s.temperature, s.top_k, s.top_p, s.max_tokens, s.ignore_eos) == (0.5, 5, 0.9, 7, True)
    assert s.stop_strings == ["x"] and s.stop_token_sequences == [[4, 5]]
    assert s.output_tokens == [] and s.spec_token_ids == []
    assert (s.arrive_time, s.first_token_time, s.leave_time, s.leave_reason) == (0.0, 0.0, 0.0, "")
    assert s.has_per_req_cache is False and s.per_req_cache_group == -1
    assert len(s) == 3 and s[0] == 1


def test_callers_list_is_copied():
    tokens = [1, 2, 3]
    s = Sequence(tokens, 16)
    s.append_token(9)
    tokens.append(100)
    assert s.token_ids == [1, 2, 3, 9]
    assert tokens == [1, 2, 3, 100]


def test_ids_are_unique_and_zero_is_a_valid_id():
    a, b = Sequence([1], 16), Sequence([1], 16)
    assert a.id != b.id
    assert Sequence([1], 16, id=0).id == 0


def test_empty_prompt_is_rejected():
    with pytest.raises(ValueError, match="token_ids must hold at least one token"):
        Sequence([], 16)


@pytest.mark.parametrize("n, blocks, last", [(1, 1, 1), (15, 1, 15), (16, 1, 16), (17, 2, 1), (32, 2, 16), (33, 3, 1)])
def test_num_tokens_setter_keeps_block_counts(n, blocks, last):
    s = Sequence([7], 16)
    s.num_tokens = n
    assert (s.num_blocks, s.last_block_num_tokens) == (blocks, last)


def test_append_token_updates_everything():
    s = Sequence(list(range(16)), 16)
    s.append_token(99)
    assert s.num_tokens == 17 and s.num_blocks == 2 and s.last_block_num_tokens == 1
    assert s.last_token == 99 and s.output_tokens == [99]
    assert s.num_completion_tokens == 1
    assert s.prompt_token_ids == list(range(16)) and s.completion_token_ids == [99]
    assert s.block(1) == [99]
    with pytest.raises(IndexError):
        s.block(2)


def test_block_size_one():
    s = Sequence([5, 6, 7], 1)
    assert (s.num_blocks, s.last_block_num_tokens) == (3, 1)
    assert s.block(2) == [7]


def test_is_finished_and_cached_blocks():
    s = Sequence(list(range(40)), 16)
    s.num_cached_tokens = 32
    assert s.num_cached_blocks == 2
    assert not s.is_finished
    s.status = SequenceStatus.FINISHED
    assert s.is_finished


def test_token_ids_must_be_token_ids():
    import numpy as np

    assert Sequence(np.array([3, 4], dtype=np.int32), 16).token_ids == [3, 4]
    assert all(type(t) is int for t in Sequence(np.array([3, 4]), 16).token_ids)
    for bad, shown in ((["a"], "'a'"), ([1, -5], "-5"), ([1.5], "1.5"), ([True], "True")):
        with pytest.raises(ValueError, match=rf"token_ids\[\d\] must be a token id \(an integer >= 0\), got {shown}"):
            Sequence(bad, 16)
