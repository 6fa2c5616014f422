"""Incremental detokenization and stop strings: text deltas that never split a UTF-8 character
and never show text that a stop string will later cut off."""

from __future__ import annotations

# Prompt tokens kept as decoding context so the first output token gets its leading space right.
CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # chars a stop string could still claim
        self.text = ""     # decoded output so far
        self.emitted = 0   # chars of self.text already sent
        self.tokens_used = 0  # tokens of the last add() consumed before a stop string ended it

    def _decode(self, ids: list[int]) -> str:
        # A fast tokenizer's Rust backend directly: the same text, without ~4 us of Python wrapping
        # per call (two calls per token per sequence add up at high concurrency).
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            return backend.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, new_ids: list[int]) -> tuple[str, bool]:
        """Append tokens one at a time; -> (text to emit now, whether a stop string was hit).

        After a stop string the remaining tokens are ignored; the caller truncates its token list
        with `tokens_used`.
        """
        self.tokens_used = 0
        for tok in new_ids:
            self.tokens_used += 1
            self.ids.append(tok)
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                start = len(self.text)
                self.text += full[len(prefix) :]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                if self._cut_at_stop(start):
                    return self._flush(), True
        safe = max(self.emitted, len(self.text) - self.hold)
        delta, self.emitted = self.text[self.emitted : safe], safe
        return delta, False

    def _cut_at_stop(self, new_from: int) -> bool:
        window = max(0, new_from - self.hold)
        hits = [i for s in self.stop if (i := self.text.find(s, window)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
        return bool(hits)

    def _flush(self) -> str:
        delta, self.emitted = self.text[self.emitted :], len(self.text)
        return delta

    def finish(self) -> str:
        """Whatever is left at the end (held-back text and an incomplete character)."""
        if self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            self.text += self._decode(self.ids[self.prefix_offset :])[len(prefix) :]
            self._cut_at_stop(self.emitted)
            self.read_offset = len(self.ids)
        return self._flush()
