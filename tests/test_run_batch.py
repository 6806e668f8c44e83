"""The batch runner against LLM.generate/chat: bad lines, exit statuses, streaming, the window, the command line."""
import dataclasses
import json
import os
import signal
import time
import typing
from types import SimpleNamespace

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.batch.executor import BatchExecutor
from nanovllm.batch.intake import intake
from nanovllm.batch.protocol import MAX_N, MIN_LOGPROB, LineError, parse_request, result_line
from nanovllm.batch.results import ResultsFile, signals_held
from nanovllm.config import Config
from nanovllm.engine.llm_engine import sampling_defaults
from nanovllm.run_batch import build_parser, count_lines, main
from tests.batch_util import (CHAT, COMPLETIONS, at_submit, body, choices, main_here, on_submit, poison_at_submit,
                              read_results, request, tear_first_line_then_signal, write_lines)
from tests.conftest import greedy, in_background, within

MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, kvcache_block_size=16, max_model_len=MAX_MODEL_LEN) as engine:
        yield engine


def run(llm, input_path, output_path, *flags, here=False) -> int:
    """run_batch's main on a thread, or on this one (`main_here`) where signals are handled."""
    argv = ["-i", str(input_path), "-o", str(output_path), "--model", llm.config.model, "--no-progress", *flags]
    return main_here(argv, llm=llm) if here else within(120, main, argv, llm=llm)


def files(tmp_path, lines):  # (in.jsonl holding `lines`, out.jsonl)
    return write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"


def numbered(count: int, max_tokens: int, second: dict | None = None) -> list[dict]:
    """Requests r0, r1, ... of "prompt {i}"; `second` overrides fields of r1's body."""
    lines = [request(f"r{i}", prompt=f"prompt {i}", max_tokens=max_tokens, ignore_eos=True) for i in range(count)]
    lines[1]["body"].update(second or {})
    return lines


def short(count: int) -> list[dict]:
    return [request(f"r{i}", prompt=f"p {i}", max_tokens=2) for i in range(count)]


def user(content) -> list[dict]:
    return [{"role": "user", "content": content}]


def x(custom_id, url=COMPLETIONS, **fields) -> dict:
    """A line of prompt "x", or of the user message "x" (CHAT)."""
    return request(custom_id, url, **({"prompt": "x"} if url == COMPLETIONS else {"messages": user("x")}), **fields)


