"""Sampling controls and outputs, each checked against HF's logits or a direct reference."""
import json
import random
import shutil
import sys
from collections import Counter

import pytest
import torch
from hypothesis import given, settings, strategies as st

from nanovllm import LLM, SamplingParams
from nanovllm.engine.penalty_slots import PenaltySlots
from nanovllm.engine.sampling_batch import build_sampling_batch
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import Penalties, Sampler, SamplingBatch, apply_min_p_top_k_top_p, apply_penalties
from tests.conftest import full_rebuild_penalties


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(4, 60))] for _ in range(n)]


def sampled(temperature: float = 1.0, max_tokens: int = 16, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def greedy(max_tokens: int = 16, **kwargs) -> SamplingParams:
    return sampled(0, max_tokens, **kwargs)


def ids(llm, batch, params) -> list[list[int]]:
    return [o["token_ids"] for o in llm.generate(batch, params, use_tqdm=False)]


def one(llm, prompt, params) -> dict:
    return llm.generate([prompt], params, use_tqdm=False)[0]


def chat(llm, conversation, **kwargs) -> list[dict]:
    return llm.chat(conversation, greedy(), use_tqdm=False, **kwargs)


def batch_of(seqs, eos_token_ids=frozenset(), vocab=64, slots=None) -> SamplingBatch:
    return build_sampling_batch(seqs, eos_token_ids, vocab, torch.from_numpy, slots)


def assert_still_serves(llm):
    assert len(one(llm, "fine", greedy(3))["token_ids"]) == 3


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, kvcache_block_size=16) as engine:
        yield engine


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def test_plain_rows_take_the_fast_path():
    def of(*params):
        return batch_of([Sequence([5, 6], p) for p in params], frozenset([1, 64]))

    plain = of(SamplingParams(), SamplingParams(temperature=0), SamplingParams(temperature=0.7, stop="x"))
    assert plain.is_plain and plain.temperatures.tolist() == pytest.approx([1.0, 0.0, 0.7])
    full = of(SamplingParams(), SamplingParams(top_k=3), SamplingParams(min_tokens=2, stop_token_ids=[63]),
              SamplingParams(top_k=2**63))  # past int64: all of the vocabulary
    assert not full.is_plain
    assert full.top_k.tolist() == [64, 3, 64, 64] and full.top_p is None and full.penalties is None
    assert full.banned[2, 1] and full.banned[2, 63] and not full.banned[:2].any()  # only the row short of min_tokens


@pytest.mark.parametrize("control", [dict(top_p=0.9), dict(top_k=5), dict(min_p=0.1), dict(seed=3), dict(logprobs=0),
                                     dict(min_tokens=1), dict(presence_penalty=0.5), dict(frequency_penalty=-0.5),
                                     dict(repetition_penalty=1.3), dict(repetition_penalty=0.8)])
def test_any_one_control_leaves_the_fast_path(control):
    # turned-off controls and stop strings stay plain
    assert not SamplingParams(**control).is_plain
    assert not Sequence([5, 6], SamplingParams(**control)).plain_sampling
    assert SamplingParams(top_k=-1, top_p=1.0, min_p=0.0, repetition_penalty=1.0, stop=["x"],
                          stop_token_ids=[3], temperature=0.5).is_plain


def test_a_ban_holds_for_every_row_and_logprobs_are_of_the_raw_logits():
    logits = torch.tensor([[0.0, 1.0, 20.0]] * 2)
    ban = torch.tensor([[False, False, True]] * 2)
    batch = SamplingBatch(torch.tensor([0.0, 1.0]), banned=ban, num_logprobs=[3, 3])
    sampled, (_, _, top_values) = Sampler().sample(logits, batch, torch.Generator().manual_seed(0))
    assert sampled[0] == 1 and sampled[1] != 2 and torch.allclose(top_values, logits.log_softmax(-1).flip(-1))


