"""A site the scheduler leader assigned a chunk of tenant T's job may fetch the job's variant (the rule and the
follower's memory; HTTPS and etcd in tests/integration/test_job_grants_store.py)."""

from __future__ import annotations

from typing import Any

import pytest

from mesh.errors import ProtocolError
from mesh.etcd.keys import JOB_ASSIGN, assign_key
from mesh.etcd.rbac import plan
from mesh.pki.identity import Identity
from variant_store.access import blob_readable, job_granted
from variant_store.job_grants import AssignRecord, JobGrants, _grant, decode_record, split_key
from variant_store.meta import VariantMeta

pytestmark = pytest.mark.unit

J = "0" * 32
NOW = 1.7e9
EDGE, OTHER, TENANT = Identity("site", "edge-1"), Identity("site", "edge-2"), Identity("tenant", "a")
GOOD: dict[str, Any] = {"schema": 1, "site": "edge-1", "since": NOW, "at": NOW, "leader": 7,
                        "tenant": "a", "task": "t", "variant": "v-aaa"}


def _meta(owner: str, digest: str, variant: str, base: str | None = None) -> VariantMeta:
    return VariantMeta(task="t", family="f", variant_id=variant, format="onnx", precision="fp32",
                       runtime="onnxruntime", blob_digest=digest, size_bytes=1, accuracy=0.5, owner=owner,
                       shared_base_digest=base)


METAS = [_meta("a", "aaa", "v-aaa", base="bbb"), _meta("a", "ccc", "v-ccc"), _meta("b", "ddd", "v-ddd"),
         _meta("public", "bbb", "backbone")]


@pytest.mark.parametrize(("identity", "digest", "granted", "ok"), [
    (EDGE, "aaa", {("a", "t", "v-aaa")}, True),      # assigned: the variant's ONNX
    (EDGE, "bbb", {("a", "t", "v-aaa")}, True),      # and its shared backbone
    (EDGE, "ccc", {("a", "t", "v-aaa")}, False),     # not a's other variants: the assigned one only
    (EDGE, "ddd", {("a", "t", "v-ddd")}, False),     # v-ddd is b's: a record naming it for a grants nothing
    (EDGE, "ddd", {("b", "t", "v-aaa")}, False),     # b's job on a's variant: neither
    (EDGE, "aaa", set(), False),                     # no assignment, no placement: refused
    (TENANT, "ddd", {("b", "t", "v-ddd")}, False),   # grants are for sites only
])
def test_an_assignment_grants_exactly_its_variant(identity: Identity, digest: str, granted: set[Any],
                                                  ok: bool) -> None:
    assert blob_readable(identity, digest, METAS, granted=granted) is ok


def test_job_granted_checks_the_catalogs_owner() -> None:
    assert job_granted(EDGE, METAS[0], {("a", "t", "v-aaa")})
    assert not job_granted(EDGE, METAS[0], {("b", "t", "v-aaa")})
    assert not job_granted(Identity("scheduler", "s"), METAS[0], {("a", "t", "v-aaa")})


@pytest.mark.parametrize(("value", "ok"), [
    (GOOD, True),
    ({k: v for k, v in GOOD.items() if k not in ("tenant", "task", "variant")}, True),  # readable, grants nothing
    ({**GOOD, "since": NOW + 5}, True),
    ({k: v for k, v in GOOD.items() if k != "variant"}, False),   # half a grant is not a record
    ({**GOOD, "tenant": "../b"}, False),
    ({**GOOD, "variant": 3}, False),
    ({**GOOD, "task": "x" * 200}, False),
    ({**GOOD, "site": None}, False),
    ({**GOOD, "schema": 2}, False),
    ({**GOOD, "at": float("nan")}, False),
    ({**GOOD, "at": 10**400}, False),
    ([GOOD], False),
    ("junk", False),
])
def test_records_are_decoded_as_hostile(value: Any, ok: bool) -> None:
    if ok:
        rec = decode_record("x", value)
        assert isinstance(rec, AssignRecord) and rec.site == "edge-1" and rec.since <= rec.at
    else:
        with pytest.raises(ProtocolError):
            decode_record("x", value)


def test_keys() -> None:
    assert assign_key(J, 3) == f"{JOB_ASSIGN}{J}/000003" and not assign_key(J).startswith("jobs/")
    assert split_key(assign_key(J, 3)) == (J, 3)
    for bad in (assign_key(J) + "3", f"jobs/{J}/assign/000003", f"{JOB_ASSIGN}{J}", f"{JOB_ASSIGN}/000003",
                assign_key(J) + "00000x"):
        with pytest.raises(ProtocolError):
            split_key(bad)
    assert _grant(assign_key(J, 3), GOOD) == ("edge-1", ("a", "t", "v-aaa"))
    assert _grant(assign_key(J, 3), {**GOOD, "tenant": 1}) is None
    assert _grant("jobassign/x", GOOD) is None


def test_a_removed_assignment_grants_for_the_grace_only() -> None:
    now = [100.0]
    grants = JobGrants(store=None, grace_s=60.0, clock=lambda: now[0])  # type: ignore[arg-type]  # no etcd
    v = ("a", "t", "v-aaa")
    k0, k1 = assign_key(J, 0), assign_key(J, 1)
    grants.record(k0, ("edge-1", v))
    grants.record(k1, ("edge-1", v))
    assert grants.of("edge-1") == {v} and grants.of("edge-2") == frozenset()
    grants.record(k0, None)                     # one chunk claimed: the other still grants it, no grace needed
    assert grants._gone == {} and grants.of("edge-1") == {v}
    now[0] = 110.0
    grants.record(k1, None)                     # the last one claimed at 110: its grace starts
    assert grants.of("edge-1") == {v}
    now[0] = 169.0
    assert grants.of("edge-1") == {v}           # within the grace
    now[0] = 171.0
    assert grants.of("edge-1") == frozenset()   # past it
    assert grants.of("edge-1", {("edge-1", v)}) == {v}  # a fresh read of etcd grants on its own
    grants.record(k1, ("edge-1", v))
    grants.record(k1, ("edge-2", v))            # moved to edge-2: edge-1 gets a grace, edge-2 the right
    assert grants.of("edge-2") == {v} and grants.of("edge-1") == {v}
    now[0] = 500.0
    grants.record(k0, None)                     # long gone: forgotten (bounded)
    assert grants._gone == {} and grants.of("edge-1") == frozenset()


def test_only_the_scheduler_writes_assignments() -> None:
    p = plan("/m/", sites=["edge-1"], schedulers=["s1"], root_admins=["root"])
    key = "/m/" + assign_key(J, 0)
    assert not p.may("site:edge-1", "write", key) and p.may("site:edge-1", "read", key)
    assert p.may("site:edge-1", "write", "/m/jobs/" + J + "/claims/000000")  # claims stay the sites'
    assert p.may("scheduler:s1", "write", key)
