"""The OpenAI Batch file format, as vLLM's `run-batch` reads it: one request per input line, one result per
output line, both shown in README's "Batch files". This module parses and formats only; it never touches
an engine.

`read_line` checks what identifies a line (JSON, an object, a string custom_id); its errors carry custom_id
None and the line number. `parse_request` checks the rest; its errors carry the custom_id. A line reported
without a custom_id gets the id `batch_req_line<N>`, so that a resumed run can tell it was written
(`output_key`).
"""
import json
import time
import uuid
from dataclasses import dataclass

from nanovllm.sampling_params import SamplingParams

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)
MAX_N = 128  # OpenAI's limit on choices per request
MAX_LOGPROBS = 20  # vLLM's default max_logprobs, for both urls: a line's logprobs must not fill the memory
MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way

# body fields, by what they become; any other field is an error (a typo must not be ignored silently)
_NUMBERS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p", "repetition_penalty")
# vLLM's extra sampling fields, passed to SamplingParams as they are
_PASSED = ("top_k", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens", "seed", "stop")
_IGNORED = ("model", "user", "metadata", "store", "service_tier")  # one model serves the whole file
_COMMON = {"n", "max_tokens", "logprobs", "stream", *_NUMBERS, *_PASSED, *_IGNORED}
_FIELDS = {
    CHAT_URL: _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "chat_template_kwargs"},
    COMPLETIONS_URL: _COMMON | {"prompt"},
}
# what an engine's finish_reason is in OpenAI's terms; "abort" is no result at all (the runner never writes it)
FINISH_REASONS = {"stop": "stop", "length": "length"}


class LineError(Exception):
    """A line that cannot be served: it gets an error line, and the job goes on."""

    def __init__(self, code: str, message: str, custom_id: str | None = None):
        super().__init__(message)
        self.code, self.message, self.custom_id = code, message, custom_id


@dataclass(slots=True)
class BatchRequest:
    line: int
    custom_id: str
    url: str
    prompts: list  # completions: each a str or a list of token ids (choices are prompt-major); chat: empty
    messages: list | None  # chat: the conversation, contents flattened to strings
    chat_template_kwargs: dict | None
    sampling: dict  # SamplingParams fields, except max_tokens
    max_tokens: int | None  # None: up to max_model_len
    n: int

    @property
    def chat(self) -> bool:
        return self.url == CHAT_URL


def read_line(text: str, line: int) -> tuple[dict, str]:
    """The parsed line and its custom_id; a LineError (custom_id None) when the line cannot be identified."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as e:  # also an integer past Python's digit limit, or too deep a nesting
        raise LineError("invalid_json", f"line {line} is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise LineError("invalid_request", f"line {line} is a JSON {type(obj).__name__}, not an object")
    custom_id = obj.get("custom_id")
    if custom_id is None:
        raise LineError("missing_custom_id", f"line {line} has no custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError("invalid_custom_id", f"line {line}: custom_id must be a non-empty string, not {custom_id!r}")
    return obj, custom_id


def parse_request(obj: dict, custom_id: str, line: int) -> BatchRequest:
    """Check a line's method, url and body; a LineError (with the custom_id) names the first problem."""
    def fail(code: str, message: str):
        raise LineError(code, f"line {line}: {message}", custom_id)

    unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if unknown:
        fail("invalid_request", f"unknown field(s) {unknown}; a line has custom_id, method, url and body")
    if obj.get("method") != "POST":
        fail("invalid_request", f"method must be 'POST', not {obj.get('method')!r}")
    url = obj.get("url")
    if url not in URLS:
        fail("invalid_url", f"url {url!r} is not supported; use one of {list(URLS)}")
    body = obj.get("body")
    if not isinstance(body, dict):
        fail("invalid_request", f"body must be a JSON object, not {type(body).__name__}")
    try:
        return _parse_body(url, body, custom_id, line)
    except (TypeError, ValueError) as e:  # SamplingParams' own checks name the field and its limit
        fail("invalid_value", str(e))


def _parse_body(url: str, body: dict, custom_id: str, line: int) -> BatchRequest:
    unknown = sorted(set(body) - _FIELDS[url])
    if unknown:
        raise ValueError(f"body field(s) {unknown} are not supported for {url}; supported: {sorted(_FIELDS[url])}")
    get = {k: v for k, v in body.items() if v is not None}.get  # null means "not given", as in OpenAI's API
    if get("stream", False) is not False:
        raise ValueError("stream must be false: a batch writes whole results")
    n = _int(get("n", 1), "n", 1, MAX_N)
    # both are checked, each by its own name (an ignored max_tokens may still be a mistake); chat's newer one wins
    max_tokens = None if get("max_tokens") is None else _int(get("max_tokens"), "max_tokens", 1)
    if get("max_completion_tokens") is not None:
        max_tokens = _int(get("max_completion_tokens"), "max_completion_tokens", 1)
    sampling = {name: body[name] for name in (*_NUMBERS, *_PASSED) if get(name) is not None}
    messages, prompts, template_kwargs = None, [], None
    if url == CHAT_URL:
        messages = _messages(get("messages"))
        if get("top_logprobs") is not None and get("logprobs") is not True:
            raise ValueError("top_logprobs needs logprobs=true")
        if not isinstance(get("logprobs", False), bool):
            raise TypeError(f"logprobs={get('logprobs')!r} must be true or false for {CHAT_URL}")
        if get("logprobs"):
            sampling["logprobs"] = _int(get("top_logprobs", 0), "top_logprobs", 0, MAX_LOGPROBS)
        template_kwargs = get("chat_template_kwargs")
        if template_kwargs is not None and not isinstance(template_kwargs, dict):
            raise TypeError(f"chat_template_kwargs must be an object, not {type(template_kwargs).__name__}")
    else:
        prompts = _prompts(get("prompt"))
        if get("logprobs") is not None:
            sampling["logprobs"] = _int(get("logprobs"), "logprobs", 0, MAX_LOGPROBS)
    # checked now, so a bad value is reported before anything runs (max_tokens is settled per prompt later)
    SamplingParams(**sampling, max_tokens=max_tokens or 1 << 30)
    return BatchRequest(line, custom_id, url, prompts, messages, template_kwargs, sampling, max_tokens, n)