def test_results_equal_generate_and_chat(llm, tmp_path):
    def expect(prompts, params):
        return llm.generate(prompts, params, use_tqdm=False)

    plain = expect(["Once upon a time"], greedy(12))[0]["text"]
    stop = plain[4:6].strip() or plain[4:6]  # a string the greedy output is known to contain
    conversation = [{"role": "system", "content": "Be brief."}, *user("Hi!")]
    texts = {  # custom_id: the prompts, and the fields a line and SamplingParams share (all greedy)
        "text": (["Hello there"], dict(max_tokens=10)), "ids": ([[5, 6, 7, 8]], dict(max_tokens=6, logprobs=3)),
        "stop": (["Once upon a time"], dict(max_tokens=12, stop=[stop], ignore_eos=True)),
        "two": (["The sea", "The moon"], dict(max_tokens=5)),
        "penalty": (["the the the"], dict(max_tokens=9, presence_penalty=1.5, frequency_penalty=0.5, top_p=0.9)),
        "usage": (["The sea is", "The moon over the hills"], dict(max_tokens=2))}
    lines = [request(k, prompt=p if len(p) > 1 else p[0], temperature=0, **kw) for k, (p, kw) in texts.items()] + [
        request("chat", CHAT, messages=conversation, max_completion_tokens=8, temperature=0, logprobs=True,
                top_logprobs=2),
        request("parts", CHAT, messages=user([{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]),
                max_tokens=5, temperature=0),
        request("seeded", CHAT, messages=conversation, max_tokens=7, n=2, seed=7, temperature=1.0),
        request("unbounded", prompt=list(range(3, 123)), temperature=0, ignore_eos=True),  # to max_model_len
        request("full", prompt=list(range(3, 3 + MAX_MODEL_LEN)), temperature=0, ignore_eos=True),  # fits exactly
    ]
    inp, out = files(tmp_path, lines)
    assert run(llm, inp, out) == 0
    results = read_results(out)
    assert sorted(results) == sorted(line["custom_id"] for line in lines)
    chat_ids = llm.apply_chat_template(conversation)
    expected = {k: expect(p, SamplingParams(temperature=0, **kw)) for k, (p, kw) in texts.items()} | {
        "chat": llm.chat(conversation, SamplingParams(temperature=0, max_tokens=8, logprobs=2), use_tqdm=False),
        "parts": llm.chat(user("Hi\n!"), SamplingParams(temperature=0, max_tokens=5), use_tqdm=False),
        "seeded": expect([chat_ids] * 2, [SamplingParams(max_tokens=7, seed=seed) for seed in (7, 8)]),
        "unbounded": expect([list(range(3, 123))], greedy(MAX_MODEL_LEN - 120)),
        "full": expect([list(range(3, 3 + MAX_MODEL_LEN))], greedy(1)),
    }
    usage = {k: body(results[k])["usage"] for k in expected}
    for custom_id, outputs in expected.items():
        result, is_chat = results[custom_id], custom_id in ("chat", "parts", "seeded")
        assert result["error"] is None and result["response"]["status_code"] == 200
        assert body(result)["object"] == ("chat.completion" if is_chat else "text_completion")
        assert [c["index"] for c in choices(result)] == list(range(len(outputs)))
        for choice, out in zip(choices(result), outputs):
            assert (choice["message"]["content"] if is_chat else choice["text"]) == out["text"], custom_id
            assert choice["finish_reason"] == out["finish_reason"] and choice["stop_reason"] == out["stop_reason"]
        n = usage[custom_id]
        assert n["completion_tokens"] == sum(len(o["token_ids"]) for o in outputs)
        assert n["total_tokens"] == n["prompt_tokens"] + n["completion_tokens"]
    first = {k: choices(results[k])[0] for k in expected}
    assert first["stop"]["stop_reason"] == stop and stop not in first["stop"]["text"]
    assert len(expected["unbounded"][0]["token_ids"]) == 8 and first["unbounded"]["finish_reason"] == "length"
    # with no max_tokens, a prompt of exactly max_model_len gets one token, not max_tokens=0
    assert first["full"]["finish_reason"] == "length" and usage["full"]["completion_tokens"] == 1
    # the prompt tokens of every prompt
    assert usage["usage"]["prompt_tokens"] == len(llm.encode("The sea is")) + len(llm.encode("The moon over the hills"))
    assert first["seeded"]["message"] != choices(results["seeded"])[1]["message"]
    assert usage["chat"]["prompt_tokens"] == len(chat_ids)

    def engine_logprobs(custom_id):  # of the tokens it sampled
        out = expected[custom_id][0]
        return pytest.approx([lp[t] for t, lp in zip(out["token_ids"], out["logprobs"])])

    # logprobs in OpenAI's shapes, the engine's values
    chat_lp, text_lp = first["chat"]["logprobs"]["content"], first["ids"]["logprobs"]
    assert [e["logprob"] for e in chat_lp] == engine_logprobs("chat")
    assert all(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"]
               and e["bytes"] == list(e["token"].encode()) for e in chat_lp)
    assert len(text_lp["tokens"]) == len(text_lp["text_offset"]) == len(expected["ids"][0]["token_ids"])
    assert text_lp["token_logprobs"] == engine_logprobs("ids")
    assert all(1 <= len(top) <= 3 for top in text_lp["top_logprobs"])
    assert first["text"]["logprobs"] is None


BAD_LINES = {  # code: [(line, what the message must name)]; each line's number is in its message too
    "invalid_json": [("this is not json", "not valid JSON"), (b'{"custom_id": "\xff\xfe"}', "not UTF-8"),
                     ('{"n": ' + "9" * 5000 + "}", "digits"), ("[" * 10**5 + "]" * 10**5, "recursion")],
    "invalid_request": [
        ('[1, 2]', "not an object"), ({**x("get"), "method": "GET"}, "'GET'"),
        ({k: v for k, v in x("no-method").items() if k != "method"}, "not None"),
        ({**x("extra"), "priority": 1}, "priority"), ({**x("body"), "body": "prompt"}, "body must be")],
    "missing_custom_id": [({"method": "POST", "url": COMPLETIONS, "body": {"prompt": "x"}}, "no custom_id")],
    "invalid_custom_id": [(x(5), "5"), (x(""), "''")],  # "": not missing
    "duplicate_custom_id": [(request("good-1", prompt="again"), "'good-1' was already used on line 1")],
    "invalid_url": [(request("url", "/v1/embeddings", input="x"), "/v1/embeddings")],
    "invalid_value": [
        (x("temp", temperature=-1), "temperature=-1.0"), (x("temp-int", top_p=10**400), "top_p=inf"),
        (x("typo", temprature=0), "temprature"), (x("bias", logit_bias={"5": 1}), "logit_bias"),
        (x("echo", echo=True), "echo"), (x("n0", n=0), "n=0"), (x("n129", n=129), "n=129"),
        (x("maxtok", max_tokens="10"), "max_tokens='10'"),
        (x("maxtok0", max_tokens=0), "max_tokens=0"),  # not "unbounded"
        # each field is checked, by its own name, though max_completion_tokens wins
        (x("maxtok-both", CHAT, max_tokens=-1, max_completion_tokens=5), "max_tokens=-1"),
        (x("maxcomp0", CHAT, max_tokens=5, max_completion_tokens=0), "max_completion_tokens=0"),
        (x("stream", stream=True), "stream"), (x("stream-str", stream="false"), "stream"),  # only false is false
        (request("empty", prompt=""), "empty"), (request("noprompt"), "prompt must be"),
        (request("vocab", prompt=[5, 99999]), "outside the vocabulary"),
        (x("stop-id", stop_token_ids=[99999]), "stop token id 99999"),
        (request("msgs", CHAT, messages=user(5)), "content"),
        (request("image", CHAT, messages=user([{"type": "image_url"}])), "'text'"),
        (request("nomsgs", CHAT, messages=[]), "messages must be a non-empty list"),
        (x("toplp", CHAT, top_logprobs=2), "top_logprobs needs logprobs=true"),
        # logprobs=false given is not enough
        (x("toplp-false", CHAT, top_logprobs=2, logprobs=False), "top_logprobs needs logprobs=true"),
        (x("chatlp", CHAT, logprobs=5), "logprobs=5"), (x("lp21", logprobs=21), r"logprobs=21 must be in [0, 20]"),
        (request("role", CHAT, messages=[{"role": "system", "content": "Hi"}, {"content": "Hi"}]),
         "messages[1] must be an object with a string role"),  # found as the line is parsed
        (request("role5", CHAT, messages=[{"role": "system", "content": "Hi"}, {"role": 5, "content": "Hi"}]),
         "messages[1] must be an object with a string role")],
    "prompt_too_long": [
        (request("long-ids", prompt=list(range(3, 3 + MAX_MODEL_LEN + 1))),
         f"{MAX_MODEL_LEN + 1} tokens, more than max_model_len={MAX_MODEL_LEN}"),
        (request("long-text", prompt="the sea and the moon " * 60), "max_model_len"),
        (request("long-chat", CHAT, messages=user("hello " * 200)), "max_model_len")],
}
BAD = [(line, code, named) for code, cases in BAD_LINES.items() for line, named in cases]


def test_each_bad_line_gets_an_error_line_and_the_job_goes_on(llm, tmp_path):
    good = [request(f"good-{i}", prompt=f"fine {i}", max_tokens=3, temperature=0) for i in (1, 2)]
    inp, out = files(tmp_path, good[:1] + [line for line, _, _ in BAD] + ["", "   "] + good[1:])
    assert run(llm, inp, out) == 1
    results = read_results(out)
    assert len(results) == len(BAD) + 2  # blank lines are no requests
    for i, (line, code, named) in enumerate(BAD, start=2):
        # a JSON object's custom_id is kept, unless it is what is wrong
        custom_id = line.get("custom_id") if isinstance(line, dict) and "custom_id" not in code else None
        result = results[custom_id if custom_id is not None else f"batch_req_line{i}"]
        assert result["custom_id"] == custom_id and result["response"] is None, line
        error = result["error"]
        assert error["code"] == code and named in error["message"] and f"line {i}" in error["message"], (line, error)
    for key in ("good-1", "good-2"):
        assert results[key]["error"] is None and len(choices(results[key])[0]["text"]) > 0
    assert llm.is_finished()  # nothing of a rejected line was left queued


def parse(line: dict, number: int = 1):
    return parse_request(line, line["custom_id"], number)


def test_body_fields_as_openai_clients_write_them():
    # model, user and metadata are ignored
    parsed = parse(x("a", CHAT, model="gpt-4o-mini", user="u1", metadata={"k": "v"}, max_tokens=50,
                     max_completion_tokens=7, n=MAX_N, logprobs=True, top_logprobs=20))
    assert (parsed.max_tokens, parsed.n, parsed.sampling["logprobs"]) == (7, MAX_N, 20)
    assert "model" not in parsed.sampling and "user" not in parsed.sampling
    assert parse(x("b", model="m", max_tokens=5, logprobs=0), 2).max_tokens == 5
    parsed = parse(x("e", CHAT, logprobs=True, max_completion_tokens=None, max_tokens=3, n=None), 5)
    assert (parsed.sampling["logprobs"], parsed.max_tokens, parsed.n) == (0, 3, 1)  # null: not given
    assert "logprobs" not in parse(x("f", CHAT, logprobs=False), 6).sampling
    with pytest.raises(LineError, match=r"n=129 must be in \[1, 128\]"):
        parse(x("c", n=MAX_N + 1), 3)
    with pytest.raises(LineError, match=r"top_logprobs=21 must be in \[0, 20\]"):
        parse(x("d", CHAT, logprobs=True, top_logprobs=21), 4)


def test_vllm_sampling_fields_reach_the_sampling_params():
    # vLLM's extra sampling fields and OpenAI's reach SamplingParams as given
    fields = dict(temperature=0.5, top_p=0.9, presence_penalty=0.25, frequency_penalty=-0.5, min_p=0.05,
                  repetition_penalty=1.1, top_k=7, min_tokens=2, ignore_eos=True, stop_token_ids=[3, 4],
                  skip_special_tokens=False, seed=11, stop=["\n\n"])
    for line in (x("a", **fields), x("b", CHAT, **fields)):
        assert parse(line).sampling == fields
        SamplingParams(**parse(line).sampling)


def test_fields_a_line_leaves_out_take_the_models_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "top_k": 20, "top_p": null}')
    got = []
    llm = SimpleNamespace(config=SimpleNamespace(max_model_len=64), sampling_defaults=sampling_defaults(str(tmp_path)),
                          encode=list, submit=lambda ids, params: got.append(params))
    BatchExecutor(llm, "m").start(parse(x("a", top_k=5)))
    assert (got[0].temperature, got[0].top_k, got[0].top_p) == (0.6, 5, 1.0)


