"""Property-based fuzzing of the public Generate RPC (hypothesis) against one real cluster.

Thousands of random GenerateRequests, covering every field of the message (prompt text or token
ids, in and out of the vocabulary, empty or past the context; every mode and unknown enum numbers;
draft shapes in and out of range; max_new_tokens 0, small and huge; sampling values including NaN,
infinities, negatives and subnormals; n past the KV slots; stop strings; odd request ids; unknown
fields on the wire), sent one at a time and in concurrent batches, prove that:

- every answer is either a stream whose samples each end with a consistent FinalInfo, or an
  INVALID_ARGUMENT with a message -- never UNKNOWN, INTERNAL, UNAVAILABLE or a hang;
- which of the two it is follows the documented contract (an independent oracle below, written
  from the proto comments and the README's limits): a valid request is served, an invalid one
  refused;
- a temperature too small to matter samples exactly the greedy tokens (no overflow to NaN);
- afterwards every process is still running, every service reports SERVING, and neither engine
  holds a sequence.

CI runs a fixed set of examples (derandomized). For longer local runs, SPECDEC_FUZZ_EXAMPLES=N
sets the sequential test's example count (the concurrent test's scales with it), and
SPECDEC_FUZZ_SEED=S draws other examples than CI's.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, example, given, note, seed, settings
from hypothesis import strategies as st
from model_factory import VOCAB
from transformers import AutoTokenizer

from specdec.limits import MAX_CHAIN_K, MAX_TREE_BUDGET, MAX_TREE_DEPTH, MAX_TREE_TOPK
from specdec.rpc import gateway_pb2

# A small cluster keeps every limit cheap to reach: a 64-token context makes "past the context"
# and "exactly at it" prompts short, 8 KV slots make n > slots a small number, and a server
# default of 2 new tokens keeps max_new_tokens=0 requests fast.
MAX_CONTEXT = 64
MAX_SEQUENCES = 8
DEFAULT_MAX_NEW = 2
MAX_DRAFT_TOKENS = 64    # the verifier's default --max-draft-tokens
MAX_N = 64               # the gateway's default --max-n
MAX_STOP_STRINGS = 16    # gateway contract: at most 16 non-empty stop strings
CONCURRENCY = 8          # requests in flight at once in the concurrent test

# Examples per test. One example is one request in the sequential test and a batch of 2..8
# (4 on average) in the concurrent one, where requests share steps and cost less: about
# 400 + 175 * 4 = 1100 requests per run, ~50 s on two cores (SPECDEC_FUZZ_EXAMPLES=800 and more for a longer run).
SINGLE_EXAMPLES = int(os.environ.get("SPECDEC_FUZZ_EXAMPLES", "400"))
BATCH_EXAMPLES = max(1, SINGLE_EXAMPLES * 7 // 16)
SEED = os.environ.get("SPECDEC_FUZZ_SEED")

# derandomize: CI replays the same examples every run and never depends on a local example database.
FUZZ = settings(deadline=None, derandomize=SEED is None, database=None, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def seeded(test):
    return seed(int(SEED))(test) if SEED else test


U32, U64 = 2**32 - 1, 2**64 - 1
I32_MIN, I32_MAX = -(2**31), 2**31 - 1
TINY_TEMPERATURE = 1e-6  # below every logit gap of these models: the distribution is one-hot
CALL_TIMEOUT = 20.0  # a hang fails as DEADLINE_EXCEEDED (answers take well under a second)
METHOD = "/specdec.v1.Gateway/Generate"


@pytest.fixture(scope="module")
def cluster(checkpoints, start_cluster):
    # float32: the services' own default on the CPU, with float32 logits as on the GPU (bf16 models),
    # where float64's range would hide overflows that real deployments meet.
    return start_cluster(checkpoints["llama-gqa"], checkpoints["llama-gqa/draft"], dtype="float32",
                         extra=["--max-context", str(MAX_CONTEXT), "--max-sequences", str(MAX_SEQUENCES)],
                         gateway_extra=["--max-new-tokens", str(DEFAULT_MAX_NEW)])


@pytest.fixture(scope="module")
def tokenizer(checkpoints):
    tok = AutoTokenizer.from_pretrained(str(checkpoints["llama-gqa"]))
    assert not getattr(tok, "chat_template", None)  # the oracle expects apply_chat_template to be refused
    return tok


# ---- the request strategy ----------------------------------------------------------------------


def weighted(draw, *options):
    """Draw from one of `(weight, strategy)` options; the first is what shrinking moves towards."""
    total = sum(w for w, _ in options)
    pick = draw(st.integers(0, total - 1))
    for w, strategy in options:
        if pick < w:
            return draw(strategy)
        pick -= w
    raise AssertionError


def repeated(piece: st.SearchStrategy[str], lo: int, hi: int) -> st.SearchStrategy[str]:
    """Long strings cheaply: a short random piece repeated."""
    return st.tuples(piece, st.integers(lo, hi)).map(lambda t: t[0] * t[1])


VALID_ID = st.integers(0, VOCAB - 1)
BAD_ID = st.one_of(st.sampled_from([-1, VOCAB, VOCAB + 1, I32_MIN, I32_MAX]),
                   st.integers(I32_MIN, -1), st.integers(VOCAB, I32_MAX))
SHORT_TEXT = st.text(max_size=24)  # any unicode (no surrogates: proto strings are UTF-8), maybe empty


@st.composite
def token_ids(draw) -> list[int]:
    ids = weighted(draw,
                   (70, st.lists(VALID_ID, min_size=1, max_size=12)),
                   (10, st.lists(VALID_ID, min_size=MAX_CONTEXT - 4, max_size=MAX_CONTEXT + 1)),  # at the edge
                   (4, st.lists(VALID_ID, min_size=MAX_CONTEXT + 2, max_size=4 * MAX_CONTEXT)),   # far past it
                   (4, st.just([])))
    if draw(st.integers(0, 9)) == 9:  # 10%: one id outside the vocabulary, anywhere
        ids.insert(draw(st.integers(0, len(ids))), draw(BAD_ID))
    return ids


PROMPT_TEXT = st.one_of(
    SHORT_TEXT,
    st.sampled_from(["", "<s>", "</s>", "hello </s> world", "Grüße 東京 🙂", "\x00", " ", "\n\t"]),
    repeated(st.text(min_size=1, max_size=3), 20, 200),  # tokenizes to about the context or past it
)


def in_range_or_wild(draw, clean: bool, hi: int, small: int) -> int:
    """A uint32 draft setting: 0 (the server default), small, at the limit, or (unless clean) past it."""
    if clean:
        return weighted(draw, (50, st.just(0)), (40, st.integers(1, small)), (10, st.just(hi)))
    return weighted(draw, (40, st.just(0)), (30, st.integers(1, small)), (10, st.sampled_from([hi, hi + 1])),
                    (10, st.integers(hi + 1, U32)), (5, st.just(U32)), (5, st.integers(1, hi)))


@st.composite
def speculation(draw, clean: bool) -> gateway_pb2.SpeculationConfig:
    known = st.sampled_from([gateway_pb2.SPEC_MODE_UNSPECIFIED, gateway_pb2.SPEC_MODE_CHAIN,
                             gateway_pb2.SPEC_MODE_TREE, gateway_pb2.SPEC_MODE_OFF, gateway_pb2.SPEC_MODE_AUTO])
    # proto3 enums are open: any int32 arrives as a number the gateway has no name for.
    unknown = st.one_of(st.integers(5, I32_MAX), st.sampled_from([-1, I32_MIN, 5, 99]))
    mode = draw(known) if clean else weighted(draw, (85, known), (15, unknown))
    cfg = gateway_pb2.SpeculationConfig(mode=mode)
    # Auto (and unspecified, which is auto here) picks the shape itself: a clean request leaves it 0.
    shaped = not clean or mode not in (gateway_pb2.SPEC_MODE_UNSPECIFIED, gateway_pb2.SPEC_MODE_AUTO)
    if shaped:
        cfg.k = in_range_or_wild(draw, clean, min(MAX_CHAIN_K, MAX_DRAFT_TOKENS), 5)
        cfg.topk = in_range_or_wild(draw, clean, MAX_TREE_TOPK, 3)
        cfg.depth = in_range_or_wild(draw, clean, MAX_TREE_DEPTH, 4)
        cfg.budget = in_range_or_wild(draw, clean, min(MAX_TREE_BUDGET, MAX_DRAFT_TOKENS), 12)
    overlap = draw(st.sampled_from([None, True, False]))
    if overlap is not None:
        cfg.overlap = overlap
    return cfg


FLOAT32 = st.floats(width=32)  # NaN, +-inf, -0.0, subnormals included
ODD_FLOATS = st.sampled_from([math.nan, math.inf, -math.inf, -0.0, -1.0, 1e-45, 1e-30, 3.4e38, 1.0000001, 1e6])


@st.composite
def sampling(draw, clean: bool) -> gateway_pb2.Sampling:
    s = gateway_pb2.Sampling()
    if clean:
        s.temperature = weighted(draw, (40, st.just(0.0)), (50, st.floats(0.0625, 3.0, width=32)),
                                 (10, st.sampled_from([1e-45, 1e-40, 1e-38, 1e-30, 1e-6, 50.0])))
        s.top_p = weighted(draw, (50, st.just(0.0)), (40, st.floats(0.0, 1.0, width=32)), (10, st.just(1.0)))
        s.top_k = weighted(draw, (50, st.just(0)), (40, st.integers(1, 50)), (10, st.sampled_from([VOCAB, U32])))
        s.n = weighted(draw, (60, st.integers(0, 2)), (30, st.integers(3, 4)), (10, st.just(MAX_SEQUENCES)))
    else:
        s.temperature = weighted(draw, (40, st.floats(0.0, 3.0, width=32)), (30, FLOAT32), (30, ODD_FLOATS))
        s.top_p = weighted(draw, (40, st.floats(0.0, 1.0, width=32)), (30, FLOAT32), (30, ODD_FLOATS))
        s.top_k = weighted(draw, (60, st.integers(0, 2 * VOCAB)), (40, st.integers(0, U32)))
        s.n = weighted(draw, (60, st.integers(0, 3)), (15, st.sampled_from([MAX_SEQUENCES, MAX_SEQUENCES + 1])),
                       (15, st.integers(MAX_SEQUENCES + 1, U32)), (10, st.sampled_from([MAX_N, MAX_N + 1, U32])))
    if draw(st.booleans()):
        s.seed = draw(st.one_of(st.integers(0, U64), st.sampled_from([0, 1, 2**63, U64])))
    return s


@st.composite
def max_new_tokens(draw, clean: bool, prompt_len: int | None) -> int:
    """Mostly 1-2 tokens (every generated token costs a step on the CPU); prompts already near the
    context get the edge itself (prompt + max_new = context -1, 0, +1, +2: the draft must not
    reach past the last slot), short prompts only rarely a long generation."""
    if prompt_len is not None and prompt_len >= MAX_CONTEXT - 8 and draw(st.booleans()):
        return max(0, MAX_CONTEXT - prompt_len + draw(st.integers(-1, 0 if clean else 2)))
    if clean:
        return weighted(draw, (85, st.integers(1, 2)), (8, st.just(0)), (6, st.integers(3, 6)),
                        (1, st.integers(7, MAX_CONTEXT // 2)))
    return weighted(draw, (60, st.integers(1, 2)), (10, st.just(0)), (9, st.integers(3, 8)),
                    (1, st.integers(9, MAX_CONTEXT // 2)),
                    (10, st.integers(MAX_CONTEXT - 2, MAX_CONTEXT + 2)),  # about the whole context
                    (10, st.one_of(st.integers(MAX_CONTEXT + 3, U32), st.sampled_from([2**31, U32]))))


@st.composite
def stops(draw, clean: bool) -> list[str]:
    some = st.text(min_size=1, max_size=4)
    if clean:
        return weighted(draw, (70, st.just([])), (25, st.lists(some, min_size=1, max_size=3)),
                        (5, st.lists(some, min_size=MAX_STOP_STRINGS, max_size=MAX_STOP_STRINGS)))
    return weighted(draw, (50, st.just([])), (20, st.lists(some, min_size=1, max_size=3)),
                    (10, st.lists(st.text(max_size=2), min_size=1, max_size=3)),  # empty strings among them
                    (10, st.lists(some, min_size=MAX_STOP_STRINGS, max_size=MAX_STOP_STRINGS + 4)),
                    (10, st.lists(repeated(st.text(min_size=1, max_size=3), 50, 500), min_size=1, max_size=2)))


REQUEST_ID = st.one_of(st.just(""), st.text(max_size=40), repeated(st.text(min_size=1, max_size=4), 200, 4000),
                       st.sampled_from(["\x00", "../../etc/passwd", "id with spaces\n", "🙂" * 100]))


@st.composite
def unknown_fields(draw) -> bytes:
    """Wire fields with numbers GenerateRequest does not define: a parser must skip them."""
    out = b""
    for _ in range(draw(st.integers(1, 3))):
        number = draw(st.integers(10, 2**29 - 1))
        if draw(st.booleans()):  # varint
            out += varint(number << 3) + varint(draw(st.integers(0, U64)))
        else:                    # length-delimited
            payload = draw(st.binary(max_size=32))
            out += varint(number << 3 | 2) + varint(len(payload)) + payload
    return out


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


@st.composite
def requests(draw) -> bytes:
    """One GenerateRequest as wire bytes. In 60% ('clean') max_new_tokens, stop, speculation and
    sampling take valid values only, so a good share of requests really generates; in the other 40%
    ('wild') they mix valid and bad values. Prompts are drawn the same way in both."""
    clean = draw(st.integers(0, 9)) < 6
    m = gateway_pb2.GenerateRequest(request_id=draw(REQUEST_ID))
    prompt = weighted(draw, (45, st.just("ids")), (45, st.just("text")), (10, st.just("none")))
    prompt_len = None
    if prompt == "ids":
        ids = draw(token_ids())
        m.token_ids.ids.extend(ids)
        if not ids and draw(st.booleans()):
            m.token_ids.SetInParent()  # an empty list that is set, not an unset prompt
        prompt_len = len(ids)
    elif prompt == "text":
        m.text = draw(PROMPT_TEXT)
    m.max_new_tokens = draw(max_new_tokens(clean, prompt_len))
    m.stop.extend(draw(stops(clean)))
    eos = draw(st.sampled_from([None, True, False]))
    if eos is not None:
        m.stop_at_eos = eos
    if draw(st.booleans()):
        m.speculation.CopyFrom(draw(speculation(clean)))
    m.apply_chat_template = draw(st.integers(0, 9)) == 9  # 10%; shrinks towards False
    if draw(st.booleans()):
        m.sampling.CopyFrom(draw(sampling(clean)))
    wire = m.SerializeToString()
    if draw(st.integers(0, 19)) == 19:  # 5%
        wire += draw(unknown_fields())
    return wire


# ---- the oracle: what the contract says the gateway must do --------------------------------------


def prompt_of(m: gateway_pb2.GenerateRequest, tok) -> list[int] | None:
    """The prompt's token ids, or None if the prompt itself is invalid."""
    kind = m.WhichOneof("prompt")
    if kind == "token_ids":
        ids = list(m.token_ids.ids)
        return ids if ids and all(0 <= t < VOCAB for t in ids) else None
    if kind == "text" and m.text:
        if m.apply_chat_template:  # the test tokenizer has no chat template
            return None
        return tok(m.text)["input_ids"] or None
    return None


