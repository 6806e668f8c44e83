"""A request handle's increments, no engine: text made only when read (reader, listener, stop strings), adding up."""
import asyncio
import threading
from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st
from transformers import AutoTokenizer

from nanovllm import SamplingParams
from nanovllm.engine.detokenizer import IncrementalDetokenizer, text_decoder
from nanovllm.engine.request import RequestHandle
from nanovllm.engine.sequence import Sequence, SequenceStatus
from tests.conftest import within

PROMPT = [5, 6, 7]
# the tiny byte-level vocabulary: single bytes (parts of multi-byte characters, invalid UTF-8) and merges
TOKENS = st.lists(st.integers(3, 511), min_size=1, max_size=30)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


class CountingTokenizer:

    def __init__(self, tokenizer):
        self.tokenizer, self.decodes = tokenizer, 0

    def decode(self, *args, **kwargs):
        self.decodes += 1
        return self.tokenizer.decode(*args, **kwargs)


def make_handle(tokenizer, stop: list[str] = (), stream: bool = True, **params) -> RequestHandle:
    seq = Sequence(PROMPT, SamplingParams(**{"max_tokens": 1000, "ignore_eos": True, "stop": list(stop), **params}))
    return RequestHandle(SimpleNamespace(need_progress=lambda handle: None), tokenizer, threading.Lock(), seq, stream)


def sample(handle: RequestHandle, token_id: int, last: bool = False) -> bool:
    """A step's work on a sampled token (`last` finishes the sequence); True when a stop string ended the request."""
    seq = handle.seq
    seq.append_token(token_id)
    if last:
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "length"
    stopped = handle._on_token(token_id)
    if stopped:
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "stop"
    if last or stopped:
        handle._on_finish()
    return stopped


def after_prompt(tokenizer, token_ids: list[int], **kwargs) -> str:
    """The completion's text, as the prompt's and its own join up (PROMPT is shorter than the context)."""
    return tokenizer.decode(PROMPT + token_ids, **kwargs)[len(tokenizer.decode(PROMPT, **kwargs)):]


def test_a_handle_read_only_through_result_decodes_once(tokenizer):
    counting = CountingTokenizer(tokenizer)
    handle = make_handle(counting)
    token_ids = list(range(100, 160))
    for i, token_id in enumerate(token_ids):
        sample(handle, token_id, last=i == len(token_ids) - 1)
    assert counting.decodes == 2  # the output's text, at the end (and the context's before it)
    assert handle.result(timeout=0)["text"] == after_prompt(tokenizer, token_ids)


@settings(max_examples=60, deadline=None)
@given(token_ids=TOKENS)
def test_a_reader_that_keeps_up_gets_one_increment_per_token(tokenizer, token_ids):
    handle = make_handle(tokenizer)
    reference = IncrementalDetokenizer(tokenizer, threading.Lock(), context=PROMPT)  # each token's increment
    increments, expected = iter(handle), []
    for token_id in token_ids[:-1]:
        sample(handle, token_id)
        expected.append({"token_ids": [token_id], "text": reference.push([token_id]), "finished": False})
        assert within(5, next, increments) == expected[-1]
    sample(handle, token_ids[-1], last=True)
    expected.append({"token_ids": token_ids[-1:], "text": after_prompt(tokenizer, token_ids)[len(reference.text):],
                     "finished": True, "finish_reason": "length", "stop_reason": None})
    assert within(5, next, increments) == expected[-1]
    assert within(5, list, handle) == expected


@settings(max_examples=100, deadline=None)
@given(token_ids=TOKENS, data=st.data(), stop=st.sampled_from([[], ["a"], ["bc", "\u00e9"]]))
def test_a_late_reader_gets_what_it_missed_in_one_increment(tokenizer, token_ids, data, stop):
    counting = CountingTokenizer(tokenizer)
    handle = make_handle(counting, stop)
    increments, seen, read_from = iter(handle), [], 0
    for i, token_id in enumerate(token_ids):
        last = i == len(token_ids) - 1
        decodes = counting.decodes
        stopped = sample(handle, token_id, last)
        if not stop and not stopped and not last:
            assert counting.decodes == decodes  # nobody has asked for text yet
        if stopped or last:
            break
        if data.draw(st.booleans()):  # the reader looks now: everything since it last looked, at once
            seen.append(within(5, next, increments))
            assert seen[-1]["token_ids"] == handle.seq.completion_token_ids[read_from:]
            read_from = handle.seq.num_completion_tokens
    seen += within(5, list, increments)
    out = handle.result(timeout=0)
    assert seen[-1]["finished"] and not any(i["finished"] for i in seen[:-1])
    assert sum((i["token_ids"] for i in seen), []) == out["token_ids"]
    assert "".join(i["text"] for i in seen) == out["text"]
    for s in stop:  # held back until it was sure not to be part of a stop string
        assert s not in out["text"]
    assert within(5, list, handle) == seen  # a second reading replays the same increments