def test_result_line_usage_and_logprobs():
    """Cached tokens once a prompt, -inf logprobs clamped (JSON has none), text_offset in characters."""
    texts = {5: "ab", 6: "cde", 7: "f"}
    outputs = [{"text": "abcde", "token_ids": [5, 6], "logprobs": [{5: -0.5, 7: -0.25}, {6: float("-inf")}],
                "finish_reason": "length", "stop_reason": None, "num_cached_tokens": 16},
               {"text": "f", "token_ids": [7], "logprobs": [{7: -0.25}],
                "finish_reason": "stop", "stop_reason": None, "num_cached_tokens": 32}]
    line = result_line(parse(x("c", logprobs=1, n=2)), outputs, 40, "m", texts.get)
    assert body(line)["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
    first = choices(line)[0]["logprobs"]
    assert first["tokens"] == ["ab", "cde"] and first["text_offset"] == [0, 2]
    assert first["token_logprobs"] == [-0.5, MIN_LOGPROB]  # top_logprobs: the sampled token too, as OpenAI's
    assert first["top_logprobs"] == [{"f": -0.25, "ab": -0.5}, {"cde": MIN_LOGPROB}]
    chat = parse(x("h", CHAT, logprobs=True, top_logprobs=1, n=2), 2)
    content = choices(result_line(chat, outputs, 40, "m", texts.get))[0]["logprobs"]["content"]
    assert content[1]["logprob"] == MIN_LOGPROB and content[1]["top_logprobs"][0]["logprob"] == MIN_LOGPROB
    assert [e["token"] for e in content[0]["top_logprobs"]] == ["f"]  # the k likeliest only
    json.loads(json.dumps(line, allow_nan=False))  # plain JSON throughout


def test_a_request_rejected_part_way_through_submitting_leaves_nothing_running(llm, tmp_path, monkeypatch):
    """min_tokens fits the short prompt's room, not the long one's: the short one, submitted, is aborted."""
    submitted = []
    on_submit(llm, monkeypatch, lambda handle, ids: submitted.append(handle))
    inp, out = files(tmp_path, [request("split", prompt=["short", list(range(3, 3 + MAX_MODEL_LEN - 8))],
                                        min_tokens=100, ignore_eos=True)])
    assert run(llm, inp, out) == 1
    error = read_results(out)["split"]["error"]
    assert error["code"] == "invalid_value" and "min_tokens=100" in error["message"], error
    assert len(submitted) == 1 and submitted[0].result(timeout=60)["finish_reason"] == "abort"


def test_a_ctrl_c_part_way_through_submitting_leaves_nothing_running(llm, tmp_path, monkeypatch):
    submitted, submit = [], llm.submit

    def interrupted_submit(ids, params):  # a ^C as the second choice goes in
        if submitted:
            raise KeyboardInterrupt
        submitted.append(submit(ids, params))
        return submitted[-1]

    monkeypatch.setattr(llm, "submit", interrupted_submit)
    inp, out = files(tmp_path, [request("two", prompt="p", n=2, ignore_eos=True)])
    assert run(llm, inp, out) == 130
    assert submitted[0].result(timeout=60)["finish_reason"] == "abort"


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_as_the_run_closes_waits_for_its_clean_up(llm, tmp_path, monkeypatch, capsys, sig, status):
    close = ResultsFile.close

    def signalled_close(self):  # (as its fsync runs)
        os.kill(os.getpid(), sig)
        close(self)

    monkeypatch.setattr(ResultsFile, "close", signalled_close)
    inp, out = files(tmp_path, short(3))
    assert run(llm, inp, out, here=True) == status
    assert len(read_results(out)) == 3 and "3 lines: 3 served" in capsys.readouterr().err


@pytest.mark.parametrize("first, counted", [(None, ["1 served", "1 stopped before"]), ("not json", ["1 failed"])])
def test_a_signal_never_cuts_a_result_line(llm, tmp_path, monkeypatch, capsys, first, counted):
    """A SIGTERM as a pipe takes part of the first line (result or error): the rest follows, counted; the run stops."""
    lines = short(2)
    inp, out = files(tmp_path, [first] + lines if first else lines)
    signalled = tear_first_line_then_signal(monkeypatch)
    assert run(llm, inp, out, here=True) == 143
    monkeypatch.undo()
    assert signalled and len(read_results(out)) == 1
    err = capsys.readouterr().err
    assert all(text in err for text in counted), err


def test_signals_held_delivers_each_signal_that_came_once_after_the_block():
    # as while a line is written; a second SIGTERM adds nothing
    got = []
    previous = {signum: signal.signal(signum, lambda signum, frame: got.append(signum))
                for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        with signals_held():
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGTERM):
                signal.raise_signal(signum)
            assert got == []
        assert got == [signal.SIGTERM, signal.SIGINT]
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def test_signals_held_leaves_a_handler_set_outside_python_alone(monkeypatch):
    """A handler set outside Python (getsignal: None) cannot be put back: nothing is held, the signal runs it now."""
    got = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        getsignal = signal.getsignal
        monkeypatch.setattr(signal, "getsignal", lambda signum: None if signum == signal.SIGTERM else getsignal(signum))
        with signals_held():
            signal.raise_signal(signal.SIGTERM)
            assert got == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_exit_status_and_a_finished_file_is_left_alone(llm, tmp_path):
    lines = short(3)
    inp, out = files(tmp_path, [b"\xef\xbb\xbf" + json.dumps(lines[0]).encode(), *lines[1:]])  # an editor's BOM
    assert run(llm, inp, out) == 0
    before = out.read_bytes()
    assert run(llm, inp, out) == 0 and out.read_bytes() == before  # nothing left to do


def test_output_problems_are_clear_errors_before_any_work(llm, tiny_model, tmp_path, capsys):
    inp = write_lines(tmp_path / "in.jsonl", [request("a", prompt="p", max_tokens=2)])
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"id": "batch_req_line1", "custom_id": null}\nnot a result line\n{"custom_id": "b"}\n')
    assert run(llm, inp, foreign) == 2
    assert "foreign.jsonl line 2 is not a result line" in capsys.readouterr().err
    assert foreign.read_text().count("\n") == 3  # untouched
    locked = tmp_path / "locked.jsonl"
    first = ResultsFile.open(str(locked))  # as another run holds it (a shared lock would let both write)
    try:
        assert run(llm, inp, locked) == 2
    finally:
        first.close()
    assert "another process is writing" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["-i", inp, "-o", inp, "--model", tiny_model])
    assert "the output file is the input file" in capsys.readouterr().err


