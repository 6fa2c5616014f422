"""gRPC stubs generated from protos/ by the build (specdec/rpc/protoc.py); never edited by hand."""

try:
    from specdec.rpc.v1 import (  # noqa: F401
        common_pb2,
        drafter_pb2,
        drafter_pb2_grpc,
        gateway_pb2,
        gateway_pb2_grpc,
        verifier_pb2,
        verifier_pb2_grpc,
    )
except ImportError as exc:  # pragma: no cover - only without a build
    raise ImportError(
        "gRPC stubs are missing: install the package (pip install -e .) or run "
        "`python specdec/rpc/protoc.py` to generate them from protos/"
    ) from exc
