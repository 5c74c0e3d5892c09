"""The on-disk content-addressed blob store: naming, atomic idempotent writes, corruption detection."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from mesh.errors import BlobError
from variant_store.blobs import BlobStore, is_digest, sha256_file

pytestmark = pytest.mark.unit


def _flip_byte(path: Path, offset: int = 0) -> None:
    os.chmod(path, 0o644)  # blobs are stored read-only
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_put_bytes_is_named_by_sha256_and_laid_out_by_prefix(tmp_path: Path) -> None:
    bs = BlobStore(tmp_path)
    data = b"tiermesh" * 1000
    digest = bs.put_bytes(data)
    assert digest == hashlib.sha256(data).hexdigest()
    assert bs.path(digest) == tmp_path / "sha256" / digest[:2] / digest
    assert bs.has(digest) and bs.size(digest) == len(data)
    assert bs.read_bytes(digest) == data
    assert bs.digests() == [digest]


def test_put_file_is_idempotent_and_leaves_no_temp_files(tmp_path: Path) -> None:
    src = tmp_path / "model.onnx"
    src.write_bytes(os.urandom(3 * (1 << 20) + 17))  # several copy chunks, not a multiple of one
    bs = BlobStore(tmp_path / "store")
    d1 = bs.put_file(src)
    mtime = bs.path(d1).stat().st_mtime_ns
    d2 = bs.put_file(src)
    assert d1 == d2 == sha256_file(src)
    assert bs.path(d1).stat().st_mtime_ns == mtime  # second put did not rewrite it
    leftovers = [p.name for p in (tmp_path / "store").rglob("*") if p.is_file() and p.name != d1]
    assert leftovers == []
    bs.verify(d1)


def test_corrupted_blob_is_refused(tmp_path: Path) -> None:
    bs = BlobStore(tmp_path)
    digest = bs.put_bytes(b"0123456789" * 100)
    _flip_byte(bs.path(digest), 500)
    with pytest.raises(BlobError, match=f"digest mismatch: expected {digest} got "):
        bs.verify(digest)
    with pytest.raises(BlobError, match="digest mismatch"):
        bs.read_bytes(digest)


def test_missing_and_malformed_digests(tmp_path: Path) -> None:
    bs = BlobStore(tmp_path)
    absent = hashlib.sha256(b"never stored").hexdigest()
    assert not bs.has(absent)
    with pytest.raises(BlobError, match="not found"):
        bs.verify(absent)
    for bad in ("../../etc/passwd", "ABC", absent.upper(), absent[:-1]):
        assert not is_digest(bad)
        assert not bs.has(bad)
        with pytest.raises(BlobError, match="not a sha256"):
            bs.path(bad)


def test_put_file_of_unreadable_source_is_a_blob_error(tmp_path: Path) -> None:
    with pytest.raises(BlobError, match="cannot read"):
        BlobStore(tmp_path).put_file(tmp_path / "nope.onnx")


@pytest.mark.parametrize(
    ("header", "size", "expected"),
    [
        ("bytes=0-9", 100, (0, 9)),
        ("bytes=90-", 100, (90, 99)),
        ("bytes=-10", 100, (90, 99)),
        ("bytes=-1000", 100, (0, 99)),
        ("bytes=50-5000", 100, (50, 99)),
        ("bytes=100-", 100, None),
        ("bytes=9-3", 100, None),
        ("bytes=-0", 100, None),
        ("bytes=-", 100, None),
        ("bytes=0-1,5-6", 100, None),  # multipart ranges are not served
        ("items=0-1", 100, None),
        ("bytes=0-0", 0, None),
    ],
)
def test_parse_range(header: str, size: int, expected: tuple[int, int] | None) -> None:
    from variant_store.server import _parse_range

    assert _parse_range(header, size) == expected


def test_package_exports_resolve() -> None:
    import variant_store

    for name in variant_store.__all__:
        assert getattr(variant_store, name) is not None, name
    with pytest.raises(AttributeError):
        _ = variant_store.no_such_name