def test_closing_the_results_file_twice_closes_nothing_else(tmp_path):
    results = ResultsFile.open(str(tmp_path / "out.jsonl"))
    results.close()
    other = os.open(tmp_path / "other", os.O_CREAT | os.O_WRONLY)  # most likely takes the number just freed
    try:
        results.close()
        os.fstat(other)  # still open
    finally:
        os.close(other)


def test_results_are_written_while_input_still_streams(llm, tmp_path):
    fifo = tmp_path / "requests.fifo"
    os.mkfifo(fifo)
    out = tmp_path / "out.jsonl"
    thread, status = in_background(run, llm, fifo, out)
    deadline = time.monotonic() + 60
    while True:  # opening a FIFO blocks until the runner opens it
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
    assert status.get("value") == 0 and sorted(read_results(out)) == ["early-0", "early-1", "late"]


@pytest.mark.parametrize("flags, window", [(("--max-in-flight", "3"), 3), (("--max-num-seqs", "2"), 4)],
                         ids=["max-in-flight", "default"])
def test_at_most_max_in_flight_requests_are_in_the_engine(llm, tmp_path, monkeypatch, flags, window):
    """Without --max-in-flight, 2 x --max-num-seqs (one batch running, one waiting), even with an engine given."""
    live, peak = [], [0]

    def count(handle, ids):
        live[:] = [h for h in live if not h.finished] + [handle]
        peak[0] = max(peak[0], len(live))

    on_submit(llm, monkeypatch, count)
    inp, out = files(tmp_path, numbered(24, 8))
    assert run(llm, inp, out, *flags) == 0
    assert len(read_results(out)) == 24 and peak[0] == window