def test_penalties_then_temperature_then_controls():
    penalties = Penalties(*map(torch.tensor, ([0], [[0]], [[1.0]], [1.0], [2.0], [0.0], [0], [0])))
    batch = SamplingBatch(torch.tensor([2.0]), min_p=torch.tensor([1.0]), penalties=penalties)
    assert Sampler().sample(torch.tensor([[3.0, 0.0]]), batch)[0] == 0  # (3 - 2) / 2 > 0 > 3 / 2 - 2
    batch = SamplingBatch(torch.full([999], 99.0), top_k=torch.full([999], 2))
    draws = Sampler().sample(torch.tensor([[0.0, 1.0]]).expand(999, 2), batch, torch.Generator().manual_seed(0))[0]
    assert abs(draws.float().mean() - 0.5) < 0.1  # 0.73 at temperature 1


def test_greedy_controls_hold_alone_and_beside_rows_without_them(llm):
    batch = prompts(6)
    expected = ids(llm, batch, greedy())
    assert ids(llm, batch, sampled(1e-40, seed=1)) == ids(llm, batch, sampled(0.01, seed=1))  # no overflow
    plain = sampled(1.5, seed=0)
    for controls in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        controlled = sampled(1.5, **controls)
        assert ids(llm, batch, controlled) == expected, controls
        got = ids(llm, batch, [controlled, plain] * 3)
        assert got[::2] == expected[::2], controls
        assert all(g != e for g, e in zip(got[1::2], expected[1::2])), controls


def allowed_set(probs: torch.Tensor, top_k=0, top_p=1.0, min_p=0.0, slack=1e-5) -> set[int]:
    """The tokens min-p, top-k and top-p keep, with slack for rounding."""
    keep = probs >= min_p * probs.max() - slack
    if top_k:
        keep &= probs >= probs.topk(top_k).values[-1] - slack
    if top_p < 1:
        renormalized = torch.where(keep, probs, 0) / torch.where(keep, probs, 0).sum()
        order = renormalized.argsort(descending=True)
        mass_before = renormalized[order].cumsum(0) - renormalized[order]
        kept_by_p = torch.zeros_like(keep)
        kept_by_p[order[mass_before < top_p + slack]] = True
        keep &= kept_by_p
    return set(keep.nonzero().flatten().tolist())


@pytest.mark.parametrize("top_p, kept", [(0.5, 2), (0.5001, 3), (0.75, 3), (1.0, 4)])
def test_top_p_keeps_a_token_while_the_likelier_ones_hold_less(top_p, kept):
    # as vLLM: of 4 tokens of a quarter each, top_p 0.5 keeps 2
    out = apply_min_p_top_k_top_p(torch.zeros(1, 4), None, None, torch.tensor([top_p]))
    assert int(out.isfinite().sum()) == kept


def test_turned_off_top_k_and_top_p_keep_every_token_beside_rows_that_use_them():
    # top_k=-1 is taken as 0; even where one token has all the mass
    seqs = [Sequence([5, 6], SamplingParams(top_k=-1, top_p=1.0, seed=1)),
            Sequence([5, 6], SamplingParams(top_k=2, top_p=0.5))]
    batch = batch_of(seqs, frozenset([1]))
    logits = torch.zeros(2, 64)
    logits[:, 7] = 30.0
    kept = apply_min_p_top_k_top_p(logits, batch.min_p, batch.top_k, batch.top_p).isfinite()
    assert kept[0].all() and kept[1].nonzero().flatten().tolist() == [7]


@pytest.mark.parametrize("controls", [{"top_k": 5}, {"top_p": 0.3}, {"min_p": 0.3}, {"top_k": 20, "top_p": 0.5}])
def test_draws_stay_inside_the_kept_set(llm, hf_model, controls):
    prompt = prompts(1, seed=1)[0]
    probs = torch.softmax(hf_logits(hf_model, prompt)[-1] / 1.3, dim=-1)
    allowed = allowed_set(probs, **controls)
    assert 1 < len(allowed) < len(probs) // 2  # the control matters for this prompt
    draws = [t[0] for t in ids(llm, [prompt] * 400, sampled(1.3, 1, **controls))]
    assert set(draws) <= allowed
    assert len(set(draws)) > 1  # it samples, not argmax
    # with the model's probabilities renormalized over the kept set
    kept = torch.tensor(sorted(allowed))
    expected = probs[kept] / probs[kept].sum()
    counts = Counter(draws)
    for token, p in zip(kept.tolist(), expected.tolist()):
        assert abs(counts[token] / len(draws) - p) < 0.1, (token, counts[token], p)


