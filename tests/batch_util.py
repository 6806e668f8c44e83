"""Helpers for the batch runner's tests: request lines, reading results, and running with a deadline."""
import json
import os
import signal

import pytest

from nanovllm.run_batch import main

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def request(custom_id, url=COMPLETIONS, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def write_lines(path, lines) -> str:
    """Each line a dict (dumped) or a str/bytes (written as it is)."""
    with open(path, "wb") as f:
        for line in lines:
            if isinstance(line, dict):
                line = json.dumps(line)
            f.write((line if isinstance(line, bytes) else line.encode()) + b"\n")
    return str(path)


def read_results(path) -> dict:
    """{custom_id, or id when custom_id is null: result line}; fails on a torn or duplicated line."""
    results = {}
    with open(path, "rb") as f:
        data = f.read()
    assert not data or data.endswith(b"\n"), "torn last line"
    for raw in data.splitlines():
        obj = json.loads(raw)
        key = obj["custom_id"] if obj["custom_id"] is not None else obj["id"]
        assert key not in results, f"{key!r} was written twice"
        results[key] = obj
    return results


def body(result: dict) -> dict:
    return result["response"]["body"]


def choices(result: dict) -> list[dict]:
    return body(result)["choices"]


def tear_first_line_then_signal(monkeypatch) -> list:
    """os.write writes half the first result or error line, then SIGTERM comes; the list gets its fd."""
    write, signalled = os.write, []

    def part_then_signal(fd, data):
        if signalled or b'"custom_id": ' not in data:
            return write(fd, data)
        signalled.append(fd)
        written = write(fd, data[:len(data) // 2])
        os.kill(os.getpid(), signal.SIGTERM)
        return written

    monkeypatch.setattr(os, "write", part_then_signal)
    return signalled


def main_here(argv: list[str], llm=None) -> int:
    """run_batch's main on this thread, the main one, where signals are handled: none may escape it."""
    try:
        return main(argv, llm=llm)
    except KeyboardInterrupt as e:
        pytest.fail(f"{e!r} escaped main")


def on_submit(llm, monkeypatch, act):
    """act(handle, token_ids) on each request llm.submit makes."""
    submit = llm.submit

    def submit_then_act(ids, params):
        handle = submit(ids, params)
        act(handle, ids)
        return handle

    monkeypatch.setattr(llm, "submit", submit_then_act)


def at_submit(llm, monkeypatch, prompt: str, act, nth: int = 1):
    """act(handle) on the nth submission of `prompt`, as it is made, until monkeypatch.undo()."""
    prompt_ids, seen = llm.encode(prompt), [0]

    def act_on_nth(handle, ids):
        seen[0] += ids == prompt_ids
        if ids == prompt_ids and seen[0] == nth:
            act(handle)

    on_submit(llm, monkeypatch, act_on_nth)


def poison_at_submit(llm, monkeypatch, prompt: str, callback: str = "_on_token"):
    """The first submission of `prompt` fails alone (`LLMEngine._fail_request`) at its next token or its finish."""
    def undecodable(*args):
        raise ValueError("injected undecodable token")

    at_submit(llm, monkeypatch, prompt, lambda handle: setattr(handle, callback, undecodable))
