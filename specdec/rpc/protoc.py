"""Compile protos/**/*.proto into Python message and gRPC stubs beside this file.

Run by the build (setup.py) and runnable by hand: `python specdec/rpc/protoc.py`.
Stand-alone on purpose: it must work before the package itself is importable.
"""

from __future__ import annotations

import sys
from pathlib import Path


def compile_protos(repo_root: Path) -> list[Path]:
    from grpc_tools import protoc

    proto_root = repo_root / "protos"
    protos = sorted(proto_root.rglob("*.proto"))
    if not protos:
        raise RuntimeError(f"no .proto files under {proto_root}")
    include = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{include}",
        f"--python_out={repo_root}",
        f"--pyi_out={repo_root}",
        f"--grpc_python_out={repo_root}",
        *map(str, protos),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed; see the messages above")
    out_dirs = {repo_root / p.parent.relative_to(proto_root) for p in protos}
    for d in out_dirs:  # make generated folders importable packages
        (d / "__init__.py").touch()
    return sorted(out_dirs)


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[2]
    for d in compile_protos(root):
        print(f"stubs written to {d}", file=sys.stderr)
