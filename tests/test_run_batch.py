"""The batch runner against LLM.generate/chat, every kind of bad line, exit statuses, streaming and the window,
and the command line built from Config's fields."""
import dataclasses
import json
import os
import threading
import time
import typing

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.batch.protocol import MAX_N, MIN_LOGPROB, LineError, parse_request, result_line
from nanovllm.batch.results import ResultsFile
from nanovllm.run_batch import build_parser, main
from tests.batch_util import CHAT, COMPLETIONS, choices, read_results, request, write_lines
from tests.conftest import within

MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, kvcache_block_size=16, max_model_len=MAX_MODEL_LEN) as engine:
        yield engine


def run(llm, model, input_path, output_path, *flags) -> int:
    argv = ["-i", str(input_path), "-o", str(output_path), "--model", model, "--no-progress", *flags]
    return within(120, main, argv, llm=llm)


def test_results_equal_generate_and_chat(llm, tiny_model, tmp_path):
    greedy = dict(temperature=0, ignore_eos=True)
    plain = llm.generate(["Once upon a time"], SamplingParams(max_tokens=12, **greedy), use_tqdm=False)[0]["text"]
    stop = plain[4:6].strip() or plain[4:6]  # a string the greedy output is known to contain
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    lines = [
        request("text", prompt="Hello there", max_tokens=10, temperature=0),
        request("ids", prompt=[5, 6, 7, 8], max_tokens=6, temperature=0, logprobs=3),
        request("stop", prompt="Once upon a time", max_tokens=12, temperature=0, stop=[stop], ignore_eos=True),
        request("chat", CHAT, messages=conversation, max_completion_tokens=8, temperature=0, logprobs=True,
                top_logprobs=2),
        request("parts", CHAT, messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                                     {"type": "text", "text": "!"}]}],
                max_tokens=5, temperature=0),
        request("seeded", CHAT, messages=conversation, max_tokens=7, n=2, seed=7, temperature=1.0),
        request("two", prompt=["The sea", "The moon"], max_tokens=5, temperature=0),
        request("penalty", prompt="the the the", max_tokens=9, temperature=0, presence_penalty=1.5,
                frequency_penalty=0.5, top_p=0.9),
        request("unbounded", prompt=list(range(3, 123)), temperature=0, ignore_eos=True),  # to max_model_len
    ]
    assert run(llm, tiny_model, write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl") == 0
    results = read_results(tmp_path / "out.jsonl")
    assert sorted(results) == sorted(line["custom_id"] for line in lines)

    def expect(prompts, **params):
        each = params.pop("each", None)
        sampling = [SamplingParams(**p) for p in each] if each else SamplingParams(**params)
        return llm.generate(prompts, sampling, use_tqdm=False)

    chat_ids = llm.apply_chat_template(conversation)
    expected = {
        "text": expect(["Hello there"], temperature=0, max_tokens=10),
        "ids": expect([[5, 6, 7, 8]], temperature=0, max_tokens=6, logprobs=3),
        "stop": expect(["Once upon a time"], temperature=0, max_tokens=12, stop=[stop], ignore_eos=True),
        "chat": llm.chat(conversation, SamplingParams(temperature=0, max_tokens=8, logprobs=2), use_tqdm=False),
        "parts": llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(temperature=0, max_tokens=5),
                          use_tqdm=False),
        "seeded": expect([chat_ids, chat_ids], each=[dict(max_tokens=7, seed=7), dict(max_tokens=7, seed=8)]),
        "two": expect(["The sea", "The moon"], temperature=0, max_tokens=5),
        "penalty": expect(["the the the"], temperature=0, max_tokens=9, presence_penalty=1.5,
                          frequency_penalty=0.5, top_p=0.9),
        "unbounded": expect([list(range(3, 123))], temperature=0, ignore_eos=True, max_tokens=MAX_MODEL_LEN - 120),
    }
    for custom_id, outputs in expected.items():
        result = results[custom_id]
        assert result["error"] is None and result["response"]["status_code"] == 200
        body = result["response"]["body"]
        is_chat = custom_id in ("chat", "parts", "seeded")
        assert body["object"] == ("chat.completion" if is_chat else "text_completion")
        got = choices(result)
        assert [c["index"] for c in got] == list(range(len(outputs)))
        for choice, out in zip(got, outputs):
            assert (choice["message"]["content"] if is_chat else choice["text"]) == out["text"], custom_id
            assert choice["finish_reason"] == out["finish_reason"] and choice["stop_reason"] == out["stop_reason"]
        assert body["usage"]["completion_tokens"] == sum(len(o["token_ids"]) for o in outputs)
        assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    assert choices(results["stop"])[0]["stop_reason"] == stop and stop not in choices(results["stop"])[0]["text"]
    assert len(expected["unbounded"][0]["token_ids"]) == 8
    assert choices(results["unbounded"])[0]["finish_reason"] == "length"
    assert choices(results["seeded"])[0]["message"] != choices(results["seeded"])[1]["message"]
    assert results["chat"]["response"]["body"]["usage"]["prompt_tokens"] == len(chat_ids)
    # logprobs in OpenAI's shapes, with the engine's values
    chat_lp = choices(results["chat"])[0]["logprobs"]["content"]
    out = expected["chat"][0]
    assert [e["logprob"] for e in chat_lp] == pytest.approx([lp[t] for t, lp in zip(out["token_ids"], out["logprobs"])])
    assert all(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"]
               and e["bytes"] == list(e["token"].encode()) for e in chat_lp)
    text_lp = choices(results["ids"])[0]["logprobs"]
    out = expected["ids"][0]
    assert len(text_lp["tokens"]) == len(text_lp["text_offset"]) == len(out["token_ids"])
    assert text_lp["token_logprobs"] == pytest.approx([lp[t] for t, lp in zip(out["token_ids"], out["logprobs"])])
    assert all(1 <= len(top) <= 3 for top in text_lp["top_logprobs"])
    assert choices(results["text"])[0]["logprobs"] is None


