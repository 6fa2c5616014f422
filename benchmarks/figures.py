"""The PNG figures (matplotlib, the `bench` extra): throughput against concurrency per mode,
speedup against acceptance beside the analytic ideal, and the gateway's share of a step."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt  # noqa: E402

from benchmarks import analysis as an  # noqa: E402
from benchmarks.metrics import RunResult, ideal_speedup  # noqa: E402

def _note(meta: dict) -> str:
    return "drafter and verifier share " + ("the CPU" if meta["gpu"] == "CPU" else "one GPU")


def _style(cfg: str) -> dict:
    return {"color": "black", "linewidth": 2.5} if cfg == "off" else {
        "linestyle": "--" if "no-overlap" in cfg else "-", "marker": "o", "markersize": 3}


def _throughput(rows: list[RunResult], a: float, meta: dict, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, p in zip(axes, (an.IN, an.GW)):
        sel = [r for r in rows if r.path == p and (r.config == "off" or r.acceptance == a)]
        for cfg in sorted({r.config for r in sel}, key=an.config_order):
            pts = sorted((r.concurrency, r.tok_s) for r in sel if r.config == cfg)
            ax.plot(*zip(*pts), label=cfg, **_style(cfg))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrency C")
        ax.set_title(f"{p}, a = {a:g}")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("output tok/s")
    axes[1].legend(fontsize=7, ncol=2)
    fig.suptitle(f"{meta['pair']}: output tok/s ({meta['gpu']}; {_note(meta)})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _acceptance(rows: list[RunResult], meta: dict, path: Path) -> bool:
    sweep = [r for r in rows if r.path in (an.IN, an.GW) and r.acceptance is not None and r.speedup is not None]
    cs = sorted({r.concurrency for r in sweep if len({x.acceptance for x in sweep
                                                      if x.concurrency == r.concurrency and x.config == r.config}) > 1})
    if not cs:
        return False
    fig, axes = plt.subplots(1, len(cs), figsize=(6 * len(cs), 4.5), squeeze=False)
    cr = an.cost_ratio(rows, an.headline(rows))
    for ax, c in zip(axes[0], cs):
        for p, style in ((an.IN, "-"), (an.GW, ":")):
            for cfg in sorted({r.config for r in sweep if r.concurrency == c}, key=an.config_order):
                pts = sorted((r.acceptance, r.speedup) for r in sweep if r.path == p and r.concurrency == c
                             and r.config == cfg)
                if len(pts) > 1:
                    ax.plot(*zip(*pts), style, marker="o", markersize=3, label=f"{cfg} ({p})")
        if c == 1 and cr is not None:
            grid = [i / 50 for i in range(51)]
            ax.plot(grid, [ideal_speedup(a, an.IDEAL_K, cr["c"]) for a in grid], color="gray", linewidth=1,
                    label=f"ideal k={an.IDEAL_K}, c={cr['c']:.2f}")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xlabel("acceptance a")
        ax.set_ylabel("speedup over mode off")
        ax.set_title(f"C = {c}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{meta['pair']}: speedup vs acceptance ({_note(meta)})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _gateway_share(rows: list[RunResult], a: float, meta: dict, path: Path) -> bool:
    gw = [r for r in rows if r.path == an.GW and (r.config == "off" or r.acceptance == a)]
    shares = {r.config: [] for r in gw}
    for r in gw:
        s = an.gateway_share(rows, r)
        if s is not None:
            shares[r.config].append((r.concurrency, 100 * s))
    if not any(shares.values()):
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for cfg in sorted(shares, key=an.config_order):
        if shares[cfg]:
            ax.plot(*zip(*sorted(shares[cfg])), label=cfg, **_style(cfg))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency C")
    ax.set_ylabel("gateway + gRPC share of a step (%)")
    ax.set_title(f"1 - in-process step / gateway step, a = {a:g} ({_note(meta)})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def draw(rows: list[RunResult], meta: dict, out_dir: Path) -> list[str]:
    """Draw what the rows allow into out_dir -> the file names written."""
    names = []
    a = an.headline(rows)
    if a is not None:
        _throughput(rows, a, meta, out_dir / "throughput.png")
        names.append("throughput.png")
        if _gateway_share(rows, a, meta, out_dir / "gateway_share.png"):
            names.append("gateway_share.png")
    if _acceptance(rows, meta, out_dir / "acceptance.png"):
        names.append("acceptance.png")
    return names