def test_an_engine_failure_stops_the_run_and_a_rerun_finishes_it(llm, tmp_path, monkeypatch):
    inp, out = files(tmp_path, numbered(12, 6))
    seen, run_step = set(), llm.model_runner.run

    def failing_run(seqs):  # at a fifth request, after a result was written: some, not all, are
        seen.update(seq.seq_id for seq in seqs)
        if len(seen) > 4:
            raise RuntimeError("injected engine failure")
        return run_step(seqs)

    monkeypatch.setattr(llm.model_runner, "run", failing_run)
    assert run(llm, inp, out, "--max-in-flight", "4") == 3
    written = read_results(out)
    assert 0 < len(written) < 12 and all(r["error"] is None for r in written.values())
    monkeypatch.undo()
    assert run(llm, inp, out) == 0
    assert sorted(read_results(out)) == sorted(f"r{i}" for i in range(12))
    assert llm.is_finished()


@pytest.mark.parametrize("n, bad", [(1, []), (1, ["{oops"]), (2, [])],
                         ids=["one", "beside-a-bad-line", "one-choice-of-two"])
def test_an_aborted_request_is_not_a_result(llm, tmp_path, monkeypatch, capsys, n, bad):
    """The next run serves it: exit 3 (run again) wins over 1 (a line failed); one aborted choice stops no run."""
    inp, out = files(tmp_path, numbered(3, 60, dict(max_tokens=3, n=n)) + bad)  # r1 finishes first
    at_submit(llm, monkeypatch, "prompt 1", lambda handle: handle.abort(), n)  # as when another caller ends it
    assert run(llm, inp, out) == 3
    err = capsys.readouterr().err
    assert "the run stopped" not in err and "1 stopped before they finished" in err
    assert sorted(read_results(out)) == ["batch_req_line4"] * len(bad) + ["r0", "r2"]
    monkeypatch.undo()
    assert run(llm, inp, out) == (1 if bad else 0)  # finished now: only the bad line failed
    results = read_results(out)
    assert sorted(results) == ["batch_req_line4"] * len(bad) + ["r0", "r1", "r2"] and len(choices(results["r1"])) == n


