"""A detokenizer that keeps no text: for tests that drive the gateway's scheduler without a tokenizer."""


class NullDetokenizer:
    tokens_used = 0
    stop: list[str] = []   # no stop strings: the request's handler would decode (none does here)

    def add(self, ids):
        return "", False   # (no text, no stop string hit)

    def finish(self):
        return ""
