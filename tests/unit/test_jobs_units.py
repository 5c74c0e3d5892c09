"""Offline jobs' pure parts: records decoded as hostile input, chunking, keys, the RBAC grant, the variant and
feasibility policy, the claim rule, input parsers naming the line or row, and the data area's quota and digest
checks."""

from __future__ import annotations

import io
import json
import math
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from core_scheduler.policy.jobs import (
    CLAIM_GRACE_S,
    HARVEST,
    SAFETY,
    Capacity,
    cheapest_variant,
    estimate,
    job_candidates,
    may_claim,
    row_ms,
)
from mesh.errors import PayloadTooLarge, ProtocolError, RequestError
from mesh.etcd.keys import chunk_key, claim_key, job_key
from mesh.etcd.rbac import plan
from mesh.jobspec import ChunkRecord, JobRecord, chunk_rows_of, is_job_id, plan_chunks
from variant_store.data_area import DataArea, may_use_data
from variant_store.jobdata import decode_outputs, encode_outputs, read_rows, scan_input
from variant_store.meta import LatencyStats, Profile, VariantMeta

pytestmark = pytest.mark.unit

JOB = JobRecord(job_id="a" * 32, task="digit-classification", tenant="acme", min_accuracy=0.9, deadline=2e9,
                input_digest="b" * 64, rows=1000, input_format="npz", chunk_rows=256, created=1.7e9, updated=1.7e9)


def test_a_job_record_survives_its_json() -> None:
    assert JobRecord.from_json(json.loads(json.dumps(JOB.to_json()))) == JOB
    assert JOB.chunks == [(0, 256), (256, 512), (512, 768), (768, 1000)]


@pytest.mark.parametrize("patch", [
    {"schema": 2}, {"job_id": "../../etc"}, {"job_id": "A" * 32}, {"rows": True}, {"rows": 0}, {"rows": 2**63},
    {"rows": "1000"}, {"min_accuracy": 1.5}, {"min_accuracy": math.nan}, {"deadline": math.inf},
    {"input_digest": "z" * 64}, {"input_format": "pickle"}, {"state": "exploded"}, {"chunk_rows": 0},
    {"chunk_rows": 1, "rows": 10**9}, {"tenant": "a/b"}, {"task": ""}, {"error": 5}, {"variant": ["x"]},
    {"max_cost": -1}, {"task": None},
])
def test_a_hostile_job_record_is_a_protocol_error(patch: dict[str, Any]) -> None:
    value = {**JOB.to_json(), **patch}
    with pytest.raises(ProtocolError):
        JobRecord.from_json(value)


@pytest.mark.parametrize("value", [None, [], "job", 5, {"schema": 1}, {"schema": 1, "index": -1}])
def test_values_that_are_no_record_at_all(value: Any) -> None:
    with pytest.raises(ProtocolError):
        JobRecord.from_json(value)
    with pytest.raises(ProtocolError):
        ChunkRecord.from_json(value)


def test_chunk_records() -> None:
    c = ChunkRecord(3, 768, 1000)
    assert ChunkRecord.from_json(c.to_json()) == c and c.rows == 232
    done = {**c.to_json(), "state": "done", "site": "edge-1", "output_digest": "c" * 64}
    assert ChunkRecord.from_json(done).output_digest == "c" * 64
    for bad in ({**done, "output_digest": None}, {**done, "site": None}, {**c.to_json(), "stop": 768},
                {**done, "site": "x" * 200}, {**c.to_json(), "state": "running"}):
        with pytest.raises(ProtocolError):
            ChunkRecord.from_json(bad)


@pytest.mark.parametrize(("rows", "size"), [(1, 1), (10, 3), (1000, 256), (4096, 256), (7, 100)])
def test_chunks_cover_every_row_once(rows: int, size: int) -> None:
    chunks = plan_chunks(rows, size)
    covered = [r for a, b in chunks for r in range(a, b)]
    assert covered == list(range(rows)) and all(0 < b - a <= size for a, b in chunks)


def test_chunk_plans_that_make_no_sense() -> None:
    for rows, size in ((0, 1), (5, 0), (10**9, 1)):
        with pytest.raises(ValueError, match=r"rows|chunks"):
            plan_chunks(rows, size)
    assert chunk_rows_of(10) == 256 and chunk_rows_of(10**9) == 65_536 and chunk_rows_of(16_000) == 1000
    assert is_job_id("0" * 32) and not is_job_id("0" * 31) and not is_job_id("g" * 32)


def test_job_keys() -> None:
    assert job_key("a" * 32) == f"jobs/{'a' * 32}/job"
    assert chunk_key("j", 7) == "jobs/j/chunks/000007" and claim_key("j", 7) == "jobs/j/claims/000007"
    for bad in (lambda: job_key("a/b"), lambda: chunk_key("", 1), lambda: claim_key("j", -1)):
        with pytest.raises(ValueError):
            bad()


