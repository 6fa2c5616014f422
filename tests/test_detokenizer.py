"""Incremental detokenization: no broken UTF-8 in deltas, stop strings cut and held back."""

from __future__ import annotations

from transformers import AutoTokenizer

from gateway.detokenizer import IncrementalDetokenizer


def test_deltas_join_to_the_full_text_without_broken_characters(checkpoints):
    tok = AutoTokenizer.from_pretrained(checkpoints["llama-gqa"])
    text = "Grüße aus Köln! 東京 🙂🚀 done"
    ids = tok(text)["input_ids"]
    detok = IncrementalDetokenizer(tok, [], [])
    deltas = [detok.add([t])[0] for t in ids] + [detok.finish()]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_stop_string_cuts_text_and_reports_tokens_used(checkpoints):
    tok = AutoTokenizer.from_pretrained(checkpoints["llama-gqa"])
    ids = tok("The quick brown fox jumps over the lazy dog")["input_ids"]
    detok = IncrementalDetokenizer(tok, [], ["fox"])
    out, stopped = "", False
    for t in ids:
        delta, stopped = detok.add([t])
        out += delta
        if stopped:
            break
    assert stopped and out == "The quick brown "
    # Held back: "fo" could start "fox", so nothing of it is shown until the text ends.
    detok = IncrementalDetokenizer(tok, [], ["fox"])
    shown = "".join(detok.add([t])[0] for t in tok("The quick brown fo")["input_ids"])
    assert shown == "The quick brown "
    assert detok.finish() == "fo"