def test_same_seed_same_tokens_in_any_company(llm):
    prompt, company = prompts(1, seed=2)[0], prompts(5, seed=3)
    seeded, noisy = sampled(max_tokens=24, seed=1234), sampled(max_tokens=30)
    alone = one(llm, prompt, seeded)["token_ids"]
    assert ids(llm, company[:2] + [prompt] + company[2:], [noisy, noisy, seeded, noisy, noisy, noisy])[2] == alone
    assert one(llm, prompt, sampled(max_tokens=24, seed=1235))["token_ids"] != alone
    assert one(llm, prompt, sampled(max_tokens=24))["token_ids"] != alone


def test_a_seeded_requests_draws_differ_from_position_to_position():
    # a seed fixes each position's draw
    sampler, seq = Sampler(), Sequence([5, 6], SamplingParams(temperature=1.0, seed=3))
    tokens, seeds = [], []
    for _ in range(8):
        batch = batch_of([seq], frozenset([1]))
        seeds.append(batch.seeds[0][1])
        tokens.append(sampler.sample(torch.zeros(1, 64), batch)[0].item())
        seq.append_token(tokens[-1])
    assert len(set(tokens)) > 1
    seq = Sequence([5], SamplingParams(seed=4))  # not seed 3's, shifted
    assert batch_of([seq]).seeds[0][1] not in seeds


def test_a_seeded_request_continued_from_its_own_output_draws_the_same(llm):
    # a seed fixes each position's draw
    prompt = prompts(1, seed=6)[0]
    expected = one(llm, prompt, sampled(max_tokens=12, seed=11))["token_ids"]
    for j in (1, 5):
        assert one(llm, prompt + expected[:j], sampled(max_tokens=12 - j, seed=11))["token_ids"] == expected[j:], j


def test_same_seed_survives_preemption(llm, tiny_model):
    prompt, seeded = prompts(1, seed=4)[0], sampled(max_tokens=40, seed=7)
    expected = one(llm, prompt, seeded)["token_ids"]  # in a roomy cache
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=8) as tight:
        outputs = ids(tight, prompts(4, seed=5) + [prompt], seeded)
        assert tight.scheduler.num_preemptions > 0
    assert outputs[-1] == expected


def test_stop_string_spanning_tokens_and_waiting_for_min_tokens(llm):
    prompt = prompts(1, seed=6)[0]
    free = one(llm, prompt, greedy(48))
    token_ids = free["token_ids"]
    for i in range(2, len(token_ids) - 1):  # a stop across two tokens
        left, right = llm.decode([token_ids[i]]), llm.decode([token_ids[i + 1]])
        if len(left) >= 2 and len(right) >= 2 and left.isprintable() and right.isprintable():
            stop = left[-1] + right[0]
            break
    else:
        pytest.skip("no two neighbouring multi-character tokens in this output")
    num_tokens = next(n for n in range(1, 49) if stop in llm.decode(token_ids[:n]))
    out = one(llm, prompt, greedy(48, stop=["never-there", stop]))
    assert out["text"] == free["text"][:free["text"].index(stop)] and stop not in out["text"]
    assert out["finish_reason"] == "stop" and out["stop_reason"] == stop
    assert out["token_ids"] == free["token_ids"][:num_tokens]  # up to the token completing it
    # streamed pieces add up to the same text
    pieces = [increment["text"] for increment in llm.submit(prompt, greedy(48, stop=stop))]
    assert "".join(pieces) == out["text"]
    capped = one(llm, prompt, greedy(num_tokens, stop=stop, min_tokens=num_tokens - 1))
    assert capped["text"] == out["text"] and (capped["finish_reason"], capped["stop_reason"]) == ("stop", stop)
    out = one(llm, prompt, greedy(48, stop=stop, min_tokens=num_tokens))
    assert len(out["token_ids"]) > num_tokens  # the occurrence before min_tokens did not count


