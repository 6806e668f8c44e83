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


def test_at_most_max_in_flight_requests_are_in_the_engine(llm, tiny_model, tmp_path, monkeypatch):
    live, peak = [], [0]
    submit = llm.submit

    def counting_submit(*args, **kwargs):
        handle = submit(*args, **kwargs)
        live[:] = [h for h in live if not h.finished] + [handle]
        peak[0] = max(peak[0], len(live))
        return handle

    monkeypatch.setattr(llm, "submit", counting_submit)
    lines = [request(f"r{i}", prompt=f"prompt {i}", max_tokens=8, ignore_eos=True) for i in range(24)]
    assert run(llm, tiny_model, write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl",
               "--max-in-flight", "3") == 0
    assert len(read_results(tmp_path / "out.jsonl")) == 24 and peak[0] == 3


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


def test_an_aborted_request_is_not_a_result(llm, tiny_model, tmp_path, monkeypatch, capsys):
    lines = [request(f"r{i}", prompt=f"prompt {i}", max_tokens=200, ignore_eos=True) for i in range(3)]
    inp, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    submit = llm.submit

    def submit_then_abort(prompt, params):  # as when someone else ends the request (or closes the engine)
        handle = submit(prompt, params)
        if prompt == llm.encode("prompt 1"):
            handle.abort()
        return handle

    monkeypatch.setattr(llm, "submit", submit_then_abort)
    assert run(llm, tiny_model, inp, out) == 3
    assert sorted(read_results(out)) == ["r0", "r2"]
    assert "1 stopped before they finished" in capsys.readouterr().err
    monkeypatch.undo()
    assert run(llm, tiny_model, inp, out) == 0 and sorted(read_results(out)) == ["r0", "r1", "r2"]


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


def test_a_bad_engine_argument_is_a_clear_error(tiny_model, tmp_path, capsys):
    inp = write_lines(tmp_path / "in.jsonl", [request("a", prompt="p")])
    assert main(["-i", inp, "-o", str(tmp_path / "out"), "--model", tiny_model, "--kvcache-block-size", "24"]) == 2
    assert "kvcache_block_size=24" in capsys.readouterr().err
