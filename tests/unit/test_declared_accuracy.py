"""A task's declared accuracy bar (issue 34, "model owners"): the door's check of ``min_accuracy``, the build request
and state that carry it and the outcome, the version record that keeps it (records written before it still decode),
and the rule that moves traffic by it, as tables."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from mesh.buildspec import BuildRequest, BuildState, build_status, declared_accuracy
from mesh.errors import ProtocolError, RequestError
from variant_store.versions import VersionInfo, VersionRecord, move_verdict, required_accuracy

pytestmark = pytest.mark.unit

ID = "a" * 32
REQ = BuildRequest(build_id=ID, tenant="acme", task="my-digits", family="logreg", model_digest="b" * 64,
                   model_bytes=100, validation_digest="c" * 64, validation_bytes=200, rows=450, door="edge-1",
                   created=1.7e9)
DONE = BuildState(ID, "acme", "done", stage="done", progress=1.0, worker="store:1", started=1.7e9, updated=1.7e9)


@pytest.mark.parametrize(("raw", "want"), [(None, None), ("0.95", 0.95), ("0", 0.0), ("1", 1.0), ("1e-1", 0.1)])
def test_the_door_reads_a_declared_bar(raw: str | None, want: float | None) -> None:
    assert declared_accuracy(raw) == want


@pytest.mark.parametrize("raw", ["1.5", "-0.1", "nan", "inf", "-inf", "abc", "", "0.9x", "1e400", "9" * 500])
def test_the_door_refuses_a_bar_outside_zero_one(raw: str) -> None:
    with pytest.raises(RequestError, match="min_accuracy must be a number in \\[0, 1\\]"):
        declared_accuracy(raw)


def test_a_request_carries_the_bar_and_one_without_it_still_decodes() -> None:
    declared = replace(REQ, min_accuracy=0.95)
    assert BuildRequest.from_json(declared.to_json()) == declared
    assert declared.to_json()["min_accuracy"] == 0.95
    assert "min_accuracy" not in REQ.to_json()  # undeclared: written as before the field
    assert BuildRequest.from_json(REQ.to_json()).min_accuracy is None
    assert BuildRequest.from_json({**REQ.to_json(), "min_accuracy": None}).min_accuracy is None


@pytest.mark.parametrize("bad", [1.5, -0.1, True, "0.9", float("nan"), float("inf"), 10 ** 400, [0.9], {"a": 1}])
def test_a_hostile_bar_in_a_request_is_a_protocol_error(bad: Any) -> None:
    with pytest.raises(ProtocolError):
        BuildRequest.from_json({**REQ.to_json(), "min_accuracy": bad})


def test_a_done_state_carries_the_version_outcome_and_an_older_one_still_decodes() -> None:
    held = DONE.but(version=2, version_state="held", version_note="best 0.91 < declared 0.95")
    assert BuildState.from_json(held.to_json()) == held
    old = {k: v for k, v in held.to_json().items() if k not in ("version", "version_state", "version_note")}
    assert BuildState.from_json(old) == DONE
    st = build_status(replace(REQ, min_accuracy=0.95), held)
    assert st["min_accuracy"] == 0.95
    assert (st["version"], st["version_state"], st["version_note"]) == (2, "held", "best 0.91 < declared 0.95")
    queued = build_status(REQ, None)
    assert (queued["version"], queued["version_state"], queued["min_accuracy"]) == (None, "", None)


@pytest.mark.parametrize("change", [{"version_state": "retired"}, {"version_state": 3}, {"version": True},
                                   {"version": -1}, {"version": "2"}, {"version_note": ["x"]}])
def test_a_hostile_version_outcome_is_a_protocol_error(change: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError):
        BuildState.from_json({**DONE.to_json(), **change})


def _rec(active: int = 0, bar: float | None = None, **accs: float) -> VersionRecord:
    versions = {int(k[1:]): VersionInfo(f"fam{k[1:]}", "active" if int(k[1:]) == active else "held", a)
                for k, a in accs.items()}
    return VersionRecord("t", "acme", active, versions, min_accuracy=bar)


# (record, required)
REQUIRED = [
    (None, 0.0),
    (_rec(), 0.0),                                  # nothing active, nothing declared: a first version moves
    (_rec(1, None, v1=0.93), 0.93),                 # today's rule: the active version's best
    (_rec(1, 0.95, v1=0.93), 0.95),                 # a declared bar wins over the active version's
    (_rec(1, 0.5, v1=0.93), 0.5),                   # ... also when it is lower
    (_rec(0, 0.95), 0.95),                          # ... and when nothing is active yet
    (_rec(1, 0.0, v1=0.93), 0.0),                   # a declared 0 is a bar, not "undeclared"
]


@pytest.mark.parametrize(("rec", "want"), REQUIRED)
def test_required_accuracy(rec: VersionRecord | None, want: float) -> None:
    assert required_accuracy(rec) == want


# (record, version built, its best, moves, note)
VERDICTS = [
    (_rec(0, None, v1=0.0), 1, 0.4, True, "best 0.4: the task's first version"),
    (_rec(0, 0.95, v1=0.0), 1, 0.91, False, "best 0.91 < declared 0.95"),     # a first version too
    (_rec(0, 0.95, v1=0.0), 1, 0.97, True, "best 0.97 >= declared 0.95"),
    (_rec(1, 0.95, v1=0.97, v2=0.0), 2, 0.91, False, "best 0.91 < declared 0.95"),
    (_rec(1, 0.95, v1=0.97, v2=0.0), 2, 0.96, True, "best 0.96 >= declared 0.95"),  # below v1, above the bar
    (_rec(1, 0.95, v1=0.9, v2=0.0), 2, 0.95 - 1e-12, True, "best 0.95 >= declared 0.95"),  # float rounding
    (_rec(1, None, v1=0.93, v2=0.0), 2, 0.91, False, "best 0.91 < version 1's 0.93"),
    (_rec(1, None, v1=0.93, v2=0.0), 2, 0.93, True, "best 0.93 >= version 1's 0.93"),
]


@pytest.mark.parametrize(("rec", "version", "best", "moves", "note"), VERDICTS)
def test_move_verdict(rec: VersionRecord, version: int, best: float, moves: bool, note: str) -> None:
    assert move_verdict(rec, version, best) == (moves, note)


def test_a_version_record_keeps_the_bar_and_notes_and_an_older_one_still_decodes() -> None:
    rec = _rec(1, 0.95, v1=0.97).with_version(2, VersionInfo("fam2", "held", 0.91, note="best 0.91 < declared 0.95"))
    assert VersionRecord.from_json(rec.to_json()) == rec
    summary = rec.to_summary()
    assert summary["min_accuracy"] == 0.95 and summary["versions"][1]["note"] == "best 0.91 < declared 0.95"
    old = _rec(1, None, v1=0.97).to_json()
    assert "min_accuracy" not in old and all("note" not in v for v in old["versions"].values())
    decoded = VersionRecord.from_json(old)
    assert decoded.min_accuracy is None and decoded.versions[1].note == ""
    assert required_accuracy(decoded) == 0.97


@pytest.mark.parametrize("change", [{"min_accuracy": 1.5}, {"min_accuracy": -0.1}, {"min_accuracy": True},
                                    {"min_accuracy": "0.9"}, {"min_accuracy": float("nan")},
                                    {"versions": {"1": {"family": "f", "state": "held", "note": 5}}}])
def test_a_hostile_bar_in_a_version_record_is_refused(change: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        VersionRecord.from_json({**_rec(1, 0.9, v1=0.97).to_json(), **change})