def test_stop_token_ids(llm):
    prompt = prompts(1, seed=7)[0]
    free = one(llm, prompt, greedy(32))["token_ids"]
    index = next(i for i in range(3, 32) if free[i] not in free[:i])
    out = one(llm, prompt, greedy(32, stop_token_ids=[free[index]]))
    assert out["token_ids"] == free[:index + 1]  # ignore_eos does not turn stop_token_ids off
    assert out["finish_reason"] == "stop" and out["stop_reason"] == free[index]
    assert out["text"] == llm.decode(free[:index])  # the stop token's text is not part of the output


def test_min_tokens_suppresses_eos(llm, tiny_model, hf_model, tmp_path):
    prompt = prompts(1, seed=8)[0]
    first = one(llm, prompt, greedy(1))["token_ids"][0]
    held = one(llm, prompt, SamplingParams(temperature=0, max_tokens=8, min_tokens=4, stop_token_ids=[first]))
    assert first not in held["token_ids"][:4]  # stop tokens are banned before min_tokens too
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    gen_config = json.loads((model / "generation_config.json").read_text())
    gen_config["eos_token_id"] = [first]  # the greedy first token is now an EOS
    (model / "generation_config.json").write_text(json.dumps(gen_config))
    with LLM(str(model), kvcache_block_size=16) as eos_llm:
        stopped = one(eos_llm, prompt, SamplingParams(temperature=0, max_tokens=8))
        assert stopped["token_ids"] == [first] and stopped["finish_reason"] == "stop"
        assert stopped["stop_reason"] is None and stopped["text"] == ""
        out = one(eos_llm, prompt, SamplingParams(temperature=0, max_tokens=8, min_tokens=4))
        ignored = one(eos_llm, prompt, greedy(4, min_tokens=4))
        assert one(eos_llm, prompt, greedy(4))["token_ids"] == ignored["token_ids"]
    assert len(out["token_ids"]) >= 4 and first not in out["token_ids"][:4]
    assert ignored["token_ids"][0] == first  # with ignore_eos, EOS is never banned
    # the first token is HF's argmax with EOS banned
    logits = hf_logits(hf_model, prompt)[-1]
    logits[first] = float("-inf")
    assert out["token_ids"][0] == logits.argmax().item()


def test_logprobs_match_hf(llm, hf_model):
    batch = prompts(3, seed=9)
    params = [sampled(0.7, 10, seed=3, logprobs=5), greedy(10, logprobs=0), sampled(max_tokens=10)]
    outputs = llm.generate(batch, params, use_tqdm=False)
    assert outputs[2]["logprobs"] is None
    for prompt, out, k in zip(batch[:2], outputs[:2], (5, 0)):
        reference = torch.log_softmax(hf_logits(hf_model, prompt + out["token_ids"]), dim=-1)[len(prompt) - 1:-1]
        assert len(out["logprobs"]) == len(out["token_ids"])
        for row, token_id, entry in zip(reference, out["token_ids"], out["logprobs"]):
            assert next(iter(entry)) == token_id  # the sampled token's own comes first
            assert set(entry) == {token_id, *row.topk(k).indices.tolist()}
            for t, value in entry.items():
                assert value == pytest.approx(row[t].item(), abs=1e-4)


def reference_penalties(logits: torch.Tensor, prompt: list[int], output: list[int], repetition: float,
                        frequency: float, presence: float) -> torch.Tensor:
    """vLLM's definitions, one token at a time."""
    logits = logits.clone()
    for t in set(prompt) | set(output):
        logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
    for t, n in Counter(output).items():
        logits[t] -= frequency * n + presence
    return logits


@settings(max_examples=60, deadline=None)
@given(histories=st.lists(st.tuples(st.lists(st.integers(0, 49), min_size=1, max_size=12),
                                    st.lists(st.integers(0, 49), max_size=12), st.integers(0, 12)),
                          min_size=1, max_size=5),
       settings_=st.lists(st.sampled_from([(1.3, 0.5, 0.2), (1.0, 0.0, 0.0), (0.8, -0.4, 1.0), (1.0, 2.0, 0.0)]),
                          min_size=5, max_size=5),
       seed=st.integers(0, 2**32 - 1))
