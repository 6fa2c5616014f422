"""The images' pinned dependencies: docker/constraints-cuda.txt and docker/constraints-cpu.txt.

Each image installs its dependencies with `pip install -c docker/constraints-<variant>.txt`, so
two builds get the same versions however much later the second one runs. Regenerate both files
after changing pyproject.toml's dependencies or build requirements, or the Dockerfiles'
TORCH_VERSION (on Linux x86-64, with any Python >= 3.11 and access to PyPI; standard library and
pip only):

    python3 docker/lock.py

It asks pip to resolve everything the CUDA image needs for the images' CPython on manylinux
x86-64 (`pip install --dry-run --report`: metadata only, nothing is installed), then writes, per
image, the closure of what that image installs, with markers evaluated for the image's Python.
The CPU image is the CUDA image's set less the CUDA build's own dependencies: PyTorch's CPU
wheels (its CPU index) declare the same requirements as PyPI's CUDA wheel less the CUDA
libraries (nvidia-*, cuda-*) and Triton, and the project's own `triton` requirement is dropped
(nothing runs Triton kernels without a GPU; kernels/triton_support.py falls back to the torch
references). pip's configuration files and PIP_* settings other than PIP_INDEX_URL and
PIP_EXTRA_INDEX_URL are ignored, so the files show what the index serves, not a local wheel cache.

The Dockerfiles run it too, to list what they install (`python3 docker/lock.py requirements
cpu|cuda|build`), so the images and the lock agree on what the CPU image leaves out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
VARIANTS = ("cuda", "cpu")
# The images' Python: Ubuntu 24.04's python3 (Dockerfile.cuda) and python:3.12-slim (Dockerfile.cpu).
PYTHON = "3.12"
# glibc of the older base image (Debian bookworm: 2.36; Ubuntu 24.04 has 2.39). pip matches the
# --platform tags exactly, so every manylinux tag up to it is listed.
GLIBC_MINOR = 36
# Requirements of PyPI's torch wheel that PyTorch's CPU wheel does not have.
CUDA_ONLY = re.compile(r"(nvidia-.*|cuda-.*|triton)")
NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
MARKER_ENV = {
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "os_name": "posix",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "python_version": PYTHON,
    "python_full_version": f"{PYTHON}.0",
    "implementation_version": f"{PYTHON}.0",
}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    return canonical(NAME.match(requirement)[1])


def requirements(what: str, pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """What an image installs from pyproject.toml (markers left for pip): `build` is the wheel
    build's requirements; `cpu` drops the project's triton requirement."""
    project = tomllib.loads(pyproject.read_text())
    if what == "build":
        return list(project["build-system"]["requires"])
    deps = list(project["project"]["dependencies"])
    return [r for r in deps if not (what == "cpu" and CUDA_ONLY.fullmatch(requirement_name(r)))]


def torch_version(variant: str) -> str:
    dockerfile = DOCKER / f"Dockerfile.{variant}"
    [version] = re.findall(r"^ARG TORCH_VERSION=(\S+)$", dockerfile.read_text(), flags=re.M)
    return version


def resolve(roots: list[str]) -> dict:
    """pip's installation report for `roots` on the images' Python and platform."""
    platforms = [f"manylinux_2_{minor}_x86_64" for minor in range(GLIBC_MINOR, 4, -1)]
    platforms += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PIP_") or k in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL")}
    env["PIP_CONFIG_FILE"] = os.devnull  # no pip.conf: no local find-links, extra indexes or constraints
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--disable-pip-version-check", "--report", str(report), "--python-version", PYTHON,
               "--implementation", "cp", *(a for p in platforms for a in ("--platform", p)),
               "--only-binary=:all:", *roots]
        subprocess.run(cmd, check=True, env=env)
        return json.loads(report.read_text())


def _requirement_class():
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip's own copy, always there when pip is
        from pip._vendor.packaging.requirements import Requirement
    return Requirement


def closure(report: dict, roots: list[str], requires: dict[str, list[str]] | None = None) -> dict[str, str]:
    """{name: version} of `roots` and everything they need, from the report's metadata, with
    markers evaluated for the image (pip itself evaluates them for the Python running it).
    `requires` replaces the requirements of the packages it names."""
    Requirement = _requirement_class()
    found = {canonical(item["metadata"]["name"]): item["metadata"] for item in report["install"]}
    found |= {name: {**found[name], "requires_dist": reqs} for name, reqs in (requires or {}).items()}

    def applies(req, extras: set[str]) -> bool:
        return req.marker is None or any(req.marker.evaluate({**MARKER_ENV, "extra": e}) for e in extras | {""})

    pinned: dict[str, str] = {}
    seen: set[tuple[str, frozenset]] = set()
    todo = [(Requirement(r), set()) for r in roots]
    while todo:
        req, parent_extras = todo.pop()
        if not applies(req, parent_extras):
            continue
        name = canonical(req.name)
        if name not in found:
            raise SystemExit(f"{req} is not in pip's resolution: run this script with Python {PYTHON}")
        meta = found[name]
        if not req.specifier.contains(meta["version"], prereleases=True):
            raise SystemExit(f"{name} {meta['version']} does not satisfy {req}")
        pinned[name] = meta["version"]
        key = (name, frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        todo += [(Requirement(r), set(req.extras)) for r in meta.get("requires_dist") or []]
    return pinned


def header(variant: str) -> str:
    return f"""\
