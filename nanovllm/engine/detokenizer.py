"""Incremental detokenization: the text of a growing list of token ids, for streams and stop strings."""
import threading
from collections.abc import Callable

from transformers import PreTrainedTokenizerFast


def text_decoder(tokenizer) -> Callable[[list[int], bool], str]:
    """decode(token_ids, skip_special_tokens) -> `tokenizer.decode`'s text; for a plain fast tokenizer (the
    library's decode, no clean-up of spaces) its Rust backend's, without the wrapper's work (on CPU 1.5 against
    5.0 us a call; streams and stop strings decode twice a token)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    cls = type(tokenizer)
    if (backend is not None and getattr(cls, "decode", None) is PreTrainedTokenizerFast.decode
            and getattr(cls, "_decode", None) is PreTrainedTokenizerFast._decode
            and not tokenizer.clean_up_tokenization_spaces):
        return lambda token_ids, skip: backend.decode(token_ids, skip_special_tokens=skip)
    return lambda token_ids, skip: tokenizer.decode(token_ids, skip_special_tokens=skip)


CONTEXT_TOKENS = 4  # the prompt's last tokens, which a completion is decoded after (vLLM primes with 4 or more)


def completion_text(decode: Callable[[list[int], bool], str], context: list[int], token_ids: list[int],
                    skip_special_tokens: bool) -> str:
    """The text of `token_ids` after `context` (the prompt's last tokens), as vLLM decodes it: a decode's first
    token loses a SentencePiece word's leading space, which a completion must keep (" Paris" after "The capital
    is"). The pieces of an `IncrementalDetokenizer` concatenate to it."""
    return decode(context + token_ids, skip_special_tokens)[len(decode(context, skip_special_tokens)):]


class IncrementalDetokenizer:
    """The text of a growing list of token ids after a prompt, a piece at a time: never half of a multi-byte
    character, and the pieces concatenate to `completion_text`.

    Each new piece is the difference between decoding the tokens since `prefix_offset` with and without the
    newest ones, so a tokenizer that treats the first token of a decode specially sees the same context twice.
    A piece that ends in U+FFFD (an incomplete UTF-8 sequence) is held back until more tokens complete it, or
    until the last push (`final`): no token will complete it then.
    """

    def __init__(self, tokenizer, lock: threading.Lock, skip_special_tokens: bool = False,
                 context: list[int] = ()):
        self.decode, self.lock, self.skip_special_tokens = text_decoder(tokenizer), lock, skip_special_tokens
        self.token_ids = list(context)  # decoded before the first piece
        self.prefix_offset, self.read_offset = 0, len(self.token_ids)
        self.text = ""  # the pieces so far
        self.searched = 0  # stop strings have been looked for in text[:searched]

    def _decode(self, token_ids: list[int]) -> str:
        with self.lock:
            return self.decode(token_ids, self.skip_special_tokens)

    def push(self, token_ids: list[int], final: bool = False) -> str:
        self.token_ids.extend(token_ids)
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd") and not final:
            return ""
        piece = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += piece
        return piece

    def find_stop(self, stops: list[str]) -> tuple[str, int] | None:
        """The earliest stop string that ends in the text added since the last call, and where it starts.

        Each stop string is looked for from its own length back before the new text, so an occurrence that
        ended in text searched earlier is never found again."""
        searched, self.searched = self.searched, len(self.text)
        hits = [(index, stop) for stop in stops
                if (index := self.text.find(stop, max(searched - len(stop) + 1, 0))) >= 0]
        return min(hits)[::-1] if hits else None
