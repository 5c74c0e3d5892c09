"""mesh.v2.plain (the SDK's codec without numpy) against mesh.v2.codec (numpy): the same bytes on the wire for
the same values, each reading what the other wrote; and the SDK's whole call path in an interpreter without numpy
or cryptography."""

from __future__ import annotations

import os
import subprocess
import sys
from array import array
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.errors import BadTensor
from mesh.v2 import codec, plain
from mesh.v2.datatypes import FIXED
from mesh.v2.plain import Tensor, as_tensor, fit_shape
from mesh.v2.tensors import V2_TO_NP

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PARAMS = {"latency_ms": 20.0, "min_accuracy": 0.5, "prefer": "latency"}


def _values(datatype: str, n: int) -> list[object]:
    if datatype == "BOOL":
        return [i % 3 == 0 for i in range(n)]
    if datatype.startswith("FP"):
        return [(i - 3) * 0.375 for i in range(n)]  # exact in FP16 too
    lo = 0 if datatype.startswith("U") else -3
    return [lo + i for i in range(n)]


def _pair(datatype: str, shape: tuple[int, ...]) -> tuple[np.ndarray, Tensor]:
    n = int(np.prod(shape))
    if datatype == "BYTES":
        items = [f"é{i}".encode() * i for i in range(n)]
        arr = np.empty(n, dtype=object)
        arr[:] = items
        return arr.reshape(shape), Tensor("BYTES", shape, items)
    vals = _values(datatype, n)
    arr = np.asarray(vals, dtype=V2_TO_NP[datatype].newbyteorder("=")).reshape(shape)
    return arr, as_tensor(arr.tolist(), datatype)


@pytest.mark.parametrize("datatype", [*FIXED, "BYTES"])
@pytest.mark.parametrize("binary", [True, False])
@pytest.mark.parametrize("request_id", [None, "r-1"])
def test_requests_are_byte_for_byte_the_numpy_codecs(datatype: str, binary: bool, request_id: str | None) -> None:
    arr, t = _pair(datatype, (2, 3))
    other_arr, other_t = _pair("FP32", (1, 4))
    want = codec.encode_infer_request({"x": arr, "y": other_arr}, PARAMS, request_id=request_id, binary=binary)
    got = plain.encode_infer_request({"x": t, "y": other_t}, PARAMS, request_id=request_id, binary=binary)
    assert got == want
    if binary:  # the SDK's kept-header path joins a header with tensor_data: the same tail
        assert b"".join(plain.tensor_data({"x": t, "y": other_t})) == want[0][want[1]:]
    # and the server reads it back to the values it was given
    dec = codec.decode_infer_request(got[0], got[1])
    assert dec.inputs["x"].tolist() == arr.tolist()


@pytest.mark.parametrize("datatype", [*FIXED, "BYTES"])
@pytest.mark.parametrize("binary", [True, False])
def test_responses_read_as_the_numpy_codec_reads_them(datatype: str, binary: bool) -> None:
    arr, _ = _pair(datatype, (2, 2))
    logits = np.arange(6, dtype=np.float32).reshape(1, 6) / 7
    body, hlen = codec.encode_infer_response("task", "r-9", {"out": arr, "logits": logits}, {"site": "e"}, binary)
    want = codec.decode_infer_response(body, hlen)
    got = plain.decode_infer_response(body, hlen)
    assert (got.request_id, got.parameters) == (want.request_id, want.parameters)
    for name in ("out", "logits"):
        t = got.outputs[name]
        assert isinstance(t, Tensor) and t.shape == want.outputs[name].shape
        assert t.tolist() == want.outputs[name].tolist()
        back = np.asarray(t)  # the buffer a caller hands to numpy later
        assert back.dtype == want.outputs[name].dtype and np.array_equal(back, want.outputs[name])
    if datatype in ("FP32", "INT64"):  # numbers land in an array.array, a buffer
        assert isinstance(got.outputs["out"].data, array)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=40))
def test_fp32_values_survive_both_ways(values: list[float]) -> None:
    t = as_tensor(values, "FP32")
    arr = np.asarray(values, dtype=np.float32)
    assert t.tobytes() == arr.tobytes()
    assert Tensor.from_wire("FP32", (len(values),), t.tobytes()).tolist() == arr.tolist()


def test_inputs_from_lists_arrays_and_texts() -> None:
    assert as_tensor(array("d", [0.5] * 128), "FP32", (-1, 64)).shape == (2, 64)  # fitted, converted to FP32
    assert as_tensor([[1, 2], [3, 4]], "INT64").tolist() == [[1, 2], [3, 4]]
    texts = as_tensor(["café", b"raw"], "BYTES", (-1,))
    assert texts.data == ["café".encode(), b"raw"] and texts.shape == (2,)
    assert fit_shape((65,), (-1, 64)) == (65,)  # not a whole row: left for the edge to refuse
    assert fit_shape((64,), (-1,)) == (64,)
    with pytest.raises(BadTensor, match="different lengths"):
        as_tensor([[1.0, 2.0], [3.0]], "FP32")
    with pytest.raises(BadTensor, match="not INT32"):
        as_tensor([1.5], "INT32")
    with pytest.raises(BadTensor, match="BYTES element"):
        as_tensor([1, 2], "BYTES")
    with pytest.raises(BadTensor, match="unsupported datatype"):
        as_tensor([1], "BF16")