def test_sites_and_the_scheduler_may_write_jobs_and_nothing_else_new() -> None:
    p = plan("/m/", sites=["edge-1"], schedulers=["s1"], root_admins=["root-admin"], stores=["vs"])
    assert p.may("site:edge-1", "write", "/m/jobs/abc/chunks/000001")
    assert p.may("scheduler:s1", "write", "/m/jobs/abc/job")
    assert not p.may("store:vs", "write", "/m/jobs/abc/job")
    assert not p.may("site:edge-1", "write", "/m/placement/edge-1")
    assert not p.may("tenant:acme", "read", "/m/jobs/abc/job")  # tenants have no etcd user


def _meta(vid: str, acc: float, ms_at_32: float | None, **kw: Any) -> VariantMeta:
    profiles = {} if ms_at_32 is None else {"cpu": Profile("cpu", 40.0, {1: LatencyStats(0.1, 0.2),
                                                                      32: LatencyStats(ms_at_32, ms_at_32)}, 1)}
    return VariantMeta(task="t", family=vid, variant_id=vid, format="onnx", precision="fp32", runtime="onnxruntime",
                       blob_digest="d" * 64, size_bytes=1, accuracy=acc, profiles=profiles, **kw)


def test_the_cheapest_variant_meeting_the_floor() -> None:
    tiny, big, unprofiled = _meta("tiny", 0.96, 0.32), _meta("big", 0.987, 3.2), _meta("wide", 0.99, None)
    metas = [big, tiny, unprofiled]
    assert row_ms(tiny) == pytest.approx(0.01)
    assert cheapest_variant(metas, 0.9) is tiny
    assert cheapest_variant(metas, 0.97) is big  # profiled beats unknown cost
    assert cheapest_variant(metas, 0.989) is unprofiled
    assert cheapest_variant(metas, 0.999) is None
    private = _meta("mine", 0.99, 0.01, owner="acme")
    backbone = _meta("head", 0.99, 0.01, shared_base_digest="e" * 64)
    assert job_candidates([tiny, private, backbone], "acme") == [tiny, private, backbone]
    assert job_candidates([tiny, private, backbone], "globex") == [tiny, backbone]


def test_the_estimate_is_the_cheapest_site_with_its_margin() -> None:
    tiny = _meta("tiny", 0.96, 0.32)
    sites = [Capacity("core", "cpu", 0.5), Capacity("edge", "cpu", 0.1)]
    est = estimate(100_000, 10, tiny, sites)
    assert est is not None and est.site == "edge" and est.sites == ("edge", "core")
    # the deadline both idle sites meet together; the cost of every row on the cheaper (tests/unit/test_jobs_assign.py)
    assert est.seconds == pytest.approx(SAFETY * (100_000 / (2 * HARVEST * 1000 / 0.01) + 10 * 0.25 / 2 + 0.04))
    assert est.cost == pytest.approx(SAFETY * (100_000 * 0.01 / 1000 + 10 * 0.25 + 0.04) * 0.1 / 3600)
    assert estimate(10, 1, _meta("wide", 0.99, None), sites) is None
    assert estimate(10, 1, tiny, []) is None


@pytest.mark.parametrize(("me", "sites", "waited", "ok"), [
    ("edge", [Capacity("edge", None, 0.1), Capacity("core", None, 0.5)], 0.0, True),
    ("core", [Capacity("edge", None, 0.1), Capacity("core", None, 0.5)], 0.0, False),
    ("core", [Capacity("edge", None, 0.1, idle=False), Capacity("core", None, 0.5)], 0.0, True),
    ("core", [Capacity("edge", None, 0.1), Capacity("core", None, 0.5)], CLAIM_GRACE_S, True),
    ("core", [Capacity("edge", None, 0.1), Capacity("core", None, 0.5, idle=False)], CLAIM_GRACE_S, False),
    ("gone", [Capacity("edge", None, 0.1)], 100.0, False),
    ("edge", [Capacity("edge", None, 0.104), Capacity("mid", None, 0.1)], 0.0, True),  # within the slack
])
def test_who_claims(me: str, sites: list[Capacity], waited: float, ok: bool) -> None:
    assert may_claim(me, sites, waited) is ok


def _write(tmp: Path, text: str) -> Path:
    p = tmp / "in.jsonl"
    p.write_text(text)
    return p


@pytest.mark.parametrize(("text", "where"), [
    ("[1, 2]\n[3, 4]\n{oops\n", "line 3"),
    ("[1, 2]\n[3]\n", "line 2: 1 numbers"),
    ("[1, 2]\n\"text\"\n", "line 2: a text row"),
    ("[1, 2]\n\n[3, 4]\n", "line 2: empty"),
    ("[1, NaN]\n", "line 1: a row holds NaN"),
    ("[]\n", "line 1"),
    ("[true]\n", "line 1"),
    ("\n", "no rows"),
    ("[[1]]\n", "line 1"),
    ("[1]\n\xff\n", "line 2"),
])
def test_a_malformed_jsonl_names_its_line(tmp_path: Path, text: str, where: str) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(text.encode("utf-8", errors="surrogateescape") if "\xff" not in text
                     else text.replace("\xff", "").encode() + b"\xff\n")
    with pytest.raises(RequestError, match=where):
        scan_input(path, "jsonl")


