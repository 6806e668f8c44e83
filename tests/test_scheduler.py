"""Scheduling without a model: chunked prefill, prefill-first, preemption, finish conditions."""
import pytest

from nanovllm import SamplingParams
from nanovllm.config import Config
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus

EOS = 1


@pytest.fixture
def scheduler(tiny_model):
    """Makes a Scheduler of `seqs` (8 blocks of 16 tokens unless told)."""
    def make(*seqs, prefill_first=True, **kwargs) -> Scheduler:
        config = Config(tiny_model, kvcache_block_size=16, prefill_first=prefill_first,
                        **{"num_kvcache_blocks": 8, **kwargs})
        config.eos_token_ids = (EOS,)
        s = Scheduler(config)
        for seq in seqs:
            s.add(seq)
        return s
    return make


def step(scheduler: Scheduler, token: int = 5):
    """Schedule, as if the model ran: (scheduled tokens per seq id, finished seqs)."""
    seqs = scheduler.schedule()
    plan = {seq.seq_id: seq.num_scheduled_tokens for seq in seqs}
    tokens = [token] * sum(seq.samples_this_step for seq in seqs)
    return plan, scheduler.postprocess(seqs, tokens)


def plan(s: Scheduler) -> dict:
    return step(s)[0]


def test_chunked_prefill_then_decode(scheduler):
    a, b = Sequence([9] * 50), Sequence([9] * 10)
    s = scheduler(a, b, max_num_batched_tokens=32)
    assert plan(s) == {a.seq_id: 32}  # a is chunked at the budget
    assert plan(s) == {a.seq_id: 18, b.seq_id: 10}  # a finishes its prompt, b joins
    assert a.num_completion_tokens == 1 and b.num_completion_tokens == 1
    assert plan(s) == {a.seq_id: 1, b.seq_id: 1}


@pytest.mark.parametrize("chunks", [[4], [32, 2]])
def test_prefill_runs_before_decode(scheduler, chunks):
    """Waiting prompts first, decodes stall: a step is all prefill or all decode, a chunked prompt's last one too."""
    a, b = Sequence([9] * 4), Sequence([9] * sum(chunks))
    s = scheduler(a, max_num_batched_tokens=32)
    assert plan(s) == {a.seq_id: 4}
    s.add(b)
    for chunk in chunks:
        assert plan(s) == {b.seq_id: chunk}
    assert plan(s) == {a.seq_id: 1, b.seq_id: 1}


@pytest.mark.parametrize("prefill_first", [True, False])
def test_a_prompt_of_max_model_len_is_prefilled_in_chunks_and_gets_one_token(scheduler, prefill_first):
    a = Sequence([9] * 80, SamplingParams(max_tokens=10))
    s = scheduler(a, prefill_first=prefill_first, max_num_batched_tokens=32, max_model_len=80)
    assert plan(s) == {a.seq_id: 32}
    assert plan(s) == {a.seq_id: 32}
    assert step(s) == ({a.seq_id: 16}, [a])
    assert a.num_completion_tokens == 1 and a.finish_reason == "length"


def test_mixed_step_decodes_while_prompts_prefill(scheduler):
    a, b, c = Sequence([9] * 4), Sequence([9] * 40), Sequence([8] * 10)
    s = scheduler(a, prefill_first=False, max_num_batched_tokens=32)
    assert plan(s) == {a.seq_id: 4}
    s.add(b)
    s.add(c)
    assert plan(s) == {a.seq_id: 1, b.seq_id: 31}  # a decodes, b fills the rest of the budget
    assert plan(s) == {a.seq_id: 1, b.seq_id: 9, c.seq_id: 10}  # b's last chunk, then c in one step
    assert plan(s) == {a.seq_id: 1, b.seq_id: 1, c.seq_id: 1}
    assert a.num_completion_tokens == 4 and b.num_completion_tokens == 2 and c.num_completion_tokens == 2


def test_max_num_seqs_limits_running(scheduler):
    s = scheduler(*(Sequence([9] * 4) for _ in range(3)), max_num_seqs=2)
    assert len(plan(s)) == 2 and len(s.waiting) == 1


@pytest.mark.parametrize("prefill_first", [True, False])
def test_preemption_when_blocks_run_out(scheduler, prefill_first):
    params = SamplingParams(max_tokens=10, ignore_eos=True)  # a fits in two blocks
    a, b, c = Sequence([9] * 16, params), Sequence([8] * 16, params), Sequence([7] * 16, params)
    s = scheduler(a, b, c, prefill_first=prefill_first, num_kvcache_blocks=2, max_model_len=48)
    assert plan(s) == {a.seq_id: 16, b.seq_id: 16}  # c waits: no block left
    assert plan(s) == {a.seq_id: 1}  # a's decode needs a second block: the newest, b, is preempted
    assert b.status == SequenceStatus.WAITING and b.block_table == [] and s.num_preemptions == 1
    assert b.num_completion_tokens == 1  # its sampled token is kept and recomputed later
    assert list(s.waiting) == [b, c]  # ahead of c, which arrived after it
    while a.status != SequenceStatus.FINISHED:
        step(s)
    assert plan(s) == {b.seq_id: 17}  # b is back with its generated token; a took its freed block: all recomputed


