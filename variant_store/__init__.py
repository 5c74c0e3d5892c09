"""The variant store: catalog in etcd, content-addressed blobs served over HTTP, variant
generation, profiling and accuracy measurement.

Names are imported on first use (PEP 562): a site that only fetches blobs should not pay for
importing ONNX and the quantizers, and submodules such as ``variant_store.meta`` must be
importable without pulling in the rest.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from variant_store.blobs import BlobStore, is_digest, sha256_file
    from variant_store.build import (
        BuildReport,
        Skipped,
        build_task,
        ensure_digits_family,
        register_model,
        reprofile,
        signature_from_onnx,
    )
    from variant_store.build_text import ensure_text_family
    from variant_store.catalog import Catalog, RegisteredModel, signature_from_json, signature_to_json
    from variant_store.fetch import fetch_blob
    from variant_store.meta import LatencyStats, Profile, VariantMeta
    from variant_store.server import TENANT_HEADER, VariantStoreServer, header_identity

__all__ = [
    "TENANT_HEADER",
    "BlobStore",
    "BuildReport",
    "Catalog",
    "LatencyStats",
    "Profile",
    "RegisteredModel",
    "Skipped",
    "VariantMeta",
    "VariantStoreServer",
    "build_task",
    "ensure_digits_family",
    "ensure_text_family",
    "fetch_blob",
    "header_identity",
    "is_digest",
    "register_model",
    "reprofile",
    "sha256_file",
    "signature_from_json",
    "signature_from_onnx",
    "signature_to_json",
]

_WHERE = {
    "blobs": ("BlobStore", "is_digest", "sha256_file"),
    "build": ("BuildReport", "Skipped", "build_task", "ensure_digits_family", "register_model", "reprofile",
              "signature_from_onnx"),
    "build_text": ("ensure_text_family",),
    "catalog": ("Catalog", "RegisteredModel", "signature_from_json", "signature_to_json"),
    "fetch": ("fetch_blob",),
    "meta": ("LatencyStats", "Profile", "VariantMeta"),
    "server": ("TENANT_HEADER", "VariantStoreServer", "header_identity"),
}
_MODULE_OF = {name: mod for mod, names in _WHERE.items() for name in names}


def __getattr__(name: str) -> Any:
    mod = _MODULE_OF.get(name)
    if mod is None:
        raise AttributeError(f"module 'variant_store' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"variant_store.{mod}"), name)
    globals()[name] = value  # later look-ups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
