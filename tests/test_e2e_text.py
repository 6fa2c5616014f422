"""The text a stream carries is its tokens' decoding, whether the scheduler decodes it (a request with
stop strings: a stop must end it before the next step) or the request's handler does (the rest, while
the step loop awaits the services); each of n samples keeps its own, and a stop string ends the text
and the tokens where it starts."""

from __future__ import annotations

from cluster import request
from transformers import AutoTokenizer

from gateway.detokenizer import CONTEXT_TOKENS
from specdec.rpc import gateway_pb2

PROMPT = [3, 5, 7, 11, 13]


def stream(cluster, req: gateway_pb2.GenerateRequest) -> tuple[dict[int, str], dict[int, list[int]], dict[int, str]]:
    """-> text, tokens and finish reason of each sample."""
    texts: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    for msg in cluster.gateway.Generate(req, timeout=120, metadata=cluster.metadata):
        texts[msg.sample_index] = texts.get(msg.sample_index, "") + msg.text
        ids.setdefault(msg.sample_index, []).extend(msg.token_ids)
        if msg.HasField("final"):
            reasons[msg.sample_index] = msg.final.finish_reason
    return texts, ids, reasons


def decoded(tok, ids: list[int]) -> str:
    """What the stream should carry: the tokens decoded after the prompt's last tokens (their context
    gives the first token its leading space)."""
    context = PROMPT[-CONTEXT_TOKENS:]
    return tok.decode(context + ids, skip_special_tokens=True)[len(tok.decode(context, skip_special_tokens=True)):]


def test_streamed_text_is_the_decoding_of_the_streamed_tokens(checkpoints, start_cluster):
    target = checkpoints["llama-gqa"]
    cluster = start_cluster(target, checkpoints["llama-gqa/draft"])
    tok = AutoTokenizer.from_pretrained(target)

    req = request(PROMPT, 24, "chain")
    req.sampling.CopyFrom(gateway_pb2.Sampling(temperature=0.9, seed=7, n=2))
    texts, ids, reasons = stream(cluster, req)   # no stop strings: the handler decodes
    assert ids[0] != ids[1] and set(reasons.values()) == {"length"}
    for i in (0, 1):
        assert texts[i] == decoded(tok, ids[i]) and texts[i], i

    greedy, _, _ = stream(cluster, request(PROMPT, 24, "chain"))
    full = greedy[0]
    stop = full[len(full) // 2: len(full) // 2 + 2]   # a stop string from the middle of the greedy text
    req = request(PROMPT, 24, "chain")
    req.stop.append(stop)
    texts, ids, reasons = stream(cluster, req)   # the scheduler decodes, and stops
    assert reasons[0] == "stop" and texts[0] == full[: full.index(stop)]
    assert decoded(tok, ids[0]).startswith(texts[0]) and len(ids[0]) < 24
