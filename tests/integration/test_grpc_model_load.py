"""A tenant registers its own model over gRPC as an unmodified ``tritonclient.grpc`` user loads one (issue 34):
``load_model(task, config=json.dumps({"family": F}), files={"file:model.onnx": ..., "file:validation.npz": ...})``
on a real agent door over mutual TLS, a real variant store (HTTPS, data area: it runs the build) and real etcd.
acme registers, finds the build among its builds (``load_model`` returns nothing), follows it with the SDK and
queries the task over gRPC; a second registration through the generated stub reads the build id from the reply's
metadata. A malformed config, a missing file and globex registering into acme's task are refused with their
status and a clear message."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge_agent.model_register import BUILD_ID_KEY
from mesh.client import AsyncClient
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from mesh.models import AsyncModels
from tests.helpers_models import digits_split
from tests.integration.test_tenant_versions import _first_answer, _mesh, logreg

grpc = pytest.importorskip("grpc")
tgrpc_aio = pytest.importorskip("tritonclient.grpc.aio")
service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")
service_pb2_grpc = pytest.importorskip("tritonclient.grpc.service_pb2_grpc")
InferenceServerException = pytest.importorskip("tritonclient.utils").InferenceServerException

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

TASK = "acme-grpc"


def _npz(x: np.ndarray, y: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, x=x, y=y)
    return buf.getvalue()


def _client(address: str, creds: dict[str, Any]) -> Any:
    return tgrpc_aio.InferenceServerClient(address, ssl=True, root_certificates=str(creds["ca"]),
                                           private_key=str(creds["key"]), certificate_chain=str(creds["cert"]))


def _read(path: Path) -> bytes:
    return Path(path).read_bytes()


async def _refused(client: Any, task: str, status: str, words: str, **kw: Any) -> None:
    with pytest.raises(InferenceServerException) as exc:
        await client.load_model(task, **kw)
    assert exc.value.status() == f"StatusCode.{status}" and words in str(exc.value.message()), exc.value


async def test_a_tenant_registers_over_grpc_load_model(store: Store, etcd_server: EmbeddedEtcd,
                                                       tmp_path: Path) -> None:
    split = digits_split()
    x, y = split.x_val, split.y_val
    model, val = logreg(len(split.x_train)), _npz(x, y)
    files = {"file:model.onnx": model, "file:validation.npz": val}
    async with _mesh(store, etcd_server, tmp_path, TASK) as mesh:
        agent, creds = mesh.agent, mesh.creds
        assert agent.grpc is not None and agent.models_api is not None
        assert agent.grpc.front.models is agent.models_api.registrar  # the agent wires registration into gRPC
        address = agent.grpc.address
        acme, globex = _client(address, creds), _client(address, mesh.other)
        try:
            async with AsyncModels(agent.http_url, **creds) as models, \
                    AsyncClient(agent.http_url, timeout=20.0, **creds) as sdk:
                # refused at the door, each with its status and words; nothing is queued
                await _refused(acme, TASK, "INVALID_ARGUMENT", "config must be a JSON object",
                               config="family=acme-lr", files=files)
                await _refused(acme, TASK, "INVALID_ARGUMENT", "config must be a JSON object",
                               config=json.dumps({"family": "acme-lr", "max_batch_size": 8}), files=files)
                await _refused(acme, TASK, "INVALID_ARGUMENT", "min_accuracy must be a number in [0, 1]",
                               config=json.dumps({"family": "acme-lr", "min_accuracy": 2}), files=files)
                await _refused(acme, TASK, "INVALID_ARGUMENT", "missing file(s) ['file:validation.npz']",
                               config=json.dumps({"family": "acme-lr"}), files={"file:model.onnx": model})
                await _refused(acme, TASK, "INVALID_ARGUMENT", "the model is refused (bad_protobuf)",
                               config=json.dumps({"family": "acme-lr"}),
                               files={"file:model.onnx": model[:200], "file:validation.npz": val})
                assert await models.list(TASK) == []

                # acme registers as tritonclient loads a model; load_model answers nothing: the build is listed
                assert await acme.load_model(TASK, config=json.dumps({"family": "acme-lr"}), files=files) is None
                [listed] = await models.list(TASK)
                assert listed["family"] == "acme-lr"
                done = await models.build(TASK, listed["id"]).wait(poll_s=5.0, timeout=240)
                assert done["state"] == "done" and done["variants"][0]["accuracy"] > 0.9
                await _first_answer(sdk, x[:4], "acme-lr", task=TASK)
                inp = tgrpc_aio.InferInput("x", [4, 64], "FP32")
                inp.set_data_from_numpy(x[:4].astype(np.float32))
                res = await acme.infer(TASK, [inp], parameters={"latency_ms": 5000}, client_timeout=20)
                assert res.as_numpy("logits").shape == (4, 10)
                assert res.get_response().parameters["variant"].string_param.startswith("acme-lr.")

                # load_model(task) alone asks what REST's repository load does: may the caller use it, is it served
                assert await acme.load_model(TASK) is None
                await _refused(globex, TASK, "NOT_FOUND", TASK)  # another tenant's task is unknown to it
                await _refused(acme, "no-such-task", "NOT_FOUND", "no-such-task")
                # globex may not add to acme's task, over gRPC as over REST
                await _refused(globex, TASK, "PERMISSION_DENIED", "is not yours",
                               config=json.dumps({"family": "globex-lr"}), files=files)
                # a family in use: ABORTED (conflict)
                await _refused(acme, TASK, "ABORTED", "already registered", config=json.dumps({"family": "acme-lr"}),
                               files=files)

                # the generated stub (the request load_model builds) reads the build id from the reply's metadata
                req = service_pb2.RepositoryModelLoadRequest(model_name=TASK)
                req.parameters["config"].string_param = json.dumps({"family": "acme-lr2", "min_accuracy": 0.5})
                for k, v in files.items():
                    req.parameters[k].bytes_param = v
                ssl = grpc.ssl_channel_credentials(*[_read(creds[k]) for k in ("ca", "key", "cert")])
                async with grpc.aio.secure_channel(address, ssl) as channel:
                    call = service_pb2_grpc.GRPCInferenceServiceStub(channel).RepositoryModelLoad(req, timeout=60)
                    await call
                    initial, trailing = dict(await call.initial_metadata()), dict(await call.trailing_metadata())
                build_id = trailing[BUILD_ID_KEY]
                assert initial[BUILD_ID_KEY] == build_id
                assert {b["id"] for b in await models.list(TASK)} == {listed["id"], build_id}
                done2 = await models.build(TASK, build_id).wait(poll_s=5.0, timeout=240)
                assert done2["state"] == "done", done2
        finally:
            await acme.close()
            await globex.close()
