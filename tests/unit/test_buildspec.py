"""Tenants' model build records (``mesh.buildspec``): hostile values decode to ``ProtocolError`` and nothing else, the
state rules as tables, the validation-set scan without trusting the upload, and who may write which build keys."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mesh.buildspec import (
    BuildRequest,
    BuildState,
    VariantResult,
    build_status,
    claimable,
    is_name,
    scan_validation,
    transition_ok,
)
from mesh.errors import ProtocolError, RequestError
from mesh.etcd.keys import build_key, build_state_key
from mesh.etcd.rbac import plan

pytestmark = pytest.mark.unit

ID = "a" * 32
REQ = BuildRequest(build_id=ID, tenant="acme", task="my-digits", family="logreg", model_digest="b" * 64,
                   model_bytes=100, validation_digest="c" * 64, validation_bytes=200, rows=450, door="edge-1",
                   created=1.7e9)
RUNNING = BuildState(ID, "acme", "running", stage="building", progress=0.3, worker="store:1", started=1.7e9,
                     updated=1.7e9)
DONE = RUNNING.but(state="done", progress=1.0, variants=(VariantResult("logreg.onnx.fp32", "onnx", "fp32", 0.95, 2600,
                                                                      {"cpu-x86_64": {1: 0.05, 8: 0.1}}),))


def test_records_round_trip() -> None:
    assert BuildRequest.from_json(REQ.to_json()) == REQ
    assert BuildState.from_json(DONE.to_json()) == DONE
    assert BuildState.from_json(RUNNING.to_json()) == RUNNING


def _with(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**base, **changes}


def _deep(n: int) -> Any:
    v: Any = 1
    for _ in range(n):
        v = [v]
    return v


@pytest.mark.parametrize("value", [
    None, 3, "x", [], {"schema": 2}, _with(REQ.to_json(), build_id="../../x"), _with(REQ.to_json(), tenant="a/b"),
    _with(REQ.to_json(), family="has.dot"), _with(REQ.to_json(), model_digest="zz"), _with(REQ.to_json(), rows=True),
    _with(REQ.to_json(), rows=1), _with(REQ.to_json(), created=float("nan")), _with(REQ.to_json(), created=10 ** 400),
    _with(REQ.to_json(), model_bytes=-1), _with(REQ.to_json(), door=_deep(5000)),
    {k: v for k, v in REQ.to_json().items() if k != "task"},
])
def test_a_hostile_request_is_a_protocol_error(value: Any) -> None:
    with pytest.raises(ProtocolError):
        BuildRequest.from_json(value)


@pytest.mark.parametrize("value", [
    None, _with(DONE.to_json(), state="queued"), _with(DONE.to_json(), state="bogus"),
    _with(DONE.to_json(), progress=1.5), _with(DONE.to_json(), variants="no"),
    _with(DONE.to_json(), variants=[{"variant": "x"}]), _with(DONE.to_json(), variants=[1] * 100),
    _with(DONE.to_json(), variants=[_with(DONE.to_json()["variants"][0], accuracy=float("inf"))]),
    _with(DONE.to_json(), variants=[_with(DONE.to_json()["variants"][0], latency_ms={"cpu": {"x": 1}})]),
    _with(DONE.to_json(), variants=[_with(DONE.to_json()["variants"][0], latency_ms={"cpu": {"1": -1}})]),
    _with(DONE.to_json(), skipped=[3]), _with(DONE.to_json(), error=_deep(5000)),
    _with(DONE.to_json(), tenant=""),
])
def test_a_hostile_state_is_a_protocol_error(value: Any) -> None:
    with pytest.raises(ProtocolError):
        BuildState.from_json(value)


FAILED = RUNNING.but(state="failed", error="no", reason="custom_domain")


@pytest.mark.parametrize(("old", "new", "ok"), [
    (None, RUNNING, True),                         # a claim
    (None, FAILED, True),                          # refused before it ran (an unreadable request)
    (None, DONE, False),                           # nobody finishes a build nobody ran
    (RUNNING, RUNNING.but(progress=0.5), True),
    (RUNNING, DONE, True),
    (RUNNING, FAILED, True),
    (DONE, RUNNING, False),                        # finished is final
    (DONE, FAILED, False),
    (FAILED, DONE, False),
    (RUNNING, DONE.but(tenant="globex"), False),   # the tenant never changes
    (RUNNING, DONE.but(build_id="b" * 32), False),
])
def test_transitions(old: BuildState | None, new: BuildState, ok: bool) -> None:
    assert transition_ok(old, new) is ok


@pytest.mark.parametrize(("old", "now", "ok"), [
    (None, 0.0, True),
    (RUNNING, RUNNING.updated + 10, False),      # its store is at work
    (RUNNING, RUNNING.updated + 601, True),      # its store died: another may take it over
    (DONE, DONE.updated + 10 ** 6, False),
    (FAILED, FAILED.updated + 10 ** 6, False),
])
def test_claimable(old: BuildState | None, now: float, ok: bool) -> None:
    assert claimable(old, now, stale_s=600.0) is ok


def test_status_of_a_queued_and_a_done_build() -> None:
    assert build_status(REQ, None)["state"] == "queued"
    st = build_status(REQ, DONE)
    assert (st["state"], st["progress"], st["variants"][0]["accuracy"]) == ("done", 1.0, 0.95)
    assert st["variants"][0]["latency_ms"] == {"cpu-x86_64": {"1": 0.05, "8": 0.1}}


@pytest.mark.parametrize(("name", "ok"), [("my-digits", True), ("a_b-1", True), ("", False), ("a.b", False),
                                          ("-a", False), ("a/b", False), ("x" * 129, False)])
def test_names(name: str, ok: bool) -> None:
    assert is_name(name) is ok


def _npz(path: Path, **arrays: Any) -> Path:
    np.savez(path, **arrays)
    return path


def test_scan_validation_accepts_labelled_rows(tmp_path: Path) -> None:
    p = _npz(tmp_path / "v.npz", x=np.zeros((20, 64), np.float32), y=np.arange(20) % 10)
    s = scan_validation(p, 1 << 20)
    assert (s.rows, s.x_shape) == (20, (20, 64))


def _bomb(path: Path) -> Path:
    """A compressed NPZ whose x header declares 4 GB (the data is a few bytes): refused from the header alone."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (1 << 20, 1024)})
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("x.npy", header.getvalue() + b"\0" * 64)
        buf = io.BytesIO()
        np.save(buf, np.zeros(1 << 20, np.int64))
        zf.writestr("y.npy", buf.getvalue())
    return path