def _int(value, name: str, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r} must be an integer")
    if value < minimum or (maximum is not None and value > maximum):
        raise ValueError(f"{name}={value} must be " + (f">= {minimum}" if maximum is None
                                                        else f"in [{minimum}, {maximum}]"))
    return value


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string role")
        content = message.get("content")
        if isinstance(content, list):
            content = joined_text_parts(content, f"messages[{i}].content")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        out.append({**message, "content": content})
    return out


def joined_text_parts(parts: list, name: str) -> str:
    """A message's content parts as one string, joined by newlines as vLLM joins them for a template of string
    content; only text can reach a text-only model."""
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts):
        raise ValueError(f"{name}: only parts of type 'text' are supported")
    return "\n".join(p["text"] for p in parts)


def _prompts(prompt) -> list:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [prompt]  # one prompt of token ids
        if all(isinstance(p, str) or (isinstance(p, list) and p and all(
                isinstance(t, int) and not isinstance(t, bool) for t in p)) for p in prompt):
            return prompt  # several prompts: choices come prompt by prompt, n each
    raise ValueError("prompt must be a string, a list of token ids, or a non-empty list of those")


# ---- output lines ----
def error_line(custom_id: str | None, line: int, code: str, message: str) -> dict:
    request_id = f"batch_req_line{line}" if custom_id is None else f"batch_req_{uuid.uuid4().hex}"
    return {"id": request_id, "custom_id": custom_id, "response": None, "error": {"code": code, "message": message}}


def output_key(obj: dict) -> tuple | None:
    """What a written line stands for: its custom_id, or the line number of a line that had none."""
    if obj.get("custom_id") is not None:
        return ("custom_id", obj["custom_id"])
    request_id = obj.get("id")
    if isinstance(request_id, str) and request_id.startswith("batch_req_line") and request_id[14:].isdigit():
        return ("line", int(request_id[14:]))
    return None


def request_key(custom_id: str | None, line: int) -> tuple:
    return ("custom_id", custom_id) if custom_id is not None else ("line", line)


def result_line(request: BatchRequest, outputs: list[dict], num_prompt_tokens: int, model: str,
                token_text) -> dict:
    """The output line of a served request: `outputs` are the engine's output dicts, one per choice;
    `token_text(id)` is the text of one token (for logprobs)."""
    choices = []
    for index, out in enumerate(outputs):
        choice = {"index": index}
        if request.chat:
            choice["message"] = {"role": "assistant", "content": out["text"]}
        else:
            choice["text"] = out["text"]
        k = request.sampling.get("logprobs")
        choice["logprobs"] = None if k is None else (_chat_logprobs if request.chat else _completion_logprobs)(
            out, k, token_text)
        choice["finish_reason"] = FINISH_REASONS[out["finish_reason"]]
        choice["stop_reason"] = out["stop_reason"]  # vLLM's field: the stop string or token id, if one ended it
        choices.append(choice)
    completion_tokens = sum(len(out["token_ids"]) for out in outputs)
    cached = sum(out["num_cached_tokens"] for out in outputs[::request.n])  # as prompt_tokens: once a prompt
    body = {
        "id": f"{'chatcmpl' if request.chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if request.chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {"prompt_tokens": num_prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": num_prompt_tokens + completion_tokens,
                  "prompt_tokens_details": {"cached_tokens": cached}},
    }
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": request.custom_id,
            "response": {"status_code": 200, "request_id": f"nanovllm-batch-{uuid.uuid4().hex}", "body": body},
            "error": None}


def _top(logprobs: dict[int, float], k: int) -> list[tuple[int, float]]:
    # the engine's dict holds the sampled token first, then the k likeliest (the sampled one may be among them)
    return sorted(logprobs.items(), key=lambda item: -item[1])[:k]


def _chat_logprobs(out: dict, k: int, token_text) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": max(logprob, MIN_LOGPROB), "bytes": list(text.encode())}
    return {"content": [{**entry(token_id, lps[token_id]), "top_logprobs": [entry(*t) for t in _top(lps, k)]}
                        for token_id, lps in zip(out["token_ids"], out["logprobs"])]}


def _completion_logprobs(out: dict, k: int, token_text) -> dict:
    tokens, offsets, offset = [], [], 0
    for token_id in out["token_ids"]:
        tokens.append(token_text(token_id))
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens,
            "token_logprobs": [max(lps[t], MIN_LOGPROB) for t, lps in zip(out["token_ids"], out["logprobs"])],
            # the sampled token's too, as OpenAI's: up to logprobs + 1 (chat's top_logprobs: k exactly)
            "top_logprobs": [{token_text(t): max(lp, MIN_LOGPROB) for t, lp in _top(lps, k + 1)}
                             for lps in out["logprobs"]],
            "text_offset": offsets}
