"""The user-facing class: the engine, plus conveniences built on `generate`."""
from nanovllm.batch.protocol import joined_text_parts
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.sampling_params import SamplingParams


class LLM(LLMEngine):

    def chat(self, conversations: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[dict]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or a list of them,
        through the tokenizer's chat template; returns one output per conversation, as `generate()` (and its
        progress bar, on a terminal only by default). `chat_template_kwargs` go to the template (Qwen3's
        `enable_thinking`, say) and win over `add_generation_prompt`, as in vLLM."""
        if not isinstance(conversations, (list, tuple)) or not conversations:
            raise TypeError("conversations must be a non-empty list of messages, or a list of such lists")
        if isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.apply_chat_template(conversation, chat_template, add_generation_prompt, chat_template_kwargs)
                   for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: list[dict], chat_template: str | None = None,
                            add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None) -> list[int]:
        """The token ids of one conversation through the chat template, as `chat()` submits them (not yet
        checked against max_model_len: `encode()` does that). Safe to call while the engine runs."""
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer of {self.config.model} has no chat template; pass chat_template=")
        if not isinstance(conversation, (list, tuple)) or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in conversation):
            raise TypeError("each conversation must be a list of {'role': ..., 'content': ...} dicts")
        conversation = [{**m, "content": joined_text_parts(m["content"], f"messages[{i}].content")}
                        if isinstance(m["content"], list) else m for i, m in enumerate(conversation)]
        with self._tokenizer_lock:
            kwargs = {"add_generation_prompt": add_generation_prompt, **(chat_template_kwargs or {})}
            text = self.tokenizer.apply_chat_template(conversation, tokenize=False, chat_template=chat_template,
                                                      **kwargs)
            # the template wrote the special tokens already
            return self.tokenizer.encode(text, add_special_tokens=False)
