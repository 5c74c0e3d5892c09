"""``mesh.errors.error_from_reply``: an HTTP error reply back into the error the server raised."""

from __future__ import annotations

import json

import pytest

from mesh.errors import MeshError, QuotaExceeded, UnknownTask, error_from_reply

pytestmark = pytest.mark.unit


def _body(code: str, message: str) -> bytes:
    return json.dumps({"code": code, "error": message}).encode()


def test_a_coded_reply_is_the_servers_error() -> None:
    err = error_from_reply(404, _body("unknown_task", "no task 'x'"))
    assert type(err) is UnknownTask and str(err) == "no task 'x'"


@pytest.mark.parametrize(("retry_after_s", "expected"), [(7, 7), (None, QuotaExceeded("x").retry_after_s)])
def test_a_quota_reply_keeps_the_servers_retry_after(retry_after_s: int | None, expected: int) -> None:
    err = error_from_reply(429, _body("quota_exceeded", "over"), retry_after_s)
    assert isinstance(err, QuotaExceeded) and err.retry_after_s == expected


@pytest.mark.parametrize("body", [b"<html>bad gateway</html>", b"\xff\xfe", b'{"code": 5}', b"[]"])
def test_a_body_that_is_not_ours_names_the_status(body: bytes) -> None:
    err = error_from_reply(502, body)
    assert type(err) is MeshError and str(err).startswith("HTTP 502:")