@pytest.mark.parametrize("params, tokens, reason, length, max_model_len", [
    (dict(max_tokens=3), [5, 5, 5, 5], "length", 3, 4096),
    (dict(max_tokens=10), [5, EOS, 5], "stop", 2, 4096),
    (dict(max_tokens=3, ignore_eos=True), [EOS, EOS, EOS, EOS], "length", 3, 4096),
    (dict(max_tokens=100), [5, 5, 5], "length", 2, 6),  # at max_model_len: 4 + 2 tokens
    (dict(max_tokens=2), [5, EOS], "length", 2, 4096),  # the length first, as vLLM v1
    (dict(max_tokens=100, stop_token_ids=[7]), [5, 7], "length", 2, 6),
    (dict(max_tokens=10, min_tokens=2), [EOS, EOS, 5], "stop", 2, 4096),  # EOS counts from min_tokens
])
def test_finish_conditions(scheduler, params, tokens, reason, length, max_model_len):
    seq = Sequence([9] * 4, SamplingParams(**params))
    s = scheduler(seq, max_model_len=max_model_len)
    for token in tokens:
        _, finished = step(s, token)
        if finished:
            break
    assert finished == [seq] and seq.finish_reason == reason and seq.num_completion_tokens == length
    assert seq.stop_reason is None and s.is_finished() and s.block_manager.num_free_blocks == 8


def launch(s: Scheduler) -> tuple:
    """A step scheduled and launched as overlap scheduling does: its tokens pending until complete()."""
    seqs = s.schedule()
    sampled = [seq for seq in seqs if seq.samples_this_step]
    filled = s.launched(seqs)
    for row, seq in enumerate(sampled):
        seq.append_pending(row)
    return seqs, sampled, filled


def test_a_preempted_sequence_waits_for_its_pending_token(scheduler):
    a = Sequence([9] * 10, SamplingParams(max_tokens=5, ignore_eos=True))
    s = scheduler(a, prefill_first=False)
    _, sampled, filled = launch(s)
    assert a.is_pending
    s.running.remove(a)
    s._preempt(a)  # as when blocks run out; its token is still in flight
    assert s.schedule() == [] and a in s.waiting  # its pending token would have to be read mid-prompt
    s.complete(sampled, filled, [5])
    assert s.schedule() == [a] and a.num_scheduled_tokens == 11


def forty_tokens_in_chunks_of_32(scheduler) -> tuple[Sequence, Scheduler]:
    a = Sequence(list(range(3, 43)), SamplingParams(max_tokens=5, ignore_eos=True))
    return a, scheduler(a, prefill_first=False, max_num_batched_tokens=32)


def test_a_step_hashes_only_the_blocks_it_filled(scheduler):
    a, s = forty_tokens_in_chunks_of_32(scheduler)
    _, sampled, filled = launch(s)  # the first 32 tokens of the prompt: two blocks
    s.running.remove(a)
    s._preempt(a)
    s.max_num_batched_tokens = 8
    assert s.schedule() == [a] and a.num_scheduled_tokens == 8  # back at once, with new blocks, 8 tokens only
    s.launched([a])
    s.complete(sampled, filled, [])  # the first step's blocks are gone: nothing of it may be hashed
    assert s.block_manager.hash_to_block_id == {}


def test_a_decode_step_keeps_to_the_token_budget(scheduler):
    seqs = [Sequence([9] * 4) for _ in range(3)]
    s = scheduler(*seqs, num_kvcache_blocks=16, max_num_batched_tokens=8)
    assert plan(s) == {seqs[0].seq_id: 4, seqs[1].seq_id: 4}  # the third prompt does not fit the budget
    assert plan(s) == {seqs[2].seq_id: 4}
    s.max_num_batched_tokens = 2
    assert len(plan(s)) == 2  # three sequences decode, two at a time


def test_a_sequence_whose_pending_token_ends_it_holds_back_no_other(scheduler):
    a, b = Sequence([9] * 4, SamplingParams(max_tokens=1)), Sequence([8] * 4, SamplingParams(max_tokens=5))
    s = scheduler(a, b, prefill_first=False)
    launch(s)
    assert s.schedule() == [b] and b.num_scheduled_tokens == 1


@pytest.mark.parametrize("params, token, stop_reason", [
    ({}, EOS, None),
    (dict(stop_token_ids=[7]), 7, 7),
    (dict(stop_token_ids=[EOS]), EOS, None),  # EOS is checked first
    (dict(ignore_eos=True, stop_token_ids=[EOS]), EOS, EOS),  # not ignored as a stop token
])
def test_stop_reason_is_none_for_eos_and_the_token_for_a_stop_token(scheduler, params, token, stop_reason):
    """As vLLM's."""
    seq = Sequence([9] * 4, SamplingParams(max_tokens=10, **params))
    s = scheduler(seq)
    _, finished = step(s, token)
    assert finished == [seq] and seq.finish_reason == "stop" and seq.stop_reason == stop_reason


def test_a_stop_token_waits_for_min_tokens(scheduler):
    seq = Sequence([9] * 4, SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=[7]))
    s = scheduler(seq)
    assert step(s, 7)[1] == [] and step(s, 7)[1] == [seq] and seq.num_completion_tokens == 2


def test_a_step_hashes_every_block_it_filled(scheduler):
    a, s = forty_tokens_in_chunks_of_32(scheduler)
    step(s)  # blocks 0 and 1
    step(s)  # the rest of the prompt: no full block
    assert [s.block_manager.blocks[b].hash != -1 for b in a.block_table] == [True, True, False]