@pytest.mark.parametrize("n, callback", [(1, "_on_token"), (2, "_on_token"), (1, "_on_finish")])
def test_a_request_that_fails_on_its_own_is_an_error_line_not_a_rerun(
        llm, tmp_path, monkeypatch, capsys, n, callback):
    """A poisoned line is a server_error line and exit 1, not 3 (every rerun would fail it); n=2: still one line."""
    inp, out = files(tmp_path, numbered(3, 8, dict(max_tokens=40, n=n)))
    poison_at_submit(llm, monkeypatch, "prompt 1", callback=callback)
    assert run(llm, inp, out) == 1
    results = read_results(out)
    assert sorted(results) == ["r0", "r1", "r2"]
    assert results["r0"]["error"] is None and results["r2"]["error"] is None
    assert results["r1"]["response"] is None and results["r1"]["error"]["code"] == "server_error"
    assert "ValueError: injected undecodable token" in results["r1"]["error"]["message"]
    assert "1 failed (server_error 1)" in capsys.readouterr().err
    monkeypatch.undo()
    assert run(llm, inp, out) == 1 and len(read_results(out)) == 3  # nothing left to serve
    assert llm.is_finished()


def test_finish_aborts_the_other_choices_of_a_choice_that_failed_on_its_own(llm, monkeypatch):
    """Ray's replicas call `finish` at once: the choices still running are aborted, not run to max_tokens."""
    executor = BatchExecutor(llm, "tiny")
    poison_at_submit(llm, monkeypatch, "prompt 1")
    pending = executor.start(parse(request("r1", prompt="prompt 1", max_tokens=MAX_MODEL_LEN // 2, ignore_eos=True,
                                           n=2), 7))
    line, tokens = within(30, executor.finish, pending)
    assert line["error"]["code"] == "server_error" and "line 7" in line["error"]["message"] and tokens == 0
    assert within(30, pending.handles[1].result)["finish_reason"] == "abort"


