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