def problem(m: gateway_pb2.GenerateRequest, tok) -> str | None:
    """Why the gateway must refuse `m` (INVALID_ARGUMENT), or None if it must serve it."""
    ids = prompt_of(m, tok)
    if ids is None:
        return "prompt"
    max_new = m.max_new_tokens or min(DEFAULT_MAX_NEW, MAX_CONTEXT - len(ids))
    if max_new < 1 or len(ids) + max_new > MAX_CONTEXT:
        return "context"
    if len(m.stop) > MAX_STOP_STRINGS or not all(m.stop):
        return "stop"
    s = m.sampling
    if not (math.isfinite(s.temperature) and s.temperature >= 0):
        return "temperature"
    top_p = s.top_p or 1.0  # 0 means off
    if not 0 <= top_p <= 1:
        return "top_p"
    if not 1 <= (s.n or 1) <= min(MAX_N, MAX_SEQUENCES):
        return "n"
    c = m.speculation
    if c.mode not in (0, 1, 2, 3, 4):
        return "mode"
    auto = c.mode in (gateway_pb2.SPEC_MODE_UNSPECIFIED, gateway_pb2.SPEC_MODE_AUTO)  # default mode: auto
    if auto and (c.k or c.topk or c.depth or c.budget):
        return "auto with a shape"
    limits = {"k": min(MAX_CHAIN_K, MAX_DRAFT_TOKENS), "topk": MAX_TREE_TOPK, "depth": MAX_TREE_DEPTH,
              "budget": min(MAX_TREE_BUDGET, MAX_DRAFT_TOKENS)}
    for name, hi in limits.items():  # 0 = the server default, which is in range
        if getattr(c, name) > hi:
            return name
    return None