def test_penalties_from_slots_equal_a_full_rebuild(histories, settings_, seed):
    """As a full rebuild, bit for bit."""
    vocab = 50
    params = [SamplingParams(repetition_penalty=r, frequency_penalty=f, presence_penalty=p)
              for r, f, p in settings_[:len(histories)]]
    seqs = [Sequence(prompt, p) for (prompt, _, _), p in zip(histories, params)]
    for seq, (_, output, known) in zip(seqs, histories):
        for t in output[:known]:
            seq.append_token(t)
    slots = PenaltySlots(vocab, 64, 8, torch.device("cpu"))
    for step in range(max(len(output) - known for _, output, known in histories)):
        sampling = [(seq, output[known + step]) for seq, (_, output, known) in zip(seqs, histories)
                    if known + step < len(output)]
        batch = batch_of([seq for seq, _ in sampling], vocab=vocab, slots=slots)
        if batch.penalties is not None:
            slots.append(batch.penalties, torch.tensor([t for _, t in sampling]))
        for seq, _ in sampling:
            seq.append_pending(0)  # the host does not need its value
    logits = torch.randn(len(seqs), vocab, generator=torch.Generator().manual_seed(seed)) * 3
    logits[:, 3::7] = 0  # the repetition penalty leaves zeros
    got = apply_penalties(logits, batch_of(seqs, vocab=vocab, slots=slots))
    rows = [(prompt, output) for prompt, output, _ in histories]
    assert torch.equal(got, full_rebuild_penalties(logits, rows, params))
    for row, ((prompt, output), p) in enumerate(zip(rows, params)):
        expected = reference_penalties(logits[row], prompt, output, p.repetition_penalty, p.frequency_penalty,
                                       p.presence_penalty)
        torch.testing.assert_close(got[row], expected)


@pytest.mark.parametrize("setting", [(1.3, 0.0, 0.0), (1.0, 0.7, 0.0), (1.0, 0.0, 0.7)],
                         ids=["repetition", "frequency", "presence"])
def test_each_penalty_applies_alone(setting):
    """Any one penalty, the others off, penalizes its row: it is not taken for a row without penalties."""
    prompt, output = [5, 6], [7, 7, 8]
    r, f, p = setting
    seqs = [Sequence(prompt, SamplingParams(repetition_penalty=r, frequency_penalty=f, presence_penalty=p)),
            Sequence(prompt, SamplingParams(top_k=3))]
    for seq in seqs:
        for t in output:
            seq.append_token(t)
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(0)) * 3
    slots = PenaltySlots(64, 16, 2, torch.device("cpu"))
    got = apply_penalties(logits, batch_of(seqs, slots=slots))
    torch.testing.assert_close(got[0], reference_penalties(logits[0], prompt, output, *setting))
    assert torch.equal(got[1], logits[1])


def test_penalty_slots_grow_by_doubling_up_to_max_num_seqs():
    slots = PenaltySlots(50, 16, 3, torch.device("cpu"))
    seqs = [Sequence([1, 2], SamplingParams(repetition_penalty=1.2)) for _ in range(4)]
    for seq in seqs[:3]:  # 1, 2, then 3 slots (doubling would make 4)
        slots.gather([seq], torch.tensor([0]), torch.from_numpy)
    assert slots.counts.size(0) == slots.token_ids.size(0) == 3
    with pytest.raises(AssertionError, match="more than max_num_seqs=3"):
        slots.gather([seqs[3]], torch.tensor([0]), torch.from_numpy)


