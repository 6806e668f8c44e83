import pickle

from nanovllm import SamplingParams
from nanovllm.engine.sequence import Sequence


def test_pickle_carries_only_the_scheduled_tokens():
    seq = Sequence(list(range(1000)), SamplingParams(temperature=0.5))
    seq.block_table = [3, 1, 4, 1]
    seq.num_computed_tokens, seq.num_scheduled_tokens = 512, 256
    data = pickle.dumps(seq)
    copy = pickle.loads(data)
    assert copy.scheduled_token_ids == list(range(512, 768))
    assert copy.block_table == [3, 1, 4, 1]
    assert copy.num_tokens == 1000 and not copy.samples_this_step
    assert len(data) < len(pickle.dumps(list(range(1000))))


def test_pickle_of_a_decode_step():
    seq = Sequence([1, 2, 3])
    seq.append_token(9)
    seq.num_computed_tokens, seq.num_scheduled_tokens = 3, 1
    copy = pickle.loads(pickle.dumps(seq))
    assert copy.scheduled_token_ids == [9] and copy.samples_this_step


def test_completion_tokens():
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=3))
    seq.append_token(7)
    seq.append_token(8)
    assert seq.completion_token_ids == [7, 8] and seq.num_completion_tokens == 2 and len(seq) == 5