MODE_NAMES = {gateway_pb2.SPEC_MODE_CHAIN: "chain", gateway_pb2.SPEC_MODE_TREE: "tree",
              gateway_pb2.SPEC_MODE_OFF: "off"}


def check_served(m: gateway_pb2.GenerateRequest, tok, responses: list[gateway_pb2.GenerateResponse]) -> None:
    """A served request: each of its n samples streams tokens and ends with one consistent FinalInfo."""
    ids = prompt_of(m, tok)
    n = m.sampling.n or 1
    max_new = m.max_new_tokens or min(DEFAULT_MAX_NEW, MAX_CONTEXT - len(ids))
    streamed: Counter = Counter()
    finals: dict[int, gateway_pb2.FinalInfo] = {}
    for r in responses:
        assert r.sample_index < n and r.sample_index not in finals, f"message after the end of sample {r.sample_index}"
        assert all(0 <= t < VOCAB for t in r.token_ids), list(r.token_ids)
        streamed[r.sample_index] += len(r.token_ids)
        if r.HasField("final"):
            finals[r.sample_index] = r.final
    assert sorted(finals) == list(range(n)), f"samples ended: {sorted(finals)} of {n}"
    for i, f in finals.items():
        assert f.sample_index == i and f.completion_tokens == streamed[i] <= max_new, (i, f, streamed[i])
        assert f.finish_reason in ("length", "eos", "stop"), f.finish_reason
        assert f.finish_reason != "length" or f.completion_tokens == max_new
        assert f.finish_reason != "eos" or (m.stop_at_eos if m.HasField("stop_at_eos") else True)
        assert f.finish_reason != "stop" or len(m.stop) > 0
        assert list(f.prompt_token_ids) == ids and f.prompt_tokens == len(ids)
        assert f.request_id == m.request_id if m.request_id else f.request_id
        if m.sampling.HasField("seed") and i == 0:
            assert f.seed == m.sampling.seed
        # The mode asked for runs: the drafter stays up here, so a speculating request that reports
        # "off" was silently refused by it.
        assert f.stats.mode == MODE_NAMES.get(m.speculation.mode, "auto"), f.stats.mode


