"""What the SDK and the codec keep from one query for the next: the kept parts must produce the
very bytes and results that encoding afresh would."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
import pytest

from mesh.client import AsyncClient, InferResult
from mesh.sdk_transport import MockTransport, Response
from mesh.types import TaskSignature, TensorSpec
from mesh.v2 import codec as codec
from mesh.v2 import tensors as v2_tensors
from mesh.v2.body import HEADER_LENGTH, TENANT_HEADER
from mesh.v2.params import result_fields, result_values, signature_to_metadata

pytestmark = pytest.mark.unit

SIG = TaskSignature("t", (TensorSpec("x", "float32", (-1, -1)),), (TensorSpec("y", "float32", (-1, -1)),))
PARAMS = {"site": "edge-a", "variant": "v1", "accuracy": 0.97, "reason": "local_ok", "best_effort": True,
          "tenant": "acme", "timing_ms_network": 0.5, "timing_ms_queue": 0.25, "timing_ms_compute": 1.0,
          "timing_ms_total": 2.0, "hops": "edge-a,core"}


class Echo:
    """Answers like the edge: output ``y`` is the input, and it records every request it decoded."""

    def __init__(self) -> None:
        self.seen: list[tuple[dict[str, str], dict[str, Any], np.ndarray]] = []

    def __call__(self, method: str, path: str, headers: dict[str, str], body: bytes) -> Response:
        if method == "GET":
            return 200, {}, json.dumps(signature_to_metadata(SIG)).encode()
        hlen = headers.get(HEADER_LENGTH)
        head = json.loads(body[:int(hlen)] if hlen else body)
        dec = codec.decode_infer_request(body, int(hlen) if hlen else None)
        self.seen.append((headers, head, dec.inputs["x"]))
        out, rl = codec.encode_infer_response("t", dec.request_id or "gen", {"y": dec.inputs["x"]},
                                              {**PARAMS, "tenant": headers[TENANT_HEADER]},
                                              dec.binary_default)
        return 200, ({HEADER_LENGTH: str(rl)} if rl else {}), out


async def test_repeated_query_sends_the_bytes_a_fresh_encoding_would() -> None:
    echo = Echo()
    rng = np.random.default_rng(1)
    async with AsyncClient("http://edge", transport=MockTransport(echo)) as c:
        xs = [rng.random((3, 8), dtype=np.float32) for _ in range(3)]
        for x in xs:
            r = await c.infer("t", x, latency_ms=20.0)
            np.testing.assert_array_equal(r.output(), x)
        # a non-contiguous and a big-endian array with the same dtype name and shape
        odd = [np.asfortranarray(xs[0]), xs[1].astype(">f4")]
        for x in odd:
            np.testing.assert_array_equal((await c.infer("t", x, latency_ms=20.0)).output(), x)
    heads = [h for _, h, _ in echo.seen]
    assert all(h == heads[0] for h in heads)
    for x, (_, _, got) in zip(xs + odd, echo.seen, strict=True):
        np.testing.assert_array_equal(got, x)


async def test_a_changed_slo_shape_tenant_or_id_is_encoded_afresh() -> None:
    echo = Echo()
    async with AsyncClient("http://edge", tenant="acme", transport=MockTransport(echo)) as c:
        x = np.ones((1, 4), np.float32)
        await c.infer("t", x, latency_ms=20.0)
        await c.infer("t", x, latency_ms=20)  # equal to 20.0, written differently
        await c.infer("t", x, latency_ms=20.0, max_cost=1.5, prefer="accuracy")
        await c.infer("t", np.ones((2, 4), np.float32), latency_ms=20.0)
        await c.infer("t", x, latency_ms=20.0, request_id="q-7")
        c.tenant = "other"
        r = await c.infer("t", x, latency_ms=20.0)
    sent = [(h[TENANT_HEADER], head) for h, head, _ in echo.seen]
    assert [json.dumps(head["parameters"]["latency_ms"]) for _, head in sent[:2]] == ["20.0", "20"]
    assert sent[2][1]["parameters"]["max_cost"] == 1.5 and sent[2][1]["parameters"]["prefer"] == "accuracy"
    assert sent[3][1]["inputs"][0]["shape"] == [2, 4]
    assert sent[4][1]["id"] == "q-7" and "id" not in sent[5][1]
    assert sent[5][0] == "other" and r.tenant == "other"


async def test_json_mode_is_never_planned() -> None:
    echo = Echo()
    async with AsyncClient("http://edge", transport=MockTransport(echo), binary=False) as c:
        for v in (1.0, 2.0):
            r = await c.infer("t", np.full((1, 2), v, np.float32), latency_ms=20.0)
            assert r.output().tolist() == [[v, v]]
    assert all("data" in head["inputs"][0] for _, head, _ in echo.seen)


def test_result_values_line_up_with_result_fields_and_infer_result() -> None:
    fields = result_fields(PARAMS)
    assert tuple(fields.values()) == result_values(PARAMS)
    names = [f.name for f in dataclasses.fields(InferResult)]
    assert names[1:1 + len(fields)] == list(fields)  # the SDK builds its result positionally
    assert fields["hops"] == ["edge-a", "core"] and fields["best_effort"] is True
    assert result_values({})[-1] == [] and result_values({"hops": ""})[-1] == []


def test_kept_tensor_descriptions_match_fresh_ones() -> None:
    params = {"site": "s"}
    for shape in ((1, 10), (4, 10), (1, 10)):
        y = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
        body, hlen = codec.encode_infer_response("t", "r", {"y": y}, params, True)
        v2_tensors.DESCS.clear()
        assert (body, hlen) == codec.encode_infer_response("t", "r", {"y": y}, params, True)
        head = json.loads(body[:hlen])
        assert head["outputs"][0]["shape"] == list(shape)
        assert head["outputs"][0]["parameters"]["binary_data_size"] == y.nbytes
        np.testing.assert_array_equal(codec.decode_infer_response(body, hlen).outputs["y"], y)
    # a JSON output of the same name and shape is not taken for the binary one
    body, hlen = codec.encode_infer_response("t", "r", {"y": np.ones((1, 10), np.float32)}, params, False)
    assert hlen is None and "data" in json.loads(body)["outputs"][0]