def test_summary_counts_this_run_and_the_earlier_one(llm, tmp_path, capsys):
    # on a resumed run, how many lines an earlier run wrote were failures
    lines = numbered(2, 3) + ["{oops"]
    inp, out = files(tmp_path, lines)
    assert run(llm, inp, out) == 1
    assert "3 lines: 2 served, 1 failed (invalid_json 1); 6 completion tokens" in capsys.readouterr().err
    write_lines(inp, lines + [request("r2", prompt="prompt 2", max_tokens=4, ignore_eos=True)])
    assert run(llm, inp, out) == 1
    err = capsys.readouterr().err
    assert "4 lines: 1 served, 0 failed; 3 written by an earlier run (1 of them failed); 4 completion tokens" in err
    assert run(llm, inp, out) == 1 and len(read_results(out)) == 4  # nothing to do: the failure still counts


def test_chat_template_from_a_file(llm, tmp_path):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
    (tmp_path / "template.jinja").write_text(template)
    conversation = user("Hello!")
    inp = write_lines(tmp_path / "in.jsonl", [request("c", CHAT, messages=conversation, max_tokens=3, temperature=0)])
    expected = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False,
                        chat_template=template)[0]
    prompt_tokens = len(llm.apply_chat_template(conversation, template))
    for given in (str(tmp_path / "template.jinja"), template):
        out = tmp_path / f"out{len(given)}.jsonl"
        assert run(llm, inp, out, "--chat-template", given) == 0
        result = read_results(out)["c"]
        assert result["response"]["body"]["usage"]["prompt_tokens"] == prompt_tokens
        assert choices(result)[0]["message"]["content"] == expected["text"]


