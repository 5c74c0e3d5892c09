"""The committed digits backbone and heads as catalog entries, and a ``VariantHost`` whose blob cache
already holds their files (so tests load real ONNX Runtime sessions without a variant store)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from edge_agent.host import VariantHost
from variant_store.meta import VariantMeta

__all__ = ["DIGITS", "head_meta", "model_meta", "seeded_host"]

DIGITS = Path(__file__).resolve().parents[1] / "variant_store" / "models" / "digits"
# never dialled: every blob a test needs is already in the cache, verified by digest
NO_STORE = "http://127.0.0.1:9"
_X = [{"name": "x", "dtype": "float32", "shape": [-1, 64]}]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def head_meta(variant_id: str, file: str = "head-digits.onnx", *, task: str = "digit-classification",
              owner: str = "public") -> VariantMeta:
    """A head on the committed backbone (``file``'s outputs: 10 logits for head-digits, 2 for parity)."""
    path = DIGITS / file
    classes = 10 if "digits" in file else 2
    return VariantMeta(task=task, family=variant_id.split(".")[0], variant_id=variant_id, format="onnx",
                       precision="fp32", runtime="onnxruntime", blob_digest=_digest(path),
                       size_bytes=path.stat().st_size, accuracy=0.95, inputs=_X,
                       outputs=[{"name": "logits", "dtype": "float32", "shape": [-1, classes]}],
                       shared_base_digest=_digest(DIGITS / "backbone.onnx"), owner=owner)


def model_meta(variant_id: str, file: str) -> VariantMeta:
    path = DIGITS / file
    return VariantMeta(task="digit-classification", family=variant_id.split(".")[0], variant_id=variant_id,
                       format="onnx", precision="fp32", runtime="onnxruntime", blob_digest=_digest(path),
                       size_bytes=path.stat().st_size, accuracy=0.95, inputs=_X,
                       outputs=[{"name": "logits", "dtype": "float32", "shape": [-1, 10]}])


def seeded_host(tmp: Path, *, budget: int = 1 << 32, site: str = "edge-test",
                host_cls: type[VariantHost] = VariantHost) -> VariantHost:
    cache = tmp / "blobs"
    cache.mkdir(parents=True, exist_ok=True)
    for f in DIGITS.glob("*.onnx"):
        shutil.copyfile(f, cache / f"{_digest(f)}.onnx")
    host = host_cls(site, cache, hardware_class="cpu", memory_budget_bytes=budget, threads=2)
    host.blobs.store_url = NO_STORE
    return host