# Pinned dependencies of docker/Dockerfile.{variant} (pip install -c): the project's runtime
# dependencies{' (less triton)' if variant == 'cpu' else ''}, torch and the wheel build's requirements,
# with everything they need, for CPython {PYTHON} on manylinux x86-64.
# Generated by docker/lock.py; do not edit. After changing pyproject.toml's dependencies or the
# Dockerfiles' TORCH_VERSION, regenerate both files (Linux x86-64, Python >= 3.11, PyPI access):
#     python3 docker/lock.py
"""


def lock() -> None:
    if sys.platform != "linux" or platform.machine() != "x86_64":
        raise SystemExit("run on Linux x86-64: pip evaluates platform markers for the machine it runs on")
    versions = {torch_version(v) for v in VARIANTS}
    if len(versions) != 1:
        raise SystemExit(f"the Dockerfiles' TORCH_VERSION differ: {sorted(versions)}")
    [torch] = versions
    build = requirements("build")
    report = resolve([f"torch=={torch}", *requirements("cuda"), *build])
    [torch_meta] = [i["metadata"] for i in report["install"] if canonical(i["metadata"]["name"]) == "torch"]
    Requirement = _requirement_class()
    # The CPU wheel's requirements: PyPI's less the CUDA ones (see the module docstring).
    torch_cpu = [r for r in torch_meta.get("requires_dist") or []
                 if not CUDA_ONLY.fullmatch(canonical(Requirement(r).name))]
    for variant in VARIANTS:
        pinned = closure(report, [f"torch=={torch}", *requirements(variant), *build],
                         requires={"torch": torch_cpu} if variant == "cpu" else None)
        if variant == "cpu":
            cuda = sorted(n for n in pinned if CUDA_ONLY.fullmatch(n))
            if cuda:
                raise SystemExit(f"the CPU image would install {cuda}")
        text = header(variant) + "".join(f"{n}=={v}\n" for n, v in sorted(pinned.items()))
        out = DOCKER / f"constraints-{variant}.txt"
        out.write_text(text)
        print(f"wrote {out.relative_to(ROOT)}: {len(pinned)} packages", file=sys.stderr)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command")
    req = sub.add_parser("requirements", help="print what an image installs from pyproject.toml, one per line")
    req.add_argument("what", choices=[*VARIANTS, "build"])
    req.add_argument("pyproject", type=Path, nargs="?", default=ROOT / "pyproject.toml")
    args = p.parse_args()
    if args.command == "requirements":
        print("\n".join(requirements(args.what, args.pyproject)))
    else:
        lock()


if __name__ == "__main__":
    main()
