"""Write a compose override that gives the drafter and the verifier one `device_ids` entry per GPU.

Compose interpolation only substitutes strings, so `device_ids: ["${VERIFIER_GPUS}"]` with
VERIFIER_GPUS=1,2,3,4 is the single entry "1,2,3,4". The NVIDIA runtime hook accepts that (it
joins the entries with commas anyway), but Docker's CDI path (Engine 29.2+) resolves each entry
as one device, nvidia.com/gpu=1,2,3,4, and refuses to start the container. This script writes
the lists out, and the matching tensor-parallel sizes with them. Standard library only (the
host's python3, 3.7 or newer):

    DRAFTER_GPUS=0 VERIFIER_GPUS=1,2,3,4 python3 docker/gpus.py
    docker compose -f docker/compose.yaml -f docker/compose.gpus.yaml up -d

DRAFTER_GPUS and VERIFIER_GPUS default to 0 and 1, as in compose.yaml. DRAFTER_TP/VERIFIER_TP
may be left unset (the override sets each to the number of GPUs); set, they must match it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

# Ids as `nvidia-smi -L` shows them: an index, a GPU-<uuid> or a MIG-<uuid>.
GPU_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]*")
SERVICES = (("drafter", "DRAFTER", "0"), ("verifier", "VERIFIER", "1"))


def gpu_ids(variable: str, default: str) -> list[str]:
    value = os.environ.get(variable) or default
    ids = [item.strip() for item in value.split(",")]
    bad = [item for item in ids if not GPU_ID.fullmatch(item)]
    if bad:
        raise SystemExit(f"{variable}={value!r}: not a comma-separated list of GPU ids (e.g. 1,2,3,4)")
    if len(set(ids)) != len(ids):
        raise SystemExit(f"{variable}={value!r} names a GPU twice")
    return ids


def tensor_parallel(variable: str, gpus: list[str], gpus_variable: str) -> int:
    """The rank count: one per GPU (rank r runs on the container's cuda:r)."""
    value = os.environ.get(variable)
    if value and value != str(len(gpus)):
        raise SystemExit(f"{variable}={value} does not match {gpus_variable}={','.join(gpus)} "
                         f"({len(gpus)} GPUs): each tensor-parallel rank needs its own GPU; "
                         f"set {variable}={len(gpus)} or leave it unset")
    return len(gpus)


def override() -> str:
    settings = []
    lines = ["services:"]
    for service, prefix, default in SERVICES:
        gpus = gpu_ids(f"{prefix}_GPUS", default)
        tp = tensor_parallel(f"{prefix}_TP", gpus, f"{prefix}_GPUS")
        settings.append(f"{prefix}_GPUS={','.join(gpus)}")
        # JSON strings are YAML flow scalars: the ids stay strings ("0", not 0).
        lines += [
            f"  {service}:",
            "    environment:",
            f"      SPECDEC_TP: {json.dumps(str(tp))}",
            "    deploy:",
            "      resources:",
            "        reservations:",
            "          devices: !override",
            "            - driver: nvidia",
            f"              device_ids: {json.dumps(gpus)}",
            "              capabilities: [gpu]",
        ]
    header = f"# Written by docker/gpus.py for {' '.join(settings)}; run it again to change them."
    return "\n".join([header, *lines]) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-o", "--output", type=Path, default=Path(__file__).resolve().parent / "compose.gpus.yaml",
                   help="override file to write (default: compose.gpus.yaml next to this script)")
    args = p.parse_args()
    text = override()  # validates everything before anything is written
    tmp = args.output.with_name(args.output.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(args.output)
    print(f"wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