def test_a_full_length_prompt_samples_its_one_penalized_token(tiny_model, hf_model):
    # its token fills its penalty slot's last position
    prompt = [random.Random(11).randrange(3, 500) for _ in range(64)]
    with LLM(tiny_model, kvcache_block_size=16, max_model_len=len(prompt)) as engine:
        out = one(engine, prompt, greedy(4, repetition_penalty=1.3, frequency_penalty=0.5))
    assert (out["finish_reason"], len(out["token_ids"])) == ("length", 1)
    penalized = reference_penalties(hf_logits(hf_model, prompt)[-1], prompt, [], 1.3, 0.5, 0.0)
    assert penalized.max() - penalized[out["token_ids"][0]] <= 1e-4


def test_penalized_greedy_matches_hf(llm, hf_model):
    batch = prompts(3, seed=10)
    plain = ids(llm, batch, greedy(24))
    outputs = ids(llm, batch, [greedy(24, repetition_penalty=1.5, frequency_penalty=0.8, presence_penalty=0.5),
                               greedy(24), greedy(24, frequency_penalty=1.5)])
    assert outputs[0] != plain[0]  # the penalties changed something
    assert outputs[1] == plain[1]  # and only where they were asked for
    for prompt, generated, setting in zip(batch, outputs, [(1.5, 0.8, 0.5), (1.0, 0.0, 0.0), (1.0, 1.5, 0.0)]):
        logits = hf_logits(hf_model, prompt + generated)[len(prompt) - 1:-1]
        for i, token_id in enumerate(generated):
            penalized = reference_penalties(logits[i], prompt, generated[:i], *setting)
            assert penalized.max() - penalized[token_id] <= 1e-4, (i, token_id)


def test_special_tokens_in_text(llm):
    special, batch = set(llm.tokenizer.all_special_ids), prompts(40, seed=11)
    prompt, token_ids = next((p, t) for p, t in zip(batch, ids(llm, batch, greedy(32))) if special & set(t))
    kept = one(llm, prompt, greedy(32, skip_special_tokens=False))
    skipped = one(llm, prompt, greedy(32))  # skip_special_tokens=True by default
    assert kept["token_ids"] == skipped["token_ids"] == token_ids
    assert kept["text"] == llm.tokenizer.decode(token_ids, skip_special_tokens=False) != skipped["text"]
    assert skipped["text"] == llm.tokenizer.decode(token_ids, skip_special_tokens=True)


def test_decode_skips_special_tokens_by_default_as_an_outputs_text_does(llm):
    special = sorted(llm.tokenizer.all_special_ids)
    token_ids = [special[0], 100, special[-1], 101]
    assert llm.decode(token_ids) == llm.tokenizer.decode(token_ids, skip_special_tokens=True)
    assert llm.decode(token_ids) != llm.decode(token_ids, skip_special_tokens=False)


