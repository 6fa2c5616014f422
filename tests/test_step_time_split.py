"""scripts/step_time_split.py: the gateway's step lines joined with the engines' by step number, each
round trip split into the service's decoding, engine thread, encoding and the rest (the wire), and
the gateway's own share the step less both round trips."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.step_time_split import main  # noqa: E402

GATEWAY = """\
t [info ] request started mode=chain request_id=a
t [debug] scheduler step step=1 batch=2 admitted=0 drafting=2 predrafting=0 prefilling=False released=False \
committed=6 ms=20.0 draft_ms=7.0 draft_engine_ms=5.0 verify_ms=11.0 verify_engine_ms=9.0 predraft_ms=0.0
t [debug] scheduler step step=2 batch=2 admitted=0 drafting=2 predrafting=0 prefilling=False released=False \
committed=6 ms=22.0 draft_ms=9.0 draft_engine_ms=5.0 verify_ms=11.0 verify_engine_ms=9.0 predraft_ms=0.0
t [info ] request started mode=off request_id=b
t [debug] scheduler step step=3 batch=1 admitted=1 drafting=0 predrafting=0 prefilling=True released=False \
committed=1 ms=15.0 draft_ms=0.0 draft_engine_ms=0.0 verify_ms=14.0 verify_engine_ms=12.0 predraft_ms=0.0
"""
VERIFIER = "".join(f"t [debug] engine step step={s} decode_ms=0.5 engine_ms=9.0 thread_ms=9.2 encode_ms=0.3\n"
                   for s in (1, 2, 3))
DRAFTER = ("t [debug] engine step step=2 decode_ms=0.4 engine_ms=5.0 thread_ms=5.1 encode_ms=0.2\n"
           "t [debug] engine step step=4 decode_ms=0.4 engine_ms=5.0 thread_ms=5.1 encode_ms=0.2\n")


def test_each_round_trip_is_split_and_the_gateway_keeps_the_rest(tmp_path, capsys):
    paths = []
    for name, text in (("gateway", GATEWAY), ("verifier", VERIFIER), ("drafter", DRAFTER)):
        paths.append(str(tmp_path / f"{name}.log"))
        Path(paths[-1]).write_text(text)
    main(paths)
    out = capsys.readouterr().out
    chain = out.split("chain x 1")[1].split("off x 1")[0]
    assert "| speculating | 2 | 2 | 21.00 | 8.00 | 11.00 | 2.00 |" in chain
    # verifier: 11 - 0.5 - 9.2 - 0.3 = 1.0 on the wire; drafter: 7 - 5.7 and 9 - 5.7 (steps 2 and 4)
    assert "0.50 / 9.20 / 0.30 / 1.00 | 0.40 / 5.10 / 0.20 / 2.30 |" in chain
    off = out.split("off x 1")[1]
    assert "| admitting | 1 | 1 | 15.00 | 0.00 | 14.00 | 1.00 | 0.50 / 9.20 / 0.30 / 4.00 | 0.00 / 0.00 / 0.00 / 0.00 |" \
        in off