def test_malformed_responses_are_clear_errors() -> None:
    arr = np.zeros((1, 2), np.float32)
    body, hlen = codec.encode_infer_response("t", "r", {"y": arr}, {}, True)
    assert hlen is not None
    with pytest.raises(BadTensor, match=r"bytes left|needs"):
        plain.decode_infer_response(body[:-1], hlen)
    with pytest.raises(BadTensor, match="after the declared"):
        plain.decode_infer_response(body + b"\0", hlen)
    with pytest.raises(BadTensor, match="elements cannot fill"):
        Tensor("FP32", (3,), array("f", [1.0]))


_NO_NUMPY_CALL = """
import sys
sys.modules.update(dict.fromkeys(("numpy", "cryptography")))  # as on the base install: neither can be imported
from array import array
from mesh import Client, Tensor
from mesh.sdk_transport import MockTransport
from mesh.v2 import plain, sdk
from mesh.v2.body import HEADER_LENGTH
from mesh.v2.params import signature_to_metadata
from mesh.types import TaskSignature, TensorSpec
import orjson

SIG = TaskSignature("t", (TensorSpec("x", "float32", (-1, 4)),), (TensorSpec("y", "float32", (-1, 2)),))
seen = []

def handler(method, path, headers, body):
    if method == "GET":
        return 200, {}, orjson.dumps(signature_to_metadata(SIG))
    hlen = int(headers[HEADER_LENGTH])
    seen.append(body)
    head = orjson.loads(body[:hlen])
    (x,) = head["inputs"]
    rows = x["shape"][0]
    out = Tensor("FP32", (rows, 2), array("f", [float(i) for i in range(rows * 2)]))
    resp, rlen = plain.assemble({"id": "r", "parameters": {"site": "edge-1", "variant": "v"},
                                 "outputs": [{"name": "y", "datatype": "FP32", "shape": [rows, 2],
                                              "parameters": {"binary_data_size": 8 * rows}}]}, [out.tobytes()])
    return 200, {HEADER_LENGTH: str(rlen)}, resp

with Client("http://edge", transport=MockTransport(handler)) as c:
    a = c.infer("t", [[0.5, 1, 2, 3]], latency_ms=100)
    b = c.infer("t", array("f", [0.5, 1, 2, 3] * 2), latency_ms=100)  # flat: fitted to (2, 4); kept header
    d = c.infer("t", {"x": [[1, 2, 3, 4]]}, latency_ms=100)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("numpy", "cryptography") and sys.modules[m])
print(sdk.NUMPY, type(a.output()).__name__, a.output().tolist(), b.output().shape, d.site, loaded, len(seen[1]))
"""


def test_the_sdk_calls_without_numpy_or_cryptography() -> None:
    out = subprocess.run([sys.executable, "-c", _NO_NUMPY_CALL], capture_output=True, text=True, timeout=60,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    head_and_two_rows = out.stdout.split()
    assert out.stdout.strip() == "False Tensor [[0.0, 1.0]] (2, 2) edge-1 [] " + head_and_two_rows[-1]
    assert int(head_and_two_rows[-1]) > 32  # a header and 2 x 4 FP32


async def test_with_numpy_lists_and_tensors_are_sent_as_the_ndarray_would_be() -> None:
    from mesh import AsyncClient
    from mesh.sdk_transport import MockTransport
    from mesh.types import TaskSignature, TensorSpec
    from mesh.v2.body import dumps
    from mesh.v2.params import signature_to_metadata

    sig = TaskSignature("t", (TensorSpec("x", "float32", (-1, 4)),), (TensorSpec("y", "float32", (-1, 2)),))
    bodies: list[bytes] = []

    def handler(method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, str], bytes]:
        if method == "GET":
            return 200, {}, dumps(signature_to_metadata(sig))
        bodies.append(body)
        resp, _ = codec.encode_infer_response("t", "r", {"y": np.ones((1, 2), np.float32)}, {"site": "e"}, False)
        return 200, {}, resp

    async with AsyncClient("http://edge", transport=MockTransport(handler)) as c:
        want = await c.infer("t", np.asarray([[0.5, 1, 2, 3]], np.float32), latency_ms=100)
        await c.infer("t", [[0.5, 1, 2, 3]], latency_ms=100)
        await c.infer("t", array("d", [0.5, 1, 2, 3]), latency_ms=100)
        await c.infer("t", as_tensor([[0.5, 1, 2, 3]], "FP32"), latency_ms=100)
    assert type(want.output()) is np.ndarray and want.output().tolist() == [[1.0, 1.0]]
    assert len(bodies) == 4 and len(set(bodies)) == 1, bodies


_NO_CRYPTO_TLS = """
import sys
sys.modules.update(dict.fromkeys(("numpy", "cryptography")))
from mesh import Client
with Client("https://127.0.0.1:1", cert=sys.argv[1], key=sys.argv[2], ca=sys.argv[3]) as c:
    creds = c._async.credentials
    ctx = creds.client_context()
    print(type(ctx).__name__, creds.refresh(), sorted(m for m in sys.modules if m.startswith("cryptography")
                                                     and sys.modules[m]))
"""


def test_mutual_tls_credentials_need_no_cryptography(tmp_path: Path) -> None:
    from mesh.pki.identity import Identity
    from mesh.pki.local import LocalPki

    pki = LocalPki.under(tmp_path)
    pki.init()
    tenant = Identity("tenant", "acme")
    pki.issue(tenant)
    paths = pki.paths
    out = subprocess.run([sys.executable, "-c", _NO_CRYPTO_TLS, str(paths.cert(tenant)), str(paths.key(tenant)),
                          str(paths.ca_cert)], capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["SSLContext", "False", "[]"]
