"""Build hook: compile protos/ into Python stubs (specdec/rpc/v1) before packaging.

The generated files are never committed; every install (regular or editable) regenerates them
from protos/, so they cannot drift from the protocol.
"""

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        from pathlib import Path
        import sys

        sys.path.insert(0, str(Path(__file__).parent / "specdec" / "rpc"))
        from protoc import compile_protos  # noqa: PLC0415 (importable only at build time)

        compile_protos(Path(__file__).parent)
        # The package list was collected before the stubs existed: add their package.
        if self.packages is not None and "specdec.rpc.v1" not in self.packages:
            self.packages.append("specdec.rpc.v1")
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs})
