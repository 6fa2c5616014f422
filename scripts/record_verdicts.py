"""Record per-step committed tokens of fixed speculation modes (SmolLM2 + the shipped EAGLE-3 head,
held-out prompts, one request at a time, through real services): the verdict traces that
benchmarks/auto_replay.py replays through `--mode auto`'s policy.

    python scripts/record_verdicts.py --out tests/data/smollm2_verdicts.json    # ~15 minutes on 2 cores

Each config's trace is, per prompt, the tokens each streamed step carried (the first is the
prefill's token; then a step of a fixed mode commits its accepted drafts plus one).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from bench_serve import config  # noqa: E402
from cluster import Cluster, request  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from specdec.embedded_head import HEAD_DIR  # noqa: E402
from specdec.embedded_model import ensure_embedded_models  # noqa: E402
from specdec.launcher import eagle3_flags  # noqa: E402
from specdec.train.prompts import build_prompts  # noqa: E402

CONFIGS = ("chain k=4 no-overlap", "tree topk=2 depth=4 budget=8", "tree topk=4", "tree topk=8 depth=6 budget=32",
           "tree topk=8 depth=7 budget=64")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS))
    a = p.parse_args()
    target, _ = ensure_embedded_models()
    verifier_extra, drafter_extra = eagle3_flags(HEAD_DIR, target, None)
    tok = AutoTokenizer.from_pretrained(target)
    texts = build_prompts(seed=0).heldout[:a.num_prompts]
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                           tokenize=False), add_special_tokens=False)["input_ids"] for t in texts]
    dtype = "bfloat16" if a.device == "cuda" else "float32"
    cluster = Cluster(target, target, device=a.device, dtype=dtype, drafter_extra=drafter_extra,
                      verifier_extra=verifier_extra).start()
    traces = {}
    try:
        with tqdm(total=len(a.configs) * len(prompts), desc="requests", file=sys.stderr) as bar:
            for name in a.configs:
                mode, spec = config(name)
                traces[name] = []
                for ids in prompts:
                    stream = cluster.gateway.Generate(request(ids, a.max_new_tokens, mode, stop_at_eos=True, **spec),
                                                      timeout=600)
                    traces[name].append([len(m.token_ids) for m in stream if m.token_ids])
                    bar.update()
    finally:
        cluster.stop()
    recorded = {"command": "python scripts/record_verdicts.py " + " ".join(sys.argv[1:]), "device": a.device,
                "dtype": dtype, "date": time.strftime("%Y-%m-%d"), "max_new_tokens": a.max_new_tokens,
                "prompts": f"build_prompts(seed=0).heldout[:{a.num_prompts}], chat template, stop at EOS"}
    Path(a.out).write_text(json.dumps({"recorded": recorded, "traces": traces}, separators=(",", ":")) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
