"""`specdec serve`: verifier, drafter and gateway as three processes connected by gRPC on loopback.

Each child is the same `specdec <service>` command docker compose runs. SIGINT/SIGTERM (or any
child dying) stops all three: each drains first (running requests finish, new ones are refused).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_all(args, target: Path, draft: Path, eagle3_head: Path | None) -> int:
    verifier_addr = f"127.0.0.1:{free_port()}"
    drafter_addr = f"127.0.0.1:{free_port()}"
    base = [sys.executable, "-m", "specdec.cli"]
    device = [*(["--device", args.device] if args.device else []), *(["--dtype", args.dtype] if args.dtype else [])]
    limits = ["--max-sequences", str(args.max_sequences), "--max-context", str(args.max_context)]
    verifier_flags = ["--batch-invariant"] if args.batch_invariant else []
    drafter_flags = ["--model", str(draft)]
    if eagle3_head:  # the drafter reads the target's embeddings; the verifier sends the head's layers
        from specdec.model.eagle3 import head_aux_layers

        layers = head_aux_layers(eagle3_head, target)
        verifier_flags += ["--aux-hidden-layers", ",".join(map(str, layers))]
        drafter_flags = ["--model", str(target), "--eagle3-head", str(eagle3_head)]
    children: list[tuple[str, list[str], str | None]] = [
        ("verifier", [*base, "verifier", "--model", str(target), "--listen", verifier_addr, *device, *limits,
                      "--tp", str(args.tp), *verifier_flags], args.verifier_gpus),
    ]
    if not args.no_drafter:
        children.append(("drafter", [*base, "drafter", *drafter_flags, "--listen", drafter_addr, *device, *limits],
                         args.drafter_gpus))
    children.append(("gateway", [*base, "gateway", "--listen", args.listen, "--verifier", verifier_addr,
                                 "--drafter", "none" if args.no_drafter else drafter_addr, "--target", str(target)],
                     None))
    procs: dict[str, subprocess.Popen] = {}
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    for name, cmd, gpus in children:
        env = dict(os.environ)
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        # Own process group: a terminal's Ctrl-C reaches us once, and we stop the children in order.
        procs[name] = subprocess.Popen(cmd, env=env, start_new_session=True)
    code = 0
    while not stopping:
        for name, proc in procs.items():
            if proc.poll() is not None:
                print(f"{name} exited with code {proc.returncode}; stopping the others", file=sys.stderr)
                stopping, code = True, 1
                break
        time.sleep(0.2)
    for proc in reversed(list(procs.values())):  # gateway first, then the backends
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    # Each child drains (finishes what it has in flight) for up to SPECDEC_DRAIN_SECONDS, then exits.
    deadline = time.monotonic() + float(os.environ.get("SPECDEC_DRAIN_SECONDS", "25")) + 5
    for proc in procs.values():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
    return code
