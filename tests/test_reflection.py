"""gRPC server reflection on every service: a generic client (what grpcurl does) lists the
services, finds the health service, and builds and sends a Generate request from the descriptors
it fetched, with no proto files and none of our generated stubs."""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

HEALTH = "grpc.health.v1.Health"
REFLECTION = "grpc.reflection.v1alpha.ServerReflection"


def test_every_service_answers_reflection_and_a_generic_client_can_generate(checkpoints, start_cluster):
    cluster = start_cluster(checkpoints["llama-gqa"], checkpoints["llama-gqa/draft"])
    expected = {"gateway": "specdec.v1.Gateway", "verifier": "specdec.v1.Verifier", "drafter": "specdec.v1.Drafter"}
    for name, service in expected.items():
        with grpc.insecure_channel(cluster.addr[name]) as channel:
            services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        assert services == {service, HEALTH, REFLECTION}, name

    with grpc.insecure_channel(cluster.addr["gateway"]) as channel:
        pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
        method = pool.FindServiceByName("specdec.v1.Gateway").FindMethodByName("Generate")
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        request = json_format.ParseDict({"tokenIds": {"ids": [1, 17, 42]}, "maxNewTokens": 5, "stopAtEos": False,
                                         "speculation": {"mode": "SPEC_MODE_OFF"}}, request_cls())
        call = channel.unary_stream("/specdec.v1.Gateway/Generate", request_serializer=request_cls.SerializeToString,
                                    response_deserializer=response_cls.FromString)
        replies = [json_format.MessageToDict(m) for m in call(request, timeout=60)]
    ids = [t for m in replies for t in m.get("tokenIds", [])]
    assert len(ids) == 5 and replies[-1]["final"]["finishReason"] == "length"
