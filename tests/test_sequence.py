from nanovllm import SamplingParams
from nanovllm.engine.sequence import Sequence


def test_a_step_computes_the_tokens_after_the_computed_ones():
    seq = Sequence(list(range(1000)), SamplingParams(temperature=0.5))
    seq.num_computed_tokens, seq.num_scheduled_tokens = 512, 256
    assert seq.scheduled_token_ids == list(range(512, 768)) and not seq.samples_this_step
    seq.num_computed_tokens, seq.num_scheduled_tokens = 999, 1
    assert seq.scheduled_token_ids == [999] and seq.samples_this_step


def test_completion_tokens():
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=3))
    seq.append_token(7)
    seq.append_token(8)
    assert seq.completion_token_ids == [7, 8] and seq.num_completion_tokens == 2 and len(seq) == 5
    assert seq.last_token == 8


def test_dropping_a_pending_token_restores_the_sequence():
    """An abort before the pending token arrives leaves the sequence as it was before the step."""
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=4))
    assert seq.last_token == 3 and not seq.is_pending
    seq.append_token(7)
    seq.append_pending(2)
    assert seq.is_pending and len(seq) == 5
    seq.drop_pending()
    assert seq.token_ids == [1, 2, 3, 7] and len(seq) == seq.num_tokens == 4
    assert seq.last_token == 7 and not seq.is_pending and seq.completion_token_ids == [7]
    seq.drop_pending()  # nothing pending: nothing changes
    assert seq.token_ids == [1, 2, 3, 7] and len(seq) == 4


def test_blocks_are_whole_slices_of_the_tokens():
    """Block i holds tokens [i * 4, (i + 1) * 4), the last one the rest: what the prefix cache hashes and compares."""
    tokens = list(range(100, 111))
    seq = Sequence(tokens)
    assert seq.num_blocks(4) == 3
    assert [seq.block(i, 4) for i in range(3)] == [tokens[0:4], tokens[4:8], tokens[8:11]]
    assert sum(map(len, (seq.block(i, 4) for i in range(seq.num_blocks(4))))) == len(seq)