def test_jsonl_rows(tmp_path: Path) -> None:
    path = _write(tmp_path, "".join(json.dumps([i, i + 0.5]) + "\n" for i in range(10)))
    s = scan_input(path, "jsonl")
    assert (s.rows, s.kind, s.width) == (10, "numbers", 2)
    assert read_rows(path, "jsonl", 3, 5).tolist() == [[3, 3.5], [4, 4.5]]
    text = _write(tmp_path, '"a"\n"b c"\n')
    assert scan_input(text, "jsonl").kind == "text" and read_rows(text, "jsonl", 1, 2).tolist() == ["b c"]
    with pytest.raises(RequestError, match="past"):
        read_rows(path, "jsonl", 8, 12)


def test_npz_inputs(tmp_path: Path) -> None:
    good = tmp_path / "x.npz"
    np.savez(good, x=np.arange(12, dtype=np.float32).reshape(6, 2))
    assert scan_input(good, "npz").rows == 6 and read_rows(good, "npz", 4, 6).tolist() == [[8, 9], [10, 11]]
    cases = {"no_x": {"y": np.zeros(3)}, "scalar": {"x": np.float32(1)}, "pickled": {"x": np.array([{}], object)},
             "strings": {"x": np.array(["a"])}, "nan": {"x": np.array([[0.0], [np.nan]])}}
    why = {"no_x": "no array 'x'", "scalar": "rows along", "pickled": "readable NPZ|numeric", "strings": "numeric",
           "nan": "row 1"}
    for name, arrays in cases.items():
        p = tmp_path / f"{name}.npz"
        np.savez(p, **arrays)  # type: ignore[arg-type]
        with pytest.raises(RequestError, match=why[name]):
            scan_input(p, "npz")
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"PK\x03\x04 not a zip at all")
    with pytest.raises(RequestError, match="readable NPZ"):
        scan_input(junk, "npz")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("x.npy", b"\x93NUMPY garbage")
    junk.write_bytes(buf.getvalue())
    with pytest.raises(RequestError, match="readable NPZ"):
        scan_input(junk, "npz")


def test_chunk_outputs_round_trip_and_junk_is_refused() -> None:
    out = {"logits": np.arange(20, dtype=np.float32).reshape(2, 10)}
    assert decode_outputs(encode_outputs(out))["logits"].tolist() == out["logits"].tolist()
    with pytest.raises(RequestError):
        decode_outputs(b"not a zip")


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for p in parts:
        yield p


async def test_the_data_area_checks_digests_and_quotas(tmp_path: Path) -> None:
    import hashlib

    area = DataArea(tmp_path, quota_bytes=100, quotas={"big": 1000})
    data = b"x" * 60
    digest = hashlib.sha256(data).hexdigest()
    assert await area.receive("acme", digest, _chunks(data[:30], data[30:])) == (60, True)
    assert await area.receive("acme", digest, _chunks(data)) == (60, False)  # held: not charged twice
    assert area.used("acme") == 60 and area.path("acme", digest).read_bytes() == data
    with pytest.raises(RequestError, match="hashes to"):
        await area.receive("acme", "0" * 64, _chunks(b"y"))
    more = b"z" * 50
    with pytest.raises(PayloadTooLarge, match=r"over quota.*100") as over:
        await area.receive("acme", hashlib.sha256(more).hexdigest(), _chunks(more[:25], more[25:]))
    assert over.value.details["quota_bytes"] == 100
    with pytest.raises(PayloadTooLarge):  # declared up front: refused before a byte is read
        await area.receive("acme", hashlib.sha256(more).hexdigest(), _chunks(), declared=50)
    assert area.used("acme") == 60 and not list((tmp_path / "acme").rglob(".up-*"))
    assert await area.receive("big", hashlib.sha256(more).hexdigest(), _chunks(more)) == (50, True)
    for tenant, dig in (("../x", digest), ("acme", "../../etc/passwd")):
        with pytest.raises(RequestError):
            area.path(tenant, dig)


def test_who_may_use_a_tenants_data() -> None:
    from mesh.pki.identity import Identity

    assert may_use_data(Identity("tenant", "acme"), "acme")
    assert not may_use_data(Identity("tenant", "globex"), "acme")
    assert may_use_data(Identity("site", "edge-1"), "acme")
    assert not may_use_data(Identity("scheduler", "s1"), "acme")
    assert may_use_data(None, "acme")