def test_token_text_keeps_special_tokens(llm):
    special = llm.tokenizer.all_special_ids[0]
    text = BatchExecutor(llm, "m").token_text(special)
    assert text and text == llm.decode([special], skip_special_tokens=False)


def test_count_lines(tmp_path):
    # the progress bar's total: the lines intake reads as requests, blank ones not among them
    for data, lines in ((b"", 0), (b"a\n", 1), (b"a\nb", 2), (b"a\nb\n", 2), (b"\n \r\n\ta\n\n\nb\n \t\n", 2)):
        (tmp_path / "f").write_bytes(data)
        assert count_lines(str(tmp_path / "f")) == lines, data
        with open(tmp_path / "f", "rb") as f:
            assert len(list(intake(f, {}))) == lines, data
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
    given = ["-i", "a", "-o", "b", "--model", "m"]
    args = parser.parse_args([*given, "--new-knob", "0.25", "--use-thing", "--maybe-count", "3", "--mode", "safe",
                              "--overrides", '{"rope_theta": 1e4}'])
    assert (args.new_knob, args.use_thing, args.maybe_count) == (0.25, True, 3)
    assert (args.mode, args.overrides) == ("safe", {"rope_theta": 1e4})
    assert not hasattr(args, "max_num_seqs")  # not given: the engine's default applies
    for bad, message in ((["--new-knob", "x"], "invalid float value: 'x'"),
                         (["--max-num-seq", "4"], "unrecognized arguments: --max-num-seq"),
                         (["--bogus"], "unrecognized arguments: --bogus"),
                         (["--mode", "slow"], "invalid choice: 'slow'"),
                         # an Optional[int] field is an int flag, not JSON
                         (["--maybe-count", "2.5"], "invalid int value: '2.5'"),
                         (["--maybe-count", "[1]"], "invalid int value: '[1]'")):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args([*given, *bad])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    real = {f.name for f in dataclasses.fields(Config)} - {"model", "hf_config", "eos_token_ids"}
    assert set(build_parser()[1]) == real


def test_command_line_mistakes_exit_2(tiny_model, tmp_path, capsys):
    # bad counts and a missing input fail before any work (no output file, no model loaded)
    inp, out = write_lines(tmp_path / "in.jsonl", [request("a", prompt="p")]), str(tmp_path / "out")
    missing = str(tmp_path / "nope.jsonl")
    cases = [(inp, [flag, "0"], f"{flag}=0 must be >= 1")
             for flag in ("--max-in-flight", "--ray-start-timeout", "--data-parallel-size")]
    cases += [(inp, ["--chat-template", missing], "neither a file nor a template"), (str(tmp_path), [], "a folder")]
    for given, flags, message in cases + [(missing, [], f"input file {missing!r} does not exist")]:
        with pytest.raises(SystemExit) as exit_info:
            main(["-i", given, "-o", out, "--model", "m", *flags])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not os.path.exists(out)
    assert main(["-i", inp, "-o", out, "--model", tiny_model, "--kvcache-block-size", "24"]) == 2
    assert "kvcache_block_size=24" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{")  # not JSON: a bad model (2), not a run to repeat (3)
    assert main(["-i", inp, "-o", out, "--model", str(tmp_path)]) == 2 and "config.json:" in capsys.readouterr().err