def test_a_stream_holds_back_what_may_start_a_stop_string(tokenizer):
    a, b, c = tokenizer.encode("abc")  # one token each in the tiny vocabulary
    handle = make_handle(tokenizer, stop=["bc"])
    increments = iter(handle)
    sample(handle, a)
    sample(handle, b)
    assert within(5, next, increments)["text"] == "a"  # "b" may be the start of "bc"
    assert sample(handle, c)
    assert [i["text"] for i in within(5, list, increments)] == [""]
    assert handle.result(timeout=0)["text"] == "a"


def test_each_push_decodes_only_the_newest_tokens_and_their_context(tokenizer):
    """A push decodes its new tokens with the piece before them, not the whole completion: linear, not quadratic."""
    detokenizer = IncrementalDetokenizer(tokenizer, threading.Lock())
    decode, lengths = detokenizer.decode, []
    detokenizer.decode = lambda token_ids, skip: lengths.append(len(token_ids)) or decode(token_ids, skip)
    token_ids = tokenizer.encode("the quick brown fox jumps over the lazy dog. " * 8)
    assert "".join(detokenizer.push([token_id]) for token_id in token_ids) == tokenizer.decode(token_ids)
    assert len(token_ids) > 50 and max(lengths) <= 4


@pytest.fixture(scope="module")
def metaspace_tokenizer():
    """SentencePiece-style (Llama's): "▁" is a space a decode drops before its first token: context matters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    backend.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 5,
                                trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>"]))
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def test_pieces_keep_the_spaces_of_a_sentencepiece_tokenizer(metaspace_tokenizer):
    """Each piece decoded with the token before it as context: " quick" keeps its space; pieces add up."""
    token_ids = metaspace_tokenizer.encode("the quick brown fox jumps over the lazy dog")
    detokenizer = IncrementalDetokenizer(metaspace_tokenizer, threading.Lock())
    pieces = [detokenizer.push([token_id]) for token_id in token_ids]
    assert pieces[:3] == ["the", " quick", " brown"]
    assert "".join(pieces) == metaspace_tokenizer.decode(token_ids) == "the quick brown fox jumps over the lazy dog"


def test_a_completion_keeps_the_space_its_first_word_has_after_the_prompt(metaspace_tokenizer):
    """As vLLM: "the quick" + " brown fox", not "brown fox" (the completion decoded alone)."""
    prompt, completion = (metaspace_tokenizer.encode(text) for text in ("the quick", " brown fox"))
    for stop, text in (([], " brown fox"), (["fox"], " brown ")):  # the output's decode, the detokenizer's text
        seq = Sequence(prompt, SamplingParams(max_tokens=len(completion), stop=stop))
        handle = RequestHandle(SimpleNamespace(need_progress=lambda h: None), metaspace_tokenizer, threading.Lock(),
                               seq, stream=True)
        increments = iter(handle)
        for i, token_id in enumerate(completion):
            sample(handle, token_id, last=i == len(completion) - 1)
            next(increments)  # read as they come
        assert handle.result(timeout=0)["text"] == "".join(i["text"] for i in handle) == text


@settings(max_examples=60, deadline=None)
@given(token_ids=st.lists(st.integers(0, 59), min_size=1, max_size=12), skip=st.booleans())
def test_a_skipped_special_token_keeps_the_context_of_the_next_piece(metaspace_tokenizer, token_ids, skip):
    """A token that adds no text (0, "<unk>", when skipped) moves no offset: "the <unk> quick" keeps its space."""
    token_ids = [t for token_id in token_ids for t in (token_id, 0)]
    detokenizer = IncrementalDetokenizer(metaspace_tokenizer, threading.Lock(), skip)
    text = "".join(detokenizer.push([token_id]) for token_id in token_ids)
    assert text == metaspace_tokenizer.decode(token_ids, skip_special_tokens=skip)


def test_a_skipped_special_token_keeps_the_space_of_the_next_word(metaspace_tokenizer):
    the, quick = metaspace_tokenizer.encode("the quick")
    detokenizer = IncrementalDetokenizer(metaspace_tokenizer, threading.Lock(), skip_special_tokens=True)
    assert [detokenizer.push([token_id]) for token_id in (the, 0, quick)] == ["the", "", " quick"]


def test_a_stop_string_is_found_once_and_the_earliest_first(tokenizer):
    a, b, c = tokenizer.encode("abc")
    detokenizer = IncrementalDetokenizer(tokenizer, threading.Lock())
    detokenizer.push([a, b, c])
    assert detokenizer.find_stop(["bc", "ab"]) == ("ab", 0)
    detokenizer.push([a])
    assert detokenizer.find_stop(["bc", "ab"]) is None  # "bc" was found (and ignored, as before min_tokens)


@settings(max_examples=60, deadline=None)
@given(pieces=st.lists(st.sampled_from(["a", "b", "c", "ab", "\u00e9"]), min_size=1, max_size=10),
       stops=st.permutations(["a", "bc", "ab", "ca", "\u00e9"]))
def test_find_stop_gives_the_earliest_stop_string_that_ends_in_new_text(tokenizer, pieces, stops):
    detokenizer, searched = IncrementalDetokenizer(tokenizer, threading.Lock()), 0
    for piece in pieces:  # each hit ignored, as before min_tokens: the search goes on
        detokenizer.push(tokenizer.encode(piece))
        text = detokenizer.text
        new = [(i, s) for s in stops for i in range(len(text)) if text.startswith(s, i) and i + len(s) > searched]
        assert detokenizer.find_stop(stops) == (min(new)[::-1] if new else None)
        searched = len(text)


@pytest.mark.parametrize("stop_token", [False, True])
def test_a_stop_string_held_back_with_half_a_character_ends_the_request(stop_token):
    """"b" and the first byte of "€" are one token: its text, held back, counts when the request ends."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet + ["b\u00e2"])}, [("b", "\u00e2")]))
    backend.decoder = decoders.ByteLevel()
    handle = make_handle(PreTrainedTokenizerFast(tokenizer_object=backend), stop=["ab"], stop_token_ids=[0])
    sample(handle, alphabet.index("a"))
    if stop_token:
        sample(handle, 256)
        handle.seq.append_token(0)
        handle.seq.status, handle.seq.finish_reason, handle.seq.stop_reason = SequenceStatus.FINISHED, "stop", 0
        assert handle._on_token(0)
        handle._on_finish()
    else:
        assert sample(handle, 256, last=True)  # at max_tokens
    out = handle.result(timeout=0)
    assert (out["text"], out["finish_reason"], out["stop_reason"]) == ("", "stop", "ab")