def test_chat_applies_the_template(llm):
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    templated = llm.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>assistant" in templated
    expected = one(llm, llm.tokenizer.encode(templated, add_special_tokens=False), greedy())["token_ids"]
    one_chat, two = chat(llm, conversation), chat(llm, [conversation, [{"role": "user", "content": "and you?"}]])
    assert one_chat[0]["token_ids"] == expected == two[0]["token_ids"]
    assert len(two) == 2 and two[1]["token_ids"] != two[0]["token_ids"]
    for bad in ([], [{"text": "no role"}], [{"role": "user"}], [*conversation, {"text": "no role"}]):
        with pytest.raises(TypeError, match="role|non-empty"):
            chat(llm, bad)
    # OpenAI's content parts, joined by newlines as vLLM joins them
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}]
    assert llm.apply_chat_template(parts) == llm.apply_chat_template([{"role": "user", "content": "hello\nthere"}])
    with pytest.raises(ValueError, match=r"messages\[1\].content: only parts of type 'text'"):
        chat(llm, [*parts, {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    # a chat_template with chat_template_kwargs
    plain = chat(llm, conversation, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}"
                 "{% if shout %}!{% endif %}", chat_template_kwargs={"shout": True})
    assert plain[0]["token_ids"] == one(llm, llm.tokenizer.encode("be briefhello there!"), greedy())["token_ids"]


def test_chat_without_the_generation_prompt(llm, monkeypatch):
    # add_generation_prompt=False reaches the template: no assistant turn opened
    conversation = [{"role": "user", "content": "hello there"}]
    templated = llm.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=False)
    assert "assistant" not in templated
    prompt, enc = llm.tokenizer.encode(templated, add_special_tokens=False), llm.tokenizer.encode
    # a BOS-adding tokenizer must add none to the template's text
    monkeypatch.setattr(llm.tokenizer, "encode", lambda t, add_special_tokens=True: [0] * add_special_tokens + enc(t))
    assert llm.apply_chat_template(conversation, add_generation_prompt=False) == prompt
    got = chat(llm, conversation, add_generation_prompt=False)
    assert got[0]["token_ids"] == one(llm, prompt, greedy())["token_ids"]
    # as in vLLM, chat_template_kwargs win over the argument
    assert llm.apply_chat_template(conversation, chat_template_kwargs={"add_generation_prompt": False}) == prompt


def test_a_progress_bar_shows_on_a_terminal_only_by_default(llm, capsys, monkeypatch):
    llm.chat([{"role": "user", "content": "hi"}], greedy(2))  # chat follows generate: stderr is redirected
    assert "Generating" not in capsys.readouterr().err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    llm.generate(["hi"], greedy(2))
    assert "Generating" in capsys.readouterr().err
    llm.generate(["hi"], greedy(2), use_tqdm=False)
    assert "Generating" not in capsys.readouterr().err


def test_chat_without_a_template_is_a_clear_error(llm, monkeypatch):
    monkeypatch.setattr(llm.tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="has no chat template; pass chat_template="):
        chat(llm, [{"role": "user", "content": "hi"}])
    chat(llm, [{"role": "user", "content": "hi"}], chat_template="{{ messages[0]['content'] }}")
    assert_still_serves(llm)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"top_p": 0.0}, ValueError, "top_p=0.0 must be in \\(0, 1\\]"),
    ({"top_p": 1.5}, ValueError, "top_p=1.5"),
    ({"top_k": -2}, ValueError, "top_k=-2"),
    ({"top_k": 2.0}, TypeError, "top_k=2.0"),
    ({"min_p": 1.5}, ValueError, "min_p=1.5"),
    ({"seed": "x"}, TypeError, "seed='x'"),
    ({"min_tokens": 10, "max_tokens": 5}, ValueError, "min_tokens=10 must be in \\[0, max_tokens=5\\]"),
    ({"stop": ["x", ""]}, ValueError, "stop=\\['x', ''\\]: stop strings must not be empty"),
    ({"stop": 5}, TypeError, "stop=5"),
    ({"stop_token_ids": [1, -3]}, ValueError, "stop token id -3"),
    ({"stop_token_ids": 3}, TypeError, "stop_token_ids=3"),
    ({"logprobs": -1}, ValueError, "logprobs=-1"),
    ({"presence_penalty": 3.0}, ValueError, "presence_penalty=3.0 must be in \\[-2, 2\\]"),
    ({"frequency_penalty": float("inf")}, ValueError, "frequency_penalty=inf must be finite"),
    ({"temperature": -10**400}, ValueError, "temperature=-inf must be finite"),  # not OverflowError
    ({"repetition_penalty": 0}, ValueError, "repetition_penalty=0.0 must be > 0"),
    ({"skip_special_tokens": 1}, TypeError, "skip_special_tokens=1"),
])
def test_bad_sampling_controls(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"stop_token_ids": [512]}, "stop token id 512 is outside the vocabulary \\[0, 512\\)"),
    ({"logprobs": 513}, "logprobs=513 is more than the vocabulary size 512"),
])
def test_model_dependent_limits_leave_engine_usable(llm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["fine"], SamplingParams(**kwargs), use_tqdm=False)
    assert_still_serves(llm)


def test_model_dependent_limits_take_their_edges(llm):
    # logprobs of all 512 ids, the last id as a stop token
    out = one(llm, "fine", SamplingParams(temperature=0, max_tokens=2, logprobs=512, stop_token_ids=[511]))
    assert len(out["logprobs"]) == len(out["token_ids"]) >= 1
    assert all(sorted(d) == list(range(512)) for d in out["logprobs"])
