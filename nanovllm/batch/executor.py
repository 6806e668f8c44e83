"""Parsed batch requests on one engine: prompts to token ids (the chat template for chat), one `LLM.submit`
handle per choice, and the finished handles to an OpenAI result line.

`start` raises LineError for what only the engine can check (a prompt longer than max_model_len, a stop
token outside the vocabulary, a template that rejects the conversation); nothing of that request stays
queued. Defaults as in vLLM's OpenAI server: max_tokens up to max_model_len, and the sampling fields of the
model's generation_config.json (`LLMEngine.sampling_defaults`). With n > 1 and a seed, choice i uses seed + i,
so the whole request is reproducible.
"""
from dataclasses import dataclass

from nanovllm.batch.protocol import FINISH_REASONS, BatchRequest, LineError, error_line, result_line
from nanovllm.sampling_params import SamplingParams


@dataclass(slots=True)
class Pending:
    request: BatchRequest
    handles: list  # RequestHandles, prompt-major, n per prompt
    num_prompt_tokens: int

    @property
    def finished(self) -> bool:
        return all(handle.finished for handle in self.handles)

    def abort(self):
        for handle in self.handles:
            if not handle.finished:
                handle.abort()


class BatchExecutor:

    def __init__(self, llm, model_name: str, chat_template: str | None = None):
        self.llm, self.model_name, self.chat_template = llm, model_name, chat_template
        self._token_texts: dict[int, str] = {}  # bounded by the vocabulary

    def start(self, request: BatchRequest) -> Pending:
        prompts = [self._token_ids(request, prompt) for prompt in (request.prompts or [None])]
        max_model_len = self.llm.config.max_model_len
        handles = []
        try:
            for token_ids in prompts:
                max_tokens = request.max_tokens or max(max_model_len - len(token_ids), 1)
                for i in range(request.n):
                    sampling = {**self.llm.sampling_defaults, **request.sampling}
                    if request.n > 1 and sampling.get("seed") is not None:
                        sampling["seed"] += i
                    handles.append(self.llm.submit(token_ids, SamplingParams(**sampling, max_tokens=max_tokens)))
        except BaseException as e:  # (a ^C too: nobody else holds these handles to end them)
            for handle in handles:
                handle.abort()
            if not isinstance(e, (TypeError, ValueError)):
                raise
            # checks that need the model, e.g. a stop token id past the vocabulary
            raise LineError("invalid_value", f"line {request.line}: {e}", request.custom_id) from None
        return Pending(request, handles, sum(map(len, prompts)))

    def finish(self, pending: Pending) -> tuple[dict, int] | None:
        """The result line and its number of completion tokens; None if the request was aborted. A choice that
        failed on its own (`RequestHandle.failed_alone`) makes the line an error line (server_error, 0 tokens):
        a resumed run would fail it again, so it is a result. Any other error propagates (a failed step, a closed
        engine), and a resumed run serves the request again."""
        outputs = []
        for handle in pending.handles:
            try:
                outputs.append(handle.result())
            except Exception as e:
                if not handle.failed_alone:
                    raise
                pending.abort()  # its other choices
                request = pending.request
                return error_line(request.custom_id, request.line, "server_error",
                                  f"line {request.line}: the request failed: {type(e).__name__}: {e}"), 0
        if any(out["finish_reason"] not in FINISH_REASONS for out in outputs):
            return None
        line = result_line(pending.request, outputs, pending.num_prompt_tokens, self.model_name, self.token_text)
        return line, sum(len(out["token_ids"]) for out in outputs)

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.llm.decode([token_id], skip_special_tokens=False)
        return text

    def _token_ids(self, request: BatchRequest, prompt) -> list[int]:
        where = f"line {request.line}"
        if request.chat:
            try:
                prompt = self.llm.apply_chat_template(request.messages, self.chat_template,
                                                      chat_template_kwargs=request.chat_template_kwargs)
            except Exception as e:  # the template may raise anything for a conversation it rejects
                raise LineError("invalid_value", f"{where}: the chat template failed: {e}", request.custom_id) from None
        if isinstance(prompt, list) and len(prompt) > self.llm.config.max_model_len:
            raise LineError("prompt_too_long", f"{where}: the prompt has {len(prompt)} tokens, more than "
                            f"max_model_len={self.llm.config.max_model_len}", request.custom_id)
        try:
            return self.llm.encode(prompt)
        except (TypeError, ValueError) as e:
            # a string prompt is only measured as the engine tokenizes it; its error names max_model_len
            code = "prompt_too_long" if "max_model_len" in str(e) else "invalid_value"
            raise LineError(code, f"{where}: {e}", request.custom_id) from None
