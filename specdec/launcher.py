"""`specdec serve`: verifier, drafter and gateway as three processes connected by gRPC on loopback.

Each child is the same `specdec <service>` command docker compose runs. A child that dies is
restarted (with backoff) while the others keep serving; SIGINT/SIGTERM stops all three, each
draining first (running requests finish, new ones are refused), and so does a child that keeps
crashing.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from specdec.cpu_threads import serve_flags
from specdec.env import env
from specdec.security import server_tls_from_args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_all(args, target: Path, draft: Path, eagle3_head: Path | None) -> int:
    server_tls_from_args(args)   # bad TLS flags: say so now, not as a gateway crash loop
    verifier_addr = f"127.0.0.1:{free_port()}"
    drafter_addr = f"127.0.0.1:{free_port()}"
    base = [sys.executable, "-m", "specdec.cli"]
    device = [*(["--device", args.device] if args.device else []), *(["--dtype", args.dtype] if args.dtype else [])]
    limits = ["--max-sequences", str(args.max_sequences), "--max-context", str(args.max_context)]
    # On the CPU the verifier and drafter share the cores, unless SPECDEC_CPU_THREADS or
    # SPECDEC_<ROLE>_CPU_THREADS says otherwise (or there is no drafter).
    cpu = {role: [] if args.no_drafter or env("CPU_THREADS") or env(f"{role.upper()}_CPU_THREADS") else flags
           for role, flags in serve_flags().items()}
    verifier_flags = ["--batch-invariant"] if args.batch_invariant else []
    drafter_flags = ["--model", str(draft)]
    if eagle3_head:
        extra_verifier, drafter_flags = eagle3_flags(eagle3_head, target, args.project_hidden_states)
        verifier_flags += extra_verifier
    # The engines listen on loopback only and the gateway dials them in plaintext: TLS settings
    # (flags or SPECDEC_TLS_* in our environment) are for the gateway's public port.
    plain = dict.fromkeys(("SPECDEC_TLS_CERT", "SPECDEC_TLS_KEY", "SPECDEC_TLS_CA"))
    children: list[tuple[str, list[str], dict[str, str | None]]] = [
        ("verifier", [*base, "verifier", "--model", str(target), "--listen", verifier_addr, *device, *limits,
                      "--tp", str(args.tp), *verifier_flags, *cpu["verifier"]],
         {**plain, **gpus(args.verifier_gpus)}),
    ]
    if not args.no_drafter:
        children.append(("drafter", [*base, "drafter", *drafter_flags, "--listen", drafter_addr, *device, *limits,
                                     *cpu["drafter"]], {**plain, **gpus(args.drafter_gpus)}))
    public = [f"--{flag.replace('_', '-')}={value}" for flag in ("tls_cert", "tls_key", "tls_ca", "auth_tokens_file")
              if (value := getattr(args, flag))]
    children.append(("gateway", [*base, "gateway", "--listen", args.listen, "--verifier", verifier_addr,
                                 "--drafter", "none" if args.no_drafter else drafter_addr, "--target", str(target),
                                 *public], {}))
    return Supervisor(children, args.max_restarts, args.restart_window).run()


def eagle3_flags(head: Path, target: Path, project: bool) -> tuple[list[str], list[str]]:
    """(verifier flags, drafter flags) of an EAGLE-3 pair: the drafter reads the target's
    embeddings and the head; the verifier sends the head's layers, projected by its fc (project) or
    concatenated."""
    drafter = ["--model", str(target), "--eagle3-head", str(head)]
    if project:
        return ["--project-hidden-states", str(head)], [*drafter, "--projected-hidden-states"]
    from specdec.model.eagle3 import head_aux_layers

    layers = ",".join(map(str, head_aux_layers(head, target)))
    return ["--aux-hidden-layers", layers], [*drafter, "--no-projected-hidden-states"]


def gpus(ids: str | None) -> dict[str, str]:
    return {} if ids is None else {"CUDA_VISIBLE_DEVICES": ids}


class Supervisor:
    """Runs the children; restarts one that dies (with backoff, logged) while the others keep
    serving: a lost drafter's requests finish in mode off, a lost verifier's fail with
    UNAVAILABLE and new ones succeed once it is back (the gateway re-checks its replicas). Stops
    on SIGINT/SIGTERM (each child drains) or when a child crash-loops (more than `max_restarts`
    restarts within `window` seconds), and says which."""

    def __init__(self, children: list[tuple[str, list[str], dict[str, str | None]]], max_restarts: int,
                 window: float) -> None:
        """children: (name, command, environment changes: a None value removes the variable)."""
        self.children = {name: (cmd, env) for name, cmd, env in children}
        self.max_restarts, self.window = max_restarts, window
        self.procs: dict[str, subprocess.Popen] = {}
        self.restarts: dict[str, list[float]] = {name: [] for name in self.children}
        self.due: dict[str, float] = {}          # child -> when to start it again
        self.signal: str | None = None

    def _start(self, name: str) -> None:
        cmd, changes = self.children[name]
        env = {**os.environ, **changes}
        env = {key: value for key, value in env.items() if value is not None}
        # Own process group: a terminal's Ctrl-C reaches us once, and we stop the children in order.
        self.procs[name] = subprocess.Popen(cmd, env=env, start_new_session=True)
        say(f"{name} started (pid {self.procs[name].pid})")

    def run(self) -> int:
        def on_signal(signum, _frame):
            self.signal = signal.Signals(signum).name

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        for name in self.children:
            self._start(name)
        code, reason = 0, None
        while self.signal is None and reason is None:
            now = time.monotonic()
            for name, proc in list(self.procs.items()):
                if name in self.due or proc.poll() is None:
                    continue
                recent = [t for t in self.restarts[name] if now - t < self.window] + [now]
                self.restarts[name] = recent
                if len(recent) > self.max_restarts:
                    reason = (f"{name} exited {len(recent)} times within {self.window:.0f} s (last code "
                              f"{proc.returncode}): a crash loop")
                    break
                backoff = min(30.0, 2.0 ** (len(recent) - 1))
                say(f"{name} exited with code {proc.returncode}; restarting it in {backoff:.0f} s "
                    f"(restart {len(recent)} of at most {self.max_restarts} within {self.window:.0f} s)")
                self.due[name] = now + backoff
            for name, when in list(self.due.items()):
                if now >= when and self.signal is None:
                    del self.due[name]
                    self._start(name)
            time.sleep(0.2)
        if reason is not None:
            say(f"stopping: {reason}")
            code = 1
        else:
            say(f"stopping on {self.signal}: each service drains its requests first")
        self._stop_all()
        return code

    def _stop_all(self) -> None:
        procs = [p for name, p in reversed(list(self.procs.items())) if name not in self.due]
        for proc in procs:  # gateway first, then the backends
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        # Each child drains (finishes what it has in flight) for up to SPECDEC_DRAIN_SECONDS, then exits.
        deadline = time.monotonic() + float(os.environ.get("SPECDEC_DRAIN_SECONDS", "25")) + 5
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()


def say(line: str) -> None:
    print(f"specdec serve: {line}", file=sys.stderr, flush=True)