# ---- running requests ----------------------------------------------------------------------------


class Fuzzer:
    """Sends wire requests and judges each answer.

    A run that breaks the cluster (a process gone, a request hanging or refused as UNAVAILABLE)
    is remembered with the requests that did it, and every later example fails at once with that
    record: hypothesis's shrunk example means nothing once the cluster is down, and shrinking
    against a hanging cluster would take a timeout per attempt."""

    def __init__(self, cluster, tok) -> None:
        self.cluster, self.tok = cluster, tok
        # Raw bytes on the wire: lets a request carry fields the generated stub would not send.
        self.call = cluster.channel.unary_stream(METHOD, request_serializer=None,
                                                 response_deserializer=gateway_pb2.GenerateResponse.FromString)
        self.pool = ThreadPoolExecutor(CONCURRENCY)
        self.sent = 0
        self.outcomes: Counter = Counter()
        self.broken: str | None = None

    def send(self, wire: bytes, patience: float | None = None):
        """-> ("OK", responses) or (status code, details). `patience`: a client deadline that
        abandons the request early (the gateway must then free its sequences everywhere)."""
        try:
            return "OK", list(self.call(wire, timeout=patience or CALL_TIMEOUT))
        except grpc.RpcError as err:
            return err.code(), err.details()

    def run(self, wires: list[bytes], patience: list[float | None] | None = None) -> list:
        """Sends `wires` at once (one thread each), checks the cluster survived, judges each answer."""
        patience = patience or [None] * len(wires)
        outcomes = []
        if self.broken is None:
            outcomes = ([self.send(wires[0], patience[0])] if len(wires) == 1
                        else list(self.pool.map(self.send, wires, patience)))
            self.sent += len(wires)
            dead = {name: p.returncode for name, p in self.cluster.procs.items() if p.poll() is not None}
            stuck = [o for o, p in zip(outcomes, patience) if o[0] == grpc.StatusCode.UNAVAILABLE
                     or (o[0] == grpc.StatusCode.DEADLINE_EXCEEDED and p is None)]
            if dead or stuck:
                reqs = [gateway_pb2.GenerateRequest.FromString(w) for w in wires]
                self.broken = (f"the cluster broke (exited: {dead}, answers: {stuck!r:.1000}) "
                               f"after the requests {reqs!r:.4000}")
        assert self.broken is None, self.broken  # one place, one message: hypothesis sees one failure
        for wire, outcome, p in zip(wires, outcomes, patience):
            if p is not None and outcome[0] == grpc.StatusCode.DEADLINE_EXCEEDED:
                self.outcomes["abandoned"] += 1  # the client gave up first: nothing to judge
            else:
                self.judge(wire, outcome)
        return outcomes

    def judge(self, wire: bytes, outcome) -> None:
        m = gateway_pb2.GenerateRequest.FromString(wire)
        expected = problem(m, self.tok)
        code, payload = outcome
        self.outcomes["OK" if code == "OK" else code.name] += 1
        note(f"request: {m!r:.2000}\nexpected: {expected or 'served'}\ngot: {code} {str(payload):.500}")
        if expected is None:
            assert code == "OK", f"a valid request was refused: {code} {payload!r}"
            check_served(m, self.tok, payload)
        else:
            # A refusal the client can act on: INVALID_ARGUMENT and a message saying what to fix.
            assert code == grpc.StatusCode.INVALID_ARGUMENT, f"invalid ({expected}) request got {code} {payload!r}"
            assert payload, "INVALID_ARGUMENT without a message"

    def check_tiny_temperature(self, wire: bytes, outcome) -> None:
        """A temperature too small to matter (however small: down to float32's subnormals) samples
        exactly the greedy tokens: the same request at temperature 0 gives the same tokens. Run
        alone, one request after the other, both see the same forwards, so no rounding differs."""
        m = gateway_pb2.GenerateRequest.FromString(wire)
        if outcome[0] != "OK" or not 0 < m.sampling.temperature <= TINY_TEMPERATURE:
            return
        greedy = gateway_pb2.GenerateRequest()
        greedy.CopyFrom(m)
        greedy.sampling.temperature = 0.0
        [(_, twin)] = self.run([greedy.SerializeToString()])
        self.outcomes["greedy twins"] += 1

        def tokens(responses) -> dict[int, list[int]]:
            return {i: [t for r in responses if r.sample_index == i for t in r.token_ids]
                    for i in range(m.sampling.n or 1)}

        assert tokens(outcome[1]) == tokens(twin), f"temperature {m.sampling.temperature} is not greedy"