BAD_LINES = [  # (line, code, what the message must name); each line's number is in its message too
    ("this is not json", "invalid_json", "not valid JSON"),
    ('[1, 2]', "invalid_request", "not an object"),
    (json.dumps({"method": "POST", "url": COMPLETIONS, "body": {"prompt": "x"}}), "missing_custom_id", "no custom_id"),
    (json.dumps(request(5, prompt="x")), "invalid_custom_id", "5"),
    (json.dumps(request("good-1", prompt="again")), "duplicate_custom_id", "'good-1' was already used on line 1"),
    (json.dumps(request("url", "/v1/embeddings", input="x")), "invalid_url", "/v1/embeddings"),
    (json.dumps({**request("get", prompt="x"), "method": "GET"}), "invalid_request", "'GET'"),
    (json.dumps({**request("extra", prompt="x"), "priority": 1}), "invalid_request", "priority"),
    (json.dumps({**request("body", prompt="x"), "body": "prompt"}), "invalid_request", "body must be"),
    (json.dumps(request("temp", prompt="x", temperature=-1)), "invalid_value", "temperature=-1.0"),
    (json.dumps(request("typo", prompt="x", temprature=0)), "invalid_value", "temprature"),
    (json.dumps(request("bias", prompt="x", logit_bias={"5": 1})), "invalid_value", "logit_bias"),
    (json.dumps(request("n0", prompt="x", n=0)), "invalid_value", "n=0"),
    (json.dumps(request("n129", prompt="x", n=129)), "invalid_value", "n=129"),
    (json.dumps(request("maxtok", prompt="x", max_tokens="10")), "invalid_value", "max_tokens='10'"),
    (json.dumps(request("stream", prompt="x", stream=True)), "invalid_value", "stream"),
    (json.dumps(request("empty", prompt="")), "invalid_value", "empty"),
    (json.dumps(request("noprompt")), "invalid_value", "prompt must be"),
    (json.dumps(request("long-ids", prompt=list(range(3, 3 + MAX_MODEL_LEN + 1)))), "prompt_too_long",
     f"{MAX_MODEL_LEN + 1} tokens, more than max_model_len={MAX_MODEL_LEN}"),
    (json.dumps(request("long-text", prompt="the sea and the moon " * 60)), "prompt_too_long", "max_model_len"),
    (json.dumps(request("long-chat", CHAT, messages=[{"role": "user", "content": "hello " * 200}])),
     "prompt_too_long", "max_model_len"),
    (json.dumps(request("vocab", prompt=[5, 99999])), "invalid_value", "outside the vocabulary"),
    (json.dumps(request("stop-id", prompt="x", stop_token_ids=[99999])), "invalid_value", "stop token id 99999"),
    (json.dumps(request("msgs", CHAT, messages=[{"role": "user", "content": 5}])), "invalid_value", "content"),
    (json.dumps(request("image", CHAT, messages=[{"role": "user", "content": [{"type": "image_url"}]}])),
     "invalid_value", "'text'"),
    (json.dumps(request("toplp", CHAT, messages=[{"role": "user", "content": "x"}], top_logprobs=2)),
     "invalid_value", "top_logprobs needs logprobs=true"),
    (json.dumps(request("chatlp", CHAT, messages=[{"role": "user", "content": "x"}], logprobs=5)),
     "invalid_value", "logprobs=5"),
    (b'{"custom_id": "\xff\xfe"}', "invalid_json", "not UTF-8"),
    (json.dumps(request("", prompt="x")), "invalid_custom_id", "''"),  # present, so not missing: invalid
    (json.dumps(request("maxtok0", prompt="x", max_tokens=0)), "invalid_value", "max_tokens=0"),  # not "unbounded"
    (json.dumps(request("nomsgs", CHAT, messages=[])), "invalid_value", "messages must be a non-empty list"),
    (json.dumps(request("stream-str", prompt="x", stream="false")), "invalid_value", "stream"),  # only false is false
]


