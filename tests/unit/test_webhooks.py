"""Job notification webhooks, the pure parts: which notify URLs a tenant's allow-list admits (``mesh.webhooks``),
the record of a delivery read back as hostile, the job record's ``notify`` field, and the notifier's decisions
(``core_scheduler.job_notify``: which jobs are due, which statuses are retried, the body)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from core_scheduler.job_notify import due, payload, retryable
from core_scheduler.state.jobs import JobView, SeenChunk
from mesh.errors import ProtocolError
from mesh.jobspec import ChunkRecord, JobRecord
from mesh.webhooks import NotifyOutcome, allowed_target, parse_prefix, parse_target

pytestmark = pytest.mark.unit

PREFIXES = ["https://hooks.acme.example:8443/tiermesh/", "https://ops.acme.example/jobs", "https://[::1]:9000/h/"]

# notify URL -> the canonical URL admitted, or a fragment of the refusal
ALLOW: list[tuple[Any, str]] = [
    ("https://hooks.acme.example:8443/tiermesh/done", "https://hooks.acme.example:8443/tiermesh/done"),
    ("HTTPS://Hooks.ACME.example:8443/tiermesh/a/b?job=1", "https://hooks.acme.example:8443/tiermesh/a/b?job=1"),
    ("https://hooks.acme.example:8443/tiermesh/", "https://hooks.acme.example:8443/tiermesh/"),
    ("https://ops.acme.example:443/jobs", "https://ops.acme.example/jobs"),  # the default port, written out
    ("https://ops.acme.example/jobs/x", "https://ops.acme.example/jobs/x"),
    ("https://[0:0::1]:9000/h/x", "https://[::1]:9000/h/x"),
    ("https://ops.acme.example/jobs-evil", "not under a webhook prefix"),   # a segment boundary, not a string prefix
    ("https://ops.acme.example/job", "not under a webhook prefix"),
    ("https://hooks.acme.example/tiermesh/x", "not under a webhook prefix"),  # another port (443)
    ("https://hooks.acme.example:8444/tiermesh/x", "not under a webhook prefix"),
    ("https://evil.example:8443/tiermesh/x", "not under a webhook prefix"),
    ("https://hooks.acme.example.evil.example:8443/tiermesh/x", "not under a webhook prefix"),
    ("https://hooks.acme.example:8443/tiermeshx", "not under a webhook prefix"),
    ("http://hooks.acme.example:8443/tiermesh/x", "must be an https:// URL"),
    ("ftp://hooks.acme.example/tiermesh/", "must be an https:// URL"),
    ("//hooks.acme.example:8443/tiermesh/x", "must be an https:// URL"),
    ("https://hooks.acme.example:8443/tiermesh/../admin", "'..' segment"),
    ("https://hooks.acme.example:8443/tiermesh/./x", "'..' segment"),
    ("https://hooks.acme.example:8443/tiermesh/%2e%2e/admin", "encoded '.'"),
    ("https://hooks.acme.example:8443/tiermesh/..%2Fadmin", "encoded '/'"),
    ("https://hooks.acme.example:8443/tiermesh/%5c..%5cadmin", "encoded '\\\\'"),
    ("https://hooks.acme.example:8443/tiermesh/%00", "encoded '\\x00'"),
    ("https://hooks.acme.example:8443/tiermesh/%zz", "malformed percent-escape"),
    ("https://hooks.acme.example:8443/tiermesh//x", "empty segment"),
    ("https://hooks.acme.example:8443/tiermesh/\\..\\x", "backslash"),
    ("https://user:pw@hooks.acme.example:8443/tiermesh/x", "user name or password"),
    ("https://hooks.acme.example:8443@evil.example/tiermesh/x", "user name or password"),
    ("https://hooks.acme.example:8443/tiermesh/x#frag", "fragment"),
    ("https://hooks.acme.example:8443/tiermesh/ x", "without spaces"),
    ("https://hooks.acme.example:8443/tiermesh/\nx", "without spaces"),
    ("https://hooks.acme.example:8443/tiermesh/\u00e9", "printable ASCII"),
    ("https://hooks.acme.example:99999/tiermesh/x", "outside 1..65535"),
    ("https://hooks.acme.example:/tiermesh/x", "malformed host or port"),
    ("https://hooks.acme.example.:8443/tiermesh/x", "not a DNS name"),
    ("https://[fe80::1%25eth0]:9000/h/", "'%'"),
    ("https://127.1/h", "not an IPv4 address"),
    ("https:///tiermesh/", "names no host"),
    ("https://hooks.acme.example:8443/" + "a" * 2100, "1 to 2048 characters"),
    ("", "1 to 2048 characters"),
    (None, "a string"),
    (["https://ops.acme.example/jobs"], "a string"),
]


@pytest.mark.parametrize(("url", "want"), ALLOW)
def test_a_notify_url_is_admitted_only_under_an_allowed_prefix(url: Any, want: str) -> None:
    if want.startswith("https://"):
        assert allowed_target(url, PREFIXES, "acme").text == want
    else:
        with pytest.raises(ValueError) as exc:
            allowed_target(url, PREFIXES, "acme")
        assert want in str(exc.value)


def test_no_allowed_prefix_admits_nothing_and_a_broken_one_admits_nothing() -> None:
    with pytest.raises(ValueError, match="no webhook destinations allowed"):
        allowed_target("https://ops.acme.example/jobs", [], "acme")
    with pytest.raises(ValueError, match="no webhook destinations allowed"):  # as if etcd held a bad one
        allowed_target("https://ops.acme.example/jobs", ["http://ops.acme.example/jobs"], "acme")


@pytest.mark.parametrize(("prefix", "want"), [
    ("https://Hooks.Example/", "https://hooks.example/"),
    ("https://hooks.example", "https://hooks.example/"),
    ("https://10.0.0.7:8443/a/b/", "https://10.0.0.7:8443/a/b/"),
    ("https://hooks.example/a?x=1", "may not hold a query"),
    ("https://hooks.example/a/../b/", "'..' segment"),
    ("http://hooks.example/", "https://"),
])
def test_a_prefix_is_canonical_or_refused(prefix: str, want: str) -> None:
    if want.startswith("https://hooks") or want.startswith("https://10"):
        assert parse_prefix(prefix).text == want
    else:
        with pytest.raises(ValueError, match=want.replace("?", r"\?").replace(".", r"\.")):
            parse_prefix(prefix)


def test_the_canonical_text_parses_to_itself() -> None:
    for _url, want in ALLOW:
        if want.startswith("https://"):
            assert parse_target(want).text == want


JOB = JobRecord(job_id="b" * 32, task="digit-classification", tenant="acme", min_accuracy=0.9, deadline=2e9,
                input_digest="c" * 64, rows=1000, input_format="npz", chunk_rows=400, state="done", created=1e9,
                updated=1e9 + 5, notify="https://ops.acme.example/jobs/1")


def test_a_job_record_keeps_its_notify_url_and_refuses_a_hostile_one() -> None:
    assert JobRecord.from_json(json.loads(json.dumps(JOB.to_json()))) == JOB
    old = JOB.to_json()
    del old["notify"]  # a record written before the field existed
    assert JobRecord.from_json(old).notify is None
    for bad in ("http://ops.acme.example/jobs", "https://a@b/", 7, ["x"], "https://x/%2f", "https://x/" + "a" * 3000):
        with pytest.raises(ProtocolError, match="'notify'"):
            JobRecord.from_json({**JOB.to_json(), "notify": bad})


@pytest.mark.parametrize("value", [
    None, [], "x", {"schema": 2, "state": "delivered", "attempts": 1, "at": 1.0},
    {"schema": 1, "state": "sent", "attempts": 1, "at": 1.0},
    {"schema": 1, "state": "failed", "attempts": True, "at": 1.0},
    {"schema": 1, "state": "failed", "attempts": -1, "at": 1.0},
    {"schema": 1, "state": "failed", "attempts": 1, "at": float("inf")},
    {"schema": 1, "state": "failed", "attempts": 1, "at": 1.0, "status": 10**20},
    {"schema": 1, "state": "failed", "attempts": 1, "at": 1.0, "error": ["x"]},
])
def test_a_hostile_notify_record_is_a_protocol_error(value: Any) -> None:
    with pytest.raises(ProtocolError):
        NotifyOutcome.from_json(value)


def test_a_notify_record_round_trips() -> None:
    o = NotifyOutcome("failed", 4, 1e9, 503, "the receiver answered HTTP 503")
    assert NotifyOutcome.from_json(json.loads(json.dumps(o.to_json()))) == o


def _job(i: int, state: str, notify: str | None = "https://ops.acme.example/jobs", updated: float = 0.0) -> JobRecord:
    return JobRecord(job_id=f"{i:032x}", task="t", tenant="acme", min_accuracy=0.0, deadline=2e9,
                     input_digest="c" * 64, rows=10, input_format="npz", chunk_rows=10, state=state,  # type: ignore[arg-type]
                     updated=updated, notify=notify)


def test_due_is_every_ended_job_with_a_url_not_settled_nor_busy_oldest_first() -> None:
    jobs = [_job(1, "done", updated=30), _job(2, "failed", updated=10), _job(3, "cancelled", updated=20),
            _job(4, "running"), _job(5, "queued"), _job(6, "done", notify=None), _job(7, "done"), _job(8, "done")]
    assert [j.job_id[-1] for j in due(jobs, settled={f"{7:032x}"}, busy={f"{8:032x}"})] == ["2", "3", "1"]
    assert due(jobs, settled={j.job_id for j in jobs}, busy=()) == []


@pytest.mark.parametrize(("status", "again"), [(200, False), (301, False), (400, False), (404, False),
                                               (408, True), (425, True), (429, True), (500, True), (503, True)])
def test_which_statuses_are_tried_again(status: int, again: bool) -> None:
    assert retryable(status) is again


def test_the_body_says_what_the_job_became_and_where_its_result_is() -> None:
    chunks = (SeenChunk(ChunkRecord(0, 0, 400, "done", "edge-a", "d" * 64, "v"), 1, None),
              SeenChunk(ChunkRecord(1, 400, 800, "done", "edge-a", "d" * 64, "v"), 1, None),
              SeenChunk(ChunkRecord(2, 800, 1000, "done", "edge-a", "d" * 64, "v"), 1, None))
    body = payload(JobView(JOB, 1, chunks))
    assert body == {"schema": 1, "event": "job.ended", "id": JOB.job_id, "task": JOB.task, "tenant": "acme",
                    "state": "done", "rows": 1000, "rows_done": 1000, "error": "", "ended_at": JOB.updated,
                    "result": f"/v2/models/{JOB.task}/jobs/{JOB.job_id}/result"}
    failed = JobView(JOB.with_state("failed", 2e9, "boom"), 1, chunks[:1])
    assert payload(failed)["result"] is None and payload(failed)["rows_done"] == 400
    assert payload(failed)["error"] == "boom"
    assert JobView(JOB, 1, chunks).to_json()["notify_status"] == "pending"
    assert JobView(JOB, 1, chunks, notifying=True).to_json()["notify_status"] == "sending"
    st = JobView(JOB, 1, chunks, NotifyOutcome("failed", 3, 1.0, 0, "refused")).to_json()
    assert (st["notify_status"], st["notify_error"], st["notify"]) == ("failed", "refused", JOB.notify)
