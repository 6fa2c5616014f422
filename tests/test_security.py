"""TLS, mutual TLS and bearer tokens with real certificates made here (tests/pki.py): the gateway
serves TLS and checks tokens; the verifier and drafter require client certificates from one CA,
and the gateway presents one, checking their certificates against the name it was given for them
(`localhost`) though it dials their IPs. Plaintext, unknown CAs, missing or wrong tokens are
refused with the right code; tokens rotate by editing the file; oversized requests get
RESOURCE_EXHAUSTED."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import grpc
import pytest
from cluster import Cluster, request
from grpc_health.v1 import health_pb2, health_pb2_grpc
from model_factory import hf_greedy
from pki import CertificateAuthority

from specdec.config import GatewayConfig
from specdec.rpc import common_pb2, gateway_pb2, gateway_pb2_grpc, verifier_pb2_grpc

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    out = tmp_path_factory.mktemp("pki")
    ca, rogue = CertificateAuthority(out, "specdec-ca"), CertificateAuthority(out, "rogue-ca")
    tokens = out / "tokens"
    tokens.write_text("# one token per line\nfirst-token\n\n")
    return {"ca": ca.pem, "server": ca.issue("server", ["localhost"]), "gateway-client": ca.issue("gateway", ["gateway"]),
            "test-client": ca.issue("test-client", ["test-client"]), "rogue": rogue.issue("rogue", ["localhost"]),
            "tokens": tokens}


def credentials(pki, client: str | None = "test-client") -> grpc.ChannelCredentials:
    cert, key = pki[client].read() if client else (None, None)
    return grpc.ssl_channel_credentials(pki["ca"].read_bytes(), private_key=key, certificate_chain=cert)


@pytest.fixture(scope="module")
def secure(pki, checkpoints, tmp_path_factory):
    server, client = pki["server"], pki["gateway-client"]
    cluster = Cluster(
        checkpoints["llama-gqa"], checkpoints["llama-gqa/draft"], log_dir=tmp_path_factory.mktemp("logs"),
        extra=["--tls-cert", str(server.cert), "--tls-key", str(server.key), "--tls-ca", str(pki["ca"])],
        gateway_extra=["--tls-cert", str(server.cert), "--tls-key", str(server.key),
                       "--backend-tls-ca", str(pki["ca"]), "--backend-tls-cert", str(client.cert),
                       "--backend-tls-key", str(client.key), "--auth-tokens-file", str(pki["tokens"]),
                       "--max-request-bytes", "65536"],
        credentials=credentials(pki), server_name="localhost", token="first-token", backend_host="localhost")
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def call(cluster: Cluster, metadata=None, creds=None, req=None) -> grpc.StatusCode:
    options = [("grpc.ssl_target_name_override", "localhost")]
    channel = (grpc.secure_channel(cluster.addr["gateway"], creds, options=options) if creds is not None
               else grpc.insecure_channel(cluster.addr["gateway"]))
    with channel:
        try:
            list(gateway_pb2_grpc.GatewayStub(channel).Generate(req or request(PROMPT, 4, "off"), timeout=30,
                                                                metadata=metadata))
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def test_tls_and_mtls_end_to_end_with_token(secure, checkpoints):
    ids, final = secure.generate(PROMPT, 12, "chain", k=3)
    assert ids == hf_greedy(checkpoints["llama-gqa"], PROMPT, 12)
    assert final.stats.drafted > 0, "the gateway did not reach its drafter over mTLS"


def test_missing_or_wrong_token_is_unauthenticated(secure, pki):
    tls = credentials(pki, client=None)
    code, details = call(secure, creds=tls)
    assert code == grpc.StatusCode.UNAUTHENTICATED and "authorization: Bearer" in details
    assert call(secure, creds=tls, metadata=(("authorization", "Bearer wrong"),))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert call(secure, creds=tls, metadata=(("authorization", "first-token"),))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert call(secure, creds=tls, metadata=(("authorization", "Bearer first-token"),))[0] == grpc.StatusCode.OK
    # health checks stay open (probes carry no token)
    with grpc.secure_channel(secure.addr["gateway"], tls, options=[("grpc.ssl_target_name_override", "localhost")]) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_plaintext_and_untrusted_peers_are_refused(secure, pki):
    token = (("authorization", "Bearer first-token"),)
    assert call(secure, metadata=token)[0] == grpc.StatusCode.UNAVAILABLE            # plaintext to a TLS port
    rogue_ca = grpc.ssl_channel_credentials(pki["rogue"].cert.read_bytes())
    assert call(secure, metadata=token, creds=rogue_ca)[0] == grpc.StatusCode.UNAVAILABLE  # server not trusted
    for creds in (credentials(pki, client=None), credentials(pki, client="rogue")):  # no or untrusted client cert
        with grpc.secure_channel(secure.addr["verifier"], creds,
                                 options=[("grpc.ssl_target_name_override", "localhost")]) as ch:
            with pytest.raises(grpc.RpcError) as err:
                verifier_pb2_grpc.VerifierStub(ch).GetInfo(common_pb2.GetInfoRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert secure.info("verifier").max_sequences > 0   # with the CA's client certificate: served


def test_tokens_rotate_by_editing_the_file(secure, pki):
    tls = credentials(pki, client=None)
    pki["tokens"].write_text("second-token\n")
    deadline = time.monotonic() + 15
    while call(secure, creds=tls, metadata=(("authorization", "Bearer second-token"),))[0] != grpc.StatusCode.OK:
        assert time.monotonic() < deadline, "the rotated token was never accepted"
        time.sleep(0.2)
    assert call(secure, creds=tls, metadata=(("authorization", "Bearer first-token"),))[0] == \
        grpc.StatusCode.UNAUTHENTICATED
    pki["tokens"].write_text("first-token\n")
    while call(secure, creds=tls, metadata=(("authorization", "Bearer first-token"),))[0] != grpc.StatusCode.OK:
        assert time.monotonic() < deadline, "the restored token was never accepted"
        time.sleep(0.2)


def test_oversized_request_is_resource_exhausted(secure, pki):
    big = gateway_pb2.GenerateRequest(text="x" * 100_000, max_new_tokens=1)
    code, details = call(secure, creds=credentials(pki, client=None), req=big,
                         metadata=(("authorization", "Bearer first-token"),))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details


def test_cli_generate_over_tls_with_a_token(secure, pki, checkpoints):
    env = {**os.environ, "SPECDEC_TOKEN": "first-token"}
    out = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "generate", "--gateway", secure.addr["gateway"],
         "--tls-ca", str(pki["ca"]), "--tls-server-name", "localhost", "--token-ids", ",".join(map(str, PROMPT)),
         "--max-new-tokens", "6", "--mode", "off", "--ignore-eos", "--json"],
        capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["output_token_ids"] == hf_greedy(
        checkpoints["llama-gqa"], PROMPT, 6)
    health = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "health", "--address", secure.addr["verifier"], "--tls-ca", str(pki["ca"]),
         "--tls-cert", str(pki["test-client"].cert), "--tls-key", str(pki["test-client"].key),
         "--tls-server-name", "localhost"], capture_output=True, text=True, timeout=120)
    assert health.returncode == 0, health.stderr


@pytest.mark.parametrize("flags, message", [
    (["--tls-cert", "{crt}"], "--tls-cert and --tls-key go together"),
    (["--tls-cert", "/nonexistent.crt", "--tls-key", "{key}"], "--tls-cert /nonexistent.crt: no such file"),
    (["--tls-ca", "{ca}"], "--tls-ca (client certificates) needs --tls-cert and --tls-key"),
    (["--backend-tls-cert", "{crt}", "--backend-tls-key", "{key}"], "--backend-tls-cert needs --backend-tls-ca"),
])
def test_bad_tls_flags_say_what_to_fix(flags, message, pki, tmp_path):
    files = {"crt": pki["server"].cert, "key": pki["server"].key, "ca": pki["ca"]}
    parser = argparse.ArgumentParser()
    GatewayConfig.add_arguments(parser)
    args = parser.parse_args([f.format(**files) for f in flags])
    with pytest.raises(SystemExit, match=re.escape(message)):
        GatewayConfig.from_args(args, tmp_path)