def test_a_listener_gets_each_increment_as_it_is_made(tokenizer):
    counting = CountingTokenizer(tokenizer)
    handle = make_handle(counting)
    event_loop = asyncio.new_event_loop()  # not running: its queue collects what is sent to it
    queue = asyncio.Queue()
    try:
        sample(handle, 100)
        handle._add_listener((event_loop, queue))  # it gets what came before it too
        for token_id in (101, 102):
            sample(handle, token_id)
        sample(handle, 103, last=True)
        event_loop.run_until_complete(asyncio.sleep(0))
    finally:
        event_loop.close()
    items = [queue.get_nowait() for _ in range(queue.qsize())]
    assert [i["token_ids"] for i in items] == [[100], [101], [102], [103]]
    assert counting.decodes == 3 * 2 + 2  # each increment's text as it came, and the output's
    assert "".join(i["text"] for i in items) == after_prompt(tokenizer, [100, 101, 102, 103])


def test_an_error_follows_the_unread_increments(tokenizer):
    handle = make_handle(tokenizer)
    sample(handle, 100)
    sample(handle, 101)
    handle._on_error(RuntimeError("injected"))
    increments = iter(handle)
    assert within(5, next, increments)["token_ids"] == [100, 101]
    with pytest.raises(RuntimeError, match="injected"):
        next(increments)
    with pytest.raises(RuntimeError, match="injected"):
        handle.result(timeout=0)