@pytest.mark.parametrize(("make", "words"), [
    (lambda p: p.write_bytes(b"not a zip") and p, "BadZipFile"),
    (lambda p: _npz(p, x=np.zeros((4, 2))), "needs arrays x and y"),
    (lambda p: _npz(p, x=np.array([{"a": 1}] * 4, dtype=object), y=np.zeros(4, np.int64)), "not numbers"),
    (lambda p: _npz(p, x=np.zeros((4, 2)), y=np.zeros(5, np.int64)), "one label per row"),
    (lambda p: _npz(p, x=np.zeros(4), y=np.zeros(4, np.int64)), "one label per row"),
    (lambda p: _npz(p, x=np.zeros((4, 2)), y=np.zeros(4, np.float32)), "not integer labels"),
    (lambda p: _npz(p, x=np.zeros((1, 2)), y=np.zeros(1, np.int64)), "at least 2"),
    (lambda p: _npz(p, x=np.zeros((4, 2)), y=np.array(["a"] * 4)), "not numbers"),
    (_bomb, "over the limit"),
])
def test_scan_validation_refuses(tmp_path: Path, make: Any, words: str) -> None:
    path = tmp_path / "v.npz"
    make(path)
    with pytest.raises(RequestError) as err:
        scan_validation(path, 64 << 20)
    assert words in str(err.value)


def test_a_site_writes_requests_but_never_a_builds_state() -> None:
    rbac = plan("/tm/", sites=["edge-1"], stores=["vs"], root_admins=["root"])
    site, store = "site:edge-1", "store:vs"
    assert rbac.may(site, "write", "/tm/" + build_key("acme", ID))
    assert not rbac.may(site, "write", "/tm/" + build_state_key(ID))   # no forged "done"
    assert rbac.may(store, "write", "/tm/" + build_state_key(ID))
    assert not rbac.may(store, "write", "/tm/" + build_key("acme", ID))