def test_each_bad_line_gets_an_error_line_and_the_job_goes_on(llm, tiny_model, tmp_path):
    good = lambda i: request(f"good-{i}", prompt=f"fine {i}", max_tokens=3, temperature=0)  # noqa: E731
    lines = [good(1)] + [line for line, _, _ in BAD_LINES] + ["", "   "] + [good(2)]
    assert run(llm, tiny_model, write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl") == 1
    results = read_results(tmp_path / "out.jsonl")
    assert len(results) == len(BAD_LINES) + 2  # blank lines are no requests
    for i, (line, code, named) in enumerate(BAD_LINES, start=2):
        custom_id = json.loads(line).get("custom_id") if code not in ("invalid_json", "invalid_request",
                                                                      "missing_custom_id") else None
        if code in ("invalid_custom_id", "duplicate_custom_id"):
            custom_id = None
        elif code == "invalid_request" and line.startswith("{"):
            custom_id = json.loads(line)["custom_id"]
        result = results[custom_id if custom_id is not None else f"batch_req_line{i}"]
        assert result["custom_id"] == custom_id and result["response"] is None, line
        assert result["error"]["code"] == code, (line, result["error"])
        assert named in result["error"]["message"] and f"line {i}" in result["error"]["message"], result["error"]
    for key in ("good-1", "good-2"):
        assert results[key]["error"] is None and len(choices(results[key])[0]["text"]) > 0
    assert llm.is_finished()  # nothing of a rejected line was left queued


def test_body_fields_as_openai_clients_write_them():
    """What OpenAI's own tools put in every line must be served, not rejected: a body's "model" (one model serves
    the file, so it is ignored, like "user" and "metadata"), max_completion_tokens next to the older max_tokens (the
    newer field wins, as in OpenAI's API), and the inclusive limits n=128 and top_logprobs=20."""
    conversation = [{"role": "user", "content": "Hi"}]
    line = request("a", CHAT, model="gpt-4o-mini", user="u1", metadata={"k": "v"}, messages=conversation,
                   max_tokens=50, max_completion_tokens=7, n=MAX_N, logprobs=True, top_logprobs=20)
    parsed = parse_request(line, "a", 1)
    assert (parsed.max_tokens, parsed.n, parsed.sampling["logprobs"]) == (7, MAX_N, 20)
    assert "model" not in parsed.sampling and "user" not in parsed.sampling
    assert parse_request(request("b", model="m", prompt="x", max_tokens=5), "b", 2).max_tokens == 5
    with pytest.raises(LineError, match=r"n=129 must be in \[1, 128\]"):
        parse_request(request("c", prompt="x", n=MAX_N + 1), "c", 3)
    with pytest.raises(LineError, match=r"top_logprobs=21 must be in \[0, 20\]"):
        parse_request(request("d", CHAT, messages=conversation, logprobs=True, top_logprobs=21), "d", 4)


def test_chat_top_logprobs_needs_logprobs_true_not_just_given():
    """OpenAI's rule: top_logprobs is taken only with logprobs=true; logprobs=false (or absent) beside top_logprobs
    is an error, not top_logprobs silently dropped. With logprobs=true it is the number of top logprobs."""
    conversation = [{"role": "user", "content": "Hi"}]
    for flag in ({"logprobs": False}, {}):
        with pytest.raises(LineError, match="top_logprobs needs logprobs=true"):
            parse_request(request("a", CHAT, messages=conversation, top_logprobs=2, **flag), "a", 1)
    parsed = parse_request(request("b", CHAT, messages=conversation, logprobs=True, top_logprobs=2), "b", 2)
    assert parsed.sampling["logprobs"] == 2
    assert "logprobs" not in parse_request(request("c", CHAT, messages=conversation, logprobs=False), "c", 3).sampling


def test_a_message_without_a_string_role_is_a_bad_line():
    """Each message needs a string role: one without (or with a number) is an invalid_value naming the message,
    found when the line is parsed, not left to the chat template."""
    for message in ({"content": "Hi"}, {"role": 5, "content": "Hi"}):
        conversation = [{"role": "system", "content": "Be brief."}, message]
        with pytest.raises(LineError, match="messages\\[1\\] must be an object with a string role") as error:
            parse_request(request("a", CHAT, messages=conversation), "a", 1)
        assert error.value.code == "invalid_value" and error.value.custom_id == "a"


def test_vllm_sampling_fields_reach_the_sampling_params():
    """vLLM's extra sampling fields in a body are passed to SamplingParams as given, none dropped or rejected as
    unknown; the OpenAI numbers likewise."""
    fields = dict(temperature=0.5, top_p=0.9, presence_penalty=0.25, frequency_penalty=-0.5, min_p=0.05,
                  repetition_penalty=1.1, top_k=7, min_tokens=2, ignore_eos=True, stop_token_ids=[3, 4],
                  skip_special_tokens=False, seed=11, stop=["\n\n"])
    for line in (request("a", prompt="x", **fields), request("b", CHAT, messages=[{"role": "user", "content": "x"}],
                                                             **fields)):
        parsed = parse_request(line, line["custom_id"], 1)
        assert parsed.sampling == fields
        SamplingParams(**parsed.sampling)


def test_result_line_usage_and_logprobs():
    """The parts of a result that no engine comparison pins down: cached prompt tokens are summed over every
    choice, a logprob of -inf is clamped to MIN_LOGPROB (JSON has no -inf: json.dumps would write the invalid
    token -Infinity), and a completion's text_offset is each token's character offset in the text."""
    texts = {5: "ab", 6: "cde", 7: "f"}
    outputs = [{"text": "abcde", "token_ids": [5, 6], "logprobs": [{5: -0.5, 7: -1.0}, {6: float("-inf")}],
                "finish_reason": "length", "stop_reason": None, "num_cached_tokens": 16},
               {"text": "f", "token_ids": [7], "logprobs": [{7: -0.25}],
                "finish_reason": "stop", "stop_reason": None, "num_cached_tokens": 32}]
    completion = parse_request(request("c", prompt="x", logprobs=1, n=2), "c", 1)
    line = result_line(completion, outputs, 40, "m", texts.get)
    assert line["response"]["body"]["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}
    first = choices(line)[0]["logprobs"]
    assert first["tokens"] == ["ab", "cde"] and first["text_offset"] == [0, 2]
    assert first["token_logprobs"] == [-0.5, MIN_LOGPROB] and first["top_logprobs"][1] == {"cde": MIN_LOGPROB}
    chat = parse_request(request("h", CHAT, messages=[{"role": "user", "content": "x"}], logprobs=True,
                                 top_logprobs=1, n=2), "h", 2)
    content = choices(result_line(chat, outputs, 40, "m", texts.get))[0]["logprobs"]["content"]
    assert content[1]["logprob"] == MIN_LOGPROB and content[1]["top_logprobs"][0]["logprob"] == MIN_LOGPROB
    json.loads(json.dumps(line, allow_nan=False))  # plain JSON throughout


def test_a_prompt_of_exactly_max_model_len_is_served(llm, tiny_model, tmp_path):
    """A prompt that fills max_model_len exactly fits (only a longer one is prompt_too_long); without max_tokens
    it still gets one token, rather than max_tokens=0, which SamplingParams would reject."""
    lines = [request("full", prompt=list(range(3, 3 + MAX_MODEL_LEN)), temperature=0, ignore_eos=True)]
    assert run(llm, tiny_model, write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl") == 0
    result = read_results(tmp_path / "out.jsonl")["full"]
    assert result["error"] is None, result["error"]
    assert choices(result)[0]["finish_reason"] == "length"
    assert result["response"]["body"]["usage"]["completion_tokens"] == 1


def test_usage_counts_every_prompt_of_a_request(llm, tiny_model, tmp_path):
    """A completions request of several prompts reports the prompt tokens of all of them, not of the first."""
    lines = [request("two", prompt=["The sea is", "The moon over the hills"], max_tokens=2, temperature=0)]
    assert run(llm, tiny_model, write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl") == 0
    usage = read_results(tmp_path / "out.jsonl")["two"]["response"]["body"]["usage"]
    assert usage["prompt_tokens"] == len(llm.encode("The sea is")) + len(llm.encode("The moon over the hills"))


def test_a_request_rejected_part_way_through_submitting_leaves_nothing_running(llm, tiny_model, tmp_path,
                                                                                monkeypatch):
    """A request whose second prompt fails the engine's checks after its first prompt was submitted (here
    min_tokens fits the short prompt's room but not the long one's) gets an error line, and the choice already
    submitted is aborted, not left to run for a result nobody writes."""
    submitted, submit = [], llm.submit

    def recording_submit(*args, **kwargs):
        submitted.append(submit(*args, **kwargs))
        return submitted[-1]

    monkeypatch.setattr(llm, "submit", recording_submit)
    lines = [request("split", prompt=["short", list(range(3, 3 + MAX_MODEL_LEN - 8))], min_tokens=100,
                     ignore_eos=True)]
    assert run(llm, tiny_model, write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl") == 1
    error = read_results(tmp_path / "out.jsonl")["split"]["error"]
    assert error["code"] == "invalid_value" and "min_tokens=100" in error["message"], error
    assert len(submitted) == 1 and submitted[0].result(timeout=60)["finish_reason"] == "abort"


def test_exit_status_and_a_finished_file_is_left_alone(llm, tiny_model, tmp_path):
    ok = write_lines(tmp_path / "ok.jsonl", [request(f"r{i}", prompt=f"p {i}", max_tokens=2) for i in range(3)])
    (tmp_path / "ok.jsonl").write_bytes(b"\xef\xbb\xbf" + (tmp_path / "ok.jsonl").read_bytes())  # an editor's BOM
    assert run(llm, tiny_model, ok, tmp_path / "ok.out") == 0
    before = (tmp_path / "ok.out").read_bytes()
    assert run(llm, tiny_model, ok, tmp_path / "ok.out") == 0  # nothing left to do
    assert (tmp_path / "ok.out").read_bytes() == before
    bad = write_lines(tmp_path / "bad.jsonl", [request("r0", prompt="p", max_tokens=2), "{oops"])
    assert run(llm, tiny_model, bad, tmp_path / "bad.out") == 1
    assert run(llm, tiny_model, bad, tmp_path / "bad.out") == 1  # the failure written before still counts
    assert len(read_results(tmp_path / "bad.out")) == 2


def test_output_problems_are_clear_errors_before_any_work(llm, tiny_model, tmp_path, capsys):
    inp = write_lines(tmp_path / "in.jsonl", [request("a", prompt="p", max_tokens=2)])
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"id": "batch_req_line1", "custom_id": null}\nnot a result line\n{"custom_id": "b"}\n')
    assert run(llm, tiny_model, inp, foreign) == 2
    assert "foreign.jsonl line 2 is not a result line" in capsys.readouterr().err
    assert foreign.read_text().count("\n") == 3  # untouched
    locked = tmp_path / "locked.jsonl"
    first = ResultsFile.open(str(locked))  # as another run holds it (a shared lock would let both write)
    try:
        assert run(llm, tiny_model, inp, locked) == 2
    finally:
        first.close()
    assert "another process is writing" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["-i", inp, "-o", inp, "--model", tiny_model])
    assert "the output file is the input file" in capsys.readouterr().err


def test_closing_the_results_file_twice_closes_nothing_else(tmp_path):
    """close() is idempotent: a second call neither fails nor closes the file that took the descriptor's number."""
    results = ResultsFile.open(str(tmp_path / "out.jsonl"))
    results.close()
    other = os.open(tmp_path / "other", os.O_CREAT | os.O_WRONLY)  # most likely takes the number just freed
    try:
        results.close()
        os.fstat(other)  # still open
    finally:
        os.close(other)


def test_results_are_written_while_input_still_streams(llm, tiny_model, tmp_path):
    fifo = tmp_path / "requests.fifo"
    os.mkfifo(fifo)
    out = tmp_path / "out.jsonl"
    status = {}
    thread = threading.Thread(target=lambda: status.setdefault("code", run(llm, tiny_model, fifo, out)), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while True:  # opening a FIFO blocks until the other end opens it: wait for the runner without hanging
        try:
            writer = os.fdopen(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK), "w")
            break
        except OSError:  # ENXIO: no reader yet
            assert time.monotonic() < deadline and thread.is_alive(), f"the runner did not open its input: {status}"
            time.sleep(0.02)
    os.set_blocking(writer.fileno(), True)
    with writer:
        for i in range(2):
            writer.write(json.dumps(request(f"early-{i}", prompt=f"p {i}", max_tokens=3)) + "\n")
        writer.flush()
        while not (out.exists() and out.read_text().count("\n") == 2):  # written with no EOF in sight yet
            assert time.monotonic() < deadline, "finished results were not written while the input was open"
            time.sleep(0.05)
        writer.write(json.dumps(request("late", prompt="p", max_tokens=3)) + "\n")
    thread.join(60)
    assert status.get("code") == 0 and sorted(read_results(out)) == ["early-0", "early-1", "late"]


@pytest.mark.parametrize("flags, window", [(("--max-in-flight", "3"), 3), (("--max-num-seqs", "2"), 4)],
                         ids=["max-in-flight", "default"])
def test_at_most_max_in_flight_requests_are_in_the_engine(llm, tiny_model, tmp_path, monkeypatch, flags, window):
    """--max-in-flight requests at most are in the engine; without it 2 x --max-num-seqs (one batch running, one
    waiting), a flag that sets the window even with an engine given."""
    live, peak = [], [0]
    submit = llm.submit

    def counting_submit(*args, **kwargs):
        handle = submit(*args, **kwargs)
        live[:] = [h for h in live if not h.finished] + [handle]
        peak[0] = max(peak[0], len(live))
        return handle

    monkeypatch.setattr(llm, "submit", counting_submit)
    lines = [request(f"r{i}", prompt=f"prompt {i}", max_tokens=8, ignore_eos=True) for i in range(24)]
    assert run(llm, tiny_model, write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl", *flags) == 0
    assert len(read_results(tmp_path / "out.jsonl")) == 24 and peak[0] == window


def test_an_engine_failure_stops_the_run_and_a_rerun_finishes_it(llm, tiny_model, tmp_path, monkeypatch):
    lines = [request(f"r{i}", prompt=f"prompt {i}", max_tokens=6, ignore_eos=True) for i in range(12)]
    inp, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    seen, run_step = set(), llm.model_runner.run

    def failing_run(seqs):  # fails at the first step with a fifth request: one that could only come in after
        seen.update(seq.seq_id for seq in seqs)  # a result was written, so some (not all) are written,
        if len(seen) > 4:  # however the steps fall (counting steps was timing-dependent and once failed CI)
            raise RuntimeError("injected engine failure")
        return run_step(seqs)

    monkeypatch.setattr(llm.model_runner, "run", failing_run)
    assert run(llm, tiny_model, inp, out, "--max-in-flight", "4") == 3
    written = read_results(out)
    assert 0 < len(written) < 12 and all(r["error"] is None for r in written.values())
    monkeypatch.undo()
    assert run(llm, tiny_model, inp, out) == 0
    assert sorted(read_results(out)) == sorted(f"r{i}" for i in range(12))
    assert llm.is_finished()


def at_submit(llm, monkeypatch, prompt: str, act, nth: int = 1):
    """llm.submit calls act(handle) on the nth submission of `prompt` as soon as it is made; monkeypatch.undo()
    ends it."""
    submit, prompt_ids, seen = llm.submit, llm.encode(prompt), [0]

    def submit_then_act(ids, params):
        handle = submit(ids, params)
        seen[0] += ids == prompt_ids
        if ids == prompt_ids and seen[0] == nth:
            act(handle)
        return handle

    monkeypatch.setattr(llm, "submit", submit_then_act)


def abort_at_submit(llm, monkeypatch, prompt: str, nth: int = 1):
    """The nth submission of `prompt` is aborted as soon as it is made, as when someone else ends the request (or
    closes the engine)."""
    at_submit(llm, monkeypatch, prompt, lambda handle: handle.abort(), nth)


def test_an_aborted_request_is_not_a_result(llm, tiny_model, tmp_path, monkeypatch, capsys):
    lines = [request(f"r{i}", prompt=f"prompt {i}", max_tokens=200, ignore_eos=True) for i in range(3)]
    inp, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    abort_at_submit(llm, monkeypatch, "prompt 1")
    assert run(llm, tiny_model, inp, out) == 3
    assert sorted(read_results(out)) == ["r0", "r2"]
    assert "1 stopped before they finished" in capsys.readouterr().err
    monkeypatch.undo()
    assert run(llm, tiny_model, inp, out) == 0 and sorted(read_results(out)) == ["r0", "r1", "r2"]


def test_one_aborted_choice_of_several_is_no_result(llm, tiny_model, tmp_path, monkeypatch, capsys):
    """A request of n=2 whose second choice was aborted is no result (it is served again by the next run), while
    the run goes on with the others: one aborted choice must not make the whole line a failure of the run."""
    lines = [request("r0", prompt="prompt 0", max_tokens=60, ignore_eos=True),
             request("r1", prompt="prompt 1", max_tokens=3, ignore_eos=True, n=2),  # finishes first
             request("r2", prompt="prompt 2", max_tokens=60, ignore_eos=True)]
    inp, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    abort_at_submit(llm, monkeypatch, "prompt 1", nth=2)
    assert run(llm, tiny_model, inp, out) == 3
    err = capsys.readouterr().err
    assert "the run stopped" not in err and "1 stopped before they finished" in err
    assert sorted(read_results(out)) == ["r0", "r2"]
    monkeypatch.undo()
    assert run(llm, tiny_model, inp, out) == 0 and len(choices(read_results(out)["r1"])) == 2


def poison_at_submit(llm, monkeypatch, prompt: str, nth: int = 1, callback: str = "_on_token"):
    """The nth submission of `prompt` fails on its own at its next token (or as it finishes: `_on_finish`), as a
    request whose bookkeeping raises does (`LLMEngine._fail_request`): the engine and the requests beside it go
    on."""
    def undecodable(*args):
        raise ValueError("injected undecodable token")

    at_submit(llm, monkeypatch, prompt, lambda handle: setattr(handle, callback, undecodable), nth)


@pytest.mark.parametrize("n, callback", [(1, "_on_token"), (2, "_on_token"), (1, "_on_finish")])
def test_a_request_that_fails_on_its_own_is_an_error_line_not_a_rerun(llm, tiny_model, tmp_path, monkeypatch,
                                                                      capsys, n, callback):
    """A request whose own bookkeeping raises (a poisoned line: its token's, or its output's as it finishes) gets a
    server_error line and the job goes on to exit 1: before, the run stopped with 3 (run it again), and every
    rerun failed the same line the same way. With n=2 the line's first choice fails while its second runs on: the
    line is still one error line."""
    lines = [request(f"r{i}", prompt=f"prompt {i}", max_tokens=40 if i == 1 else 8, ignore_eos=True,
                     n=n if i == 1 else 1) for i in range(3)]
    inp, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    poison_at_submit(llm, monkeypatch, "prompt 1", callback=callback)
    assert run(llm, tiny_model, inp, out) == 1
    results = read_results(out)
    assert sorted(results) == ["r0", "r1", "r2"]
    assert results["r0"]["error"] is None and results["r2"]["error"] is None
    assert results["r1"]["response"] is None and results["r1"]["error"]["code"] == "server_error"
    assert "ValueError: injected undecodable token" in results["r1"]["error"]["message"]
    assert "1 failed (server_error 1)" in capsys.readouterr().err
    monkeypatch.undo()
    assert run(llm, tiny_model, inp, out) == 1 and len(read_results(out)) == 3  # nothing left to serve
    assert llm.is_finished()


def test_finish_aborts_the_other_choices_of_a_choice_that_failed_on_its_own(llm, monkeypatch):
    """Ray's replicas call `finish` at once, not after every choice finished: a choice that failed on its own
    makes the line an error, and the choices still running are aborted, not left to run to max_tokens."""
    from nanovllm.batch.executor import BatchExecutor
    executor = BatchExecutor(llm, "tiny")
    poison_at_submit(llm, monkeypatch, "prompt 1")
    pending = executor.start(parse_request(request("r1", prompt="prompt 1", max_tokens=MAX_MODEL_LEN // 2,
                                                   ignore_eos=True, n=2), "r1", 7))
    line, tokens = within(30, executor.finish, pending)
    assert line["error"]["code"] == "server_error" and "line 7" in line["error"]["message"] and tokens == 0
    assert within(30, pending.handles[1].result)["finish_reason"] == "abort"


def test_a_run_with_failed_lines_that_stopped_early_says_run_again(llm, tiny_model, tmp_path, monkeypatch):
    """Exit status 3 (run the same command again) wins over 1 (some line failed): a caller that only retries on
    3 must not take an unfinished run for a finished one because it also holds a bad line."""
    lines = [request(f"r{i}", prompt=f"prompt {i}", max_tokens=20, ignore_eos=True) for i in range(2)] + ["{oops"]
    inp, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    abort_at_submit(llm, monkeypatch, "prompt 1")
    assert run(llm, tiny_model, inp, out) == 3
    monkeypatch.undo()
    assert run(llm, tiny_model, inp, out) == 1  # finished now: only the bad line failed
    assert len(read_results(out)) == 3


def test_summary_counts_this_run_and_the_earlier_one(llm, tiny_model, tmp_path, capsys):
    """The closing summary on stderr counts completion tokens, and, on a resumed run, how many of the lines an
    earlier run wrote were failures (not this run's failures)."""
    lines = [request(f"r{i}", prompt=f"prompt {i}", max_tokens=3, ignore_eos=True) for i in range(2)] + ["{oops"]
    inp, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    assert run(llm, tiny_model, inp, out) == 1
    assert "3 lines: 2 served, 1 failed (invalid_json 1); 6 completion tokens" in capsys.readouterr().err
    write_lines(inp, lines + [request("r2", prompt="prompt 2", max_tokens=4, ignore_eos=True)])
    assert run(llm, tiny_model, inp, out) == 1
    err = capsys.readouterr().err
    assert "4 lines: 1 served, 0 failed; 3 written by an earlier run (1 of them failed); 4 completion tokens" in err


def test_chat_template_from_a_file(llm, tiny_model, tmp_path):
    """--chat-template names a file holding the template, or is the template itself; both give the same prompt."""
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
    (tmp_path / "template.jinja").write_text(template)
    conversation = [{"role": "user", "content": "Hello!"}]
    inp = write_lines(tmp_path / "in.jsonl", [request("c", CHAT, messages=conversation, max_tokens=3, temperature=0)])
    expected = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False,
                        chat_template=template)[0]
    for given in (str(tmp_path / "template.jinja"), template):
        out = tmp_path / f"out{len(given)}.jsonl"
        assert run(llm, tiny_model, inp, out, "--chat-template", given) == 0
        result = read_results(out)["c"]
        assert result["response"]["body"]["usage"]["prompt_tokens"] == len(llm.apply_chat_template(conversation,
                                                                                                  template))
        assert choices(result)[0]["message"]["content"] == expected["text"]


def test_token_text_keeps_special_tokens(llm):
    """A logprob entry for a special token (an end-of-turn token, say) names it, rather than an empty string."""
    from nanovllm.batch.executor import BatchExecutor
    special = llm.tokenizer.all_special_ids[0]
    text = BatchExecutor(llm, "m").token_text(special)
    assert text and text == llm.decode([special], skip_special_tokens=False)


def test_count_lines(tmp_path):
    """The progress bar's total: a last line without its newline is a line too; stdin has no total."""
    from nanovllm.run_batch import count_lines
    for data, lines in ((b"", 0), (b"a\n", 1), (b"a\nb", 2), (b"a\nb\n", 2)):
        (tmp_path / "f").write_bytes(data)
        assert count_lines(str(tmp_path / "f")) == lines, data
    assert count_lines("-") is None


@dataclasses.dataclass
class FutureConfig:  # Config with engine arguments that do not exist yet
    model: str
    max_num_seqs: int = 512
    new_knob: float = 0.5
    use_thing: bool = False
    maybe_count: int | None = None
    mode: typing.Literal["fast", "safe"] = "fast"
    overrides: dict = dataclasses.field(default_factory=dict)
    hf_config: object = None


def test_engine_flags_follow_config_fields(capsys):
    parser, names = build_parser(FutureConfig)
    assert names == ["max_num_seqs", "new_knob", "use_thing", "maybe_count", "mode", "overrides"]
    args = parser.parse_args(["-i", "a", "-o", "b", "--model", "m", "--new-knob", "0.25", "--use-thing",
                              "--maybe-count", "3", "--mode", "safe", "--overrides", '{"rope_theta": 1e4}'])
    assert (args.new_knob, args.use_thing, args.maybe_count) == (0.25, True, 3)
    assert (args.mode, args.overrides) == ("safe", {"rope_theta": 1e4})
    assert not hasattr(args, "max_num_seqs")  # not given: the engine's default applies
    for bad, message in ((["--new-knob", "x"], "invalid float value: 'x'"),
                         (["--max-num-seq", "4"], "unrecognized arguments: --max-num-seq"),
                         (["--bogus"], "unrecognized arguments: --bogus"),
                         (["--mode", "slow"], "invalid choice: 'slow'")):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(["-i", "a", "-o", "b", "--model", "m", *bad])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    from nanovllm.config import Config
    real = {f.name for f in dataclasses.fields(Config)} - {"model", "hf_config", "eos_token_ids"}
    assert set(build_parser()[1]) == real


def test_an_optional_engine_flag_takes_its_type(capsys):
    """An Optional[int] field is an int flag, not JSON: 2.5 or [1] is a command-line error, not a value."""
    parser, _ = build_parser(FutureConfig)
    for bad in ("2.5", "[1]"):
        with pytest.raises(SystemExit):
            parser.parse_args(["-i", "a", "-o", "b", "--model", "m", "--maybe-count", bad])
        assert f"invalid int value: '{bad}'" in capsys.readouterr().err


def test_counts_below_one_are_command_line_errors(tmp_path, capsys):
    """--max-in-flight 0 (nothing could ever run) and a zero timeout are rejected before any work, with exit 2."""
    inp = write_lines(tmp_path / "in.jsonl", [request("a", prompt="p")])
    for flag in ("--max-in-flight", "--ray-start-timeout", "--data-parallel-size"):
        with pytest.raises(SystemExit) as exit_info:
            main(["-i", inp, "-o", str(tmp_path / "out"), "--model", "m", flag, "0"])
        assert exit_info.value.code == 2 and f"{flag}=0 must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_missing_input_file_is_a_command_line_error(tmp_path, capsys):
    """An input file that does not exist is exit 2 with a message naming it, before any work: no output file is
    made and no model is loaded."""
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(SystemExit) as exit_info:
        main(["-i", missing, "-o", str(tmp_path / "out"), "--model", "m"])
    assert exit_info.value.code == 2 and f"input file {missing!r} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_bad_engine_argument_is_a_clear_error(tiny_model, tmp_path, capsys):
    inp = write_lines(tmp_path / "in.jsonl", [request("a", prompt="p")])
    assert main(["-i", inp, "-o", str(tmp_path / "out"), "--model", tiny_model, "--kvcache-block-size", "24"]) == 2
    assert "kvcache_block_size=24" in capsys.readouterr().err
