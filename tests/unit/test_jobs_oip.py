"""An offline job's input in the Open Inference Protocol's binary tensor layout (``variant_store.jobdata_oip``):
files made by ``tritonclient.http`` (what a caller would send) are read row range by row range; truncated files,
headers that lie about sizes, unknown datatypes and the rest are refused with an error that names the problem."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as th

from mesh.errors import RequestError
from variant_store.jobdata import read_rows, scan_input
from variant_store.jobdata_oip import oip_layout

pytestmark = pytest.mark.unit


def _triton(path: Path, name: str, arr: np.ndarray, datatype: str) -> int:
    """Write what tritonclient.http sends for one input; the header's length (its HTTP header's value)."""
    inp = th.InferInput(name, list(arr.shape), datatype)
    inp.set_data_from_numpy(arr, binary_data=True)
    body, header_length = th.InferenceServerClient.generate_request_body([inp])
    path.write_bytes(body)
    return int(header_length)


def _raw(path: Path, header: dict[str, object], data: bytes) -> None:
    path.write_bytes(json.dumps(header).encode() + data)


def _header(name: str, datatype: str, shape: list[int], size: int) -> dict[str, object]:
    return {"inputs": [{"name": name, "datatype": datatype, "shape": shape,
                        "parameters": {"binary_data_size": size}}]}


def test_a_tritonclient_body_reads_row_range_by_row_range(tmp_path: Path) -> None:
    x = np.random.default_rng(0).random((1000, 8, 8), dtype=np.float32)
    f = tmp_path / "rows.oip"
    n = _triton(f, "x", x, "FP32")
    s = scan_input(f, "oip", header_length=n)
    assert (s.rows, s.kind, s.width) == (1000, "numbers", 64)
    np.testing.assert_array_equal(read_rows(f, "oip", 250, 517), x[250:517])
    assert read_rows(f, "oip", 999, 1000).shape == (1, 8, 8)
    ints = np.arange(30, dtype=np.int16).reshape(10, 3)
    n = _triton(f, "x", ints, "INT16")
    assert scan_input(f, "oip", n).rows == 10
    out = read_rows(f, "oip", 2, 4)
    assert out.dtype == np.float32 and out.tolist() == [[6, 7, 8], [9, 10, 11]]
    with pytest.raises(RequestError, match="past the input's 10 rows"):
        read_rows(f, "oip", 5, 11)


def test_text_rows_in_bytes(tmp_path: Path) -> None:
    texts = ["IMAP and POP3 mail client", "", "héllo wörld", "Real-time strategy game"]
    f = tmp_path / "text.oip"
    n = _triton(f, "text", np.array([t.encode() for t in texts], dtype=object), "BYTES")
    s = scan_input(f, "oip", n)
    assert (s.rows, s.kind, s.width) == (4, "text", 0)
    assert read_rows(f, "oip", 1, 4).tolist() == texts[1:]
    n = _triton(f, "text", np.array([[t.encode()] for t in texts], dtype=object), "BYTES")  # [N, 1]: one per row
    assert scan_input(f, "oip", n).rows == 4


@pytest.mark.parametrize("cut", [1, 47, 100])
def test_a_truncated_file_is_refused(tmp_path: Path, cut: int) -> None:
    f = tmp_path / "rows.oip"
    _triton(f, "x", np.ones((100, 4), dtype=np.float32), "FP32")
    f.write_bytes(f.read_bytes()[:-cut])
    with pytest.raises(RequestError, match=r"binary_data_size 1600 does not fit the file|holds .* bytes more"):
        scan_input(f, "oip")


def test_a_header_that_lies_about_sizes_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "rows.oip"
    data = np.ones((10, 4), dtype=np.float32).tobytes()
    _raw(f, _header("x", "FP32", [10, 4], 150), data)  # shape says 160 bytes
    with pytest.raises(RequestError, match=r"binary_data_size is 150 bytes, but shape \[10, 4\] of FP32 is 160"):
        scan_input(f, "oip")
    _raw(f, _header("x", "FP32", [20, 4], 320), data)  # shape and size agree; the file holds half
    with pytest.raises(RequestError, match="does not fit the file"):
        scan_input(f, "oip")
    _raw(f, _header("x", "FP32", [5, 4], 80), data)  # 80 bytes more than it accounts for
    with pytest.raises(RequestError, match="80 bytes more than its JSON header"):
        scan_input(f, "oip")
    n = _triton(f, "x", np.ones((10, 4), dtype=np.float32), "FP32")
    with pytest.raises(RequestError, match=f"Inference-Header-Content-Length says {n + 3}, but the header is {n}"):
        scan_input(f, "oip", n + 3)
    # BYTES whose length prefixes claim more than there is
    _raw(f, _header("text", "BYTES", [2], 4 + 2 + 4 + 3), struct.pack("<I", 2) + b"ab" + struct.pack("<I", 9) + b"abc")
    with pytest.raises(RequestError, match="BYTES element 1 claims 9 bytes, 3 are left"):
        scan_input(f, "oip")
    _raw(f, _header("text", "BYTES", [1], 4 + 2 + 1), struct.pack("<I", 2) + b"abc")
    with pytest.raises(RequestError, match="1 bytes after its 1 BYTES elements"):
        scan_input(f, "oip")


@pytest.mark.parametrize(("header", "data", "problem"), [
    (_header("x", "BF16", [2, 2], 8), b"\0" * 8, "datatype 'BF16' is not one of BYTES"),
    (_header("x", "BOOL", [2], 2), b"\0\1", "datatype 'BOOL'"),
    (_header("x", "FP32", [0, 4], 0), b"", "has no rows"),
    (_header("x", "FP32", [2, -1], 8), b"\0" * 8, "shape must be a non-empty list of whole numbers"),
    (_header("text", "BYTES", [2, 2], 24), b"\0" * 24, "BYTES rows are one text each"),
    ({"inputs": []}, b"", "exactly one tensor"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}]}, b"", "carries JSON 'data'"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}]}, b"\0" * 4, "binary_data_size must be"),
])
def test_a_bad_header_names_its_problem(tmp_path: Path, header: dict[str, object], data: bytes,
                                        problem: str) -> None:
    f = tmp_path / "bad.oip"
    _raw(f, header, data)
    with pytest.raises(RequestError, match=problem):
        oip_layout(f)


def test_not_json_and_nan_rows(tmp_path: Path) -> None:
    f = tmp_path / "bad.oip"
    f.write_bytes(b"\x00\x01binary first")
    with pytest.raises(RequestError, match="no JSON object at the start"):
        scan_input(f, "oip")
    x = np.ones((300, 3), dtype=np.float64)
    x[217, 1] = np.nan
    _triton(f, "x", x, "FP64")
    with pytest.raises(RequestError, match="row 217: NaN or infinity") as err:
        scan_input(f, "oip")
    assert err.value.details.get("row") == 217