@pytest.fixture(scope="module")
def fuzzer(cluster, tokenizer):
    f = Fuzzer(cluster, tokenizer)
    yield f
    f.pool.shutdown(cancel_futures=True)


def assert_up_and_idle(cluster) -> None:
    """Every process runs, every service is SERVING, and both engines free every sequence
    (they do so asynchronously after a request ends: a bounded wait)."""
    assert {name: p.poll() for name, p in cluster.procs.items()} == dict.fromkeys(cluster.procs)
    for name, address in cluster.addr.items():
        with grpc.insecure_channel(address) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING, name
    deadline = time.monotonic() + 10
    while True:
        active = {name: cluster.info(name).active_sequences for name in ("verifier", "drafter")}
        if not any(active.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert active == {"verifier": 0, "drafter": 0}, f"sequences left behind: {active}"


def tiny_temperature(temperature: float, mode: int, n: int = 1) -> bytes:
    return gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIdList(ids=[5, 17, 42]), max_new_tokens=6,
        speculation=gateway_pb2.SpeculationConfig(mode=mode),
        sampling=gateway_pb2.Sampling(temperature=temperature, n=n),
    ).SerializeToString()


def test_random_requests_one_at_a_time(fuzzer, cluster):
    # Always run, whatever the draw: temperatures whose logits / t overflowed float32 (fixed in
    # specdec.sampling.processed_probs: the tokens came out as the last vocabulary id).
    @seeded
    @settings(FUZZ, max_examples=SINGLE_EXAMPLES)
    @given(requests())
    @example(tiny_temperature(1.4e-45, gateway_pb2.SPEC_MODE_CHAIN))   # float32's smallest subnormal
    @example(tiny_temperature(1e-38, gateway_pb2.SPEC_MODE_TREE, n=2))
    @example(tiny_temperature(1e-40, gateway_pb2.SPEC_MODE_OFF))
    def one(wire: bytes) -> None:
        [outcome] = fuzzer.run([wire])
        fuzzer.check_tiny_temperature(wire, outcome)

    before = fuzzer.sent
    one()
    print(f"one at a time: {fuzzer.sent - before} requests, outcomes so far {dict(fuzzer.outcomes)}")  # -s shows it
    assert fuzzer.sent - before >= SINGLE_EXAMPLES  # the run really sent what it claims
    assert_up_and_idle(cluster)


# A tenth of the concurrent requests are abandoned by their client after 1-60 ms (a request takes
# about 20-50 ms), mid-prefill or mid-generation: the final idle check then also covers sequences
# freed by cancellation.
PATIENCE = st.one_of(st.none(), st.none(), st.none(), st.none(), st.none(), st.none(), st.none(), st.none(),
                     st.none(), st.floats(0.001, 0.06))


def test_random_requests_concurrently(fuzzer, cluster):
    """Bad requests arrive while good ones are generating: batches of 2..8 at once, the n samples
    of some competing for the 8 KV slots (admission queues them), some abandoned by their client."""

    @seeded
    @settings(FUZZ, max_examples=BATCH_EXAMPLES)
    @given(st.lists(st.tuples(requests(), PATIENCE), min_size=2, max_size=CONCURRENCY))
    def batch(items: list[tuple[bytes, float | None]]) -> None:
        fuzzer.run([w for w, _ in items], [p for _, p in items])

    before = fuzzer.sent
    batch()
    print(f"concurrently: {fuzzer.sent - before} requests, outcomes so far {dict(fuzzer.outcomes)}")
    assert fuzzer.sent - before >= 2 * BATCH_EXAMPLES
    assert_up_and_idle(cluster)