@settings(max_examples=60, deadline=None)
@given(token_ids=st.lists(st.integers(0, 511), max_size=12), skip=st.booleans())
def test_the_text_decoder_gives_the_tokenizers_text(tokenizer, token_ids, skip):
    """Special tokens (0-2) kept or skipped, bytes that are half a character: the backend's text is decode's."""
    assert text_decoder(tokenizer)(token_ids, skip) == tokenizer.decode(token_ids, skip_special_tokens=skip)


def test_the_text_decoder_skips_the_wrapper_only_where_it_adds_nothing(tokenizer, monkeypatch):
    """A plain fast tokenizer's text comes from its backend; one cleaning up spaces, or a wrapper, from its decode."""
    calls = []
    monkeypatch.setattr(tokenizer, "decode", lambda *args, **kwargs: calls.append(args) or "wrapper's")
    assert text_decoder(tokenizer)([5, 6], True) != "wrapper's" and not calls
    assert text_decoder(CountingTokenizer(tokenizer))([5, 6], True) == "wrapper's"
    assert text_decoder(SimpleNamespace(_tokenizer=1, decode=tokenizer.decode))([5], True) == "wrapper's"
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    assert text_decoder(tokenizer)([5, 6], True) == "wrapper's"
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", False)
    base = type(tokenizer)
    for method in ("decode", "_decode"):  # a subclass with its own
        monkeypatch.setattr(tokenizer, "__class__", type("Own", (base,), {method: lambda *args: None}))
        assert text_decoder(tokenizer)([5], True) == "wrapper's"
    assert len(calls) == 5


def test_an_abort_leaves_out_the_pending_token_and_leaves_the_sequence_to_the_step(tokenizer):
    # close() ends it while a step still uses its sequence
    handle = make_handle(tokenizer, logprobs=0)
    seq = handle.seq
    for token_id in (100, 101):
        seq.append_token(token_id, {token_id: -0.5})
        handle._on_token(token_id)
    seq.append_pending(0)
    handle._end_aborted()
    out = handle.result(timeout=0)
    assert (out["finish_reason"], out["token_ids"]) == ("abort", [100, 101])
    assert seq.is_pending and len(seq) == len(PROMPT) + 3  # as the step left it
    seq.fill_pending(102, {102: -0.1})  # the step completes
    assert out["logprobs"] == [{100: -0.5}, {101: -0.5}]


def test_an_abort_reads_one_end_while_the_step_finishes_the_sequence(tokenizer, monkeypatch):
    # close() copies the tokens, then the step fills the pending token with a stop token and finishes the sequence
    handle = make_handle(tokenizer, ignore_eos=False, stop_token_ids=[102])
    seq = handle.seq
    for token_id in (100, 101):
        seq.append_token(token_id)
        handle._on_token(token_id)
    seq.append_pending(0)
    copy = Sequence.completion_token_ids.fget

    def copied_before_the_step_completes(self):
        token_ids = copy(self)
        if self.is_pending:
            self.fill_pending(102)
            self.stop_reason, self.finish_reason = 102, "stop"
        return token_ids

    monkeypatch.setattr(Sequence, "completion_token_ids", property(copied_before_the_step_completes))
    handle._end_aborted()
    out = handle.result(timeout=0)
    assert (out["finish_reason"], out["stop_reason"], out["token_ids"]) == ("abort", None, [100, 101])
    assert out["text"] == tokenizer.decode([100, 101])


def test_a_handle_keeps_the_end_it_finished_with(tokenizer):
    handle = make_handle(tokenizer)
    sample(handle, 100)
    handle.seq.status, handle.seq.finish_reason = SequenceStatus.FINISHED, "length"
    handle._end_aborted()  # a close() after the scheduler finished it
    handle._on_error(RuntimeError("late"))  # a handle finishes once
    assert handle.result(timeout=0)["finish_reason"] == "length"
