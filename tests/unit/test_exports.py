"""The public surface is explicit: everything in ``mesh.__all__`` exists, and every public error is exported."""

import pytest

import mesh
from mesh import errors

pytestmark = pytest.mark.unit


def test_all_names_exist() -> None:
    for name in mesh.__all__:
        assert hasattr(mesh, name), name


def test_request_facing_errors_exported() -> None:
    caller_errors = {n for n in errors.__all__ if n not in {
        "error_from_code", "ConfigError", "TopologyError", "StoreError", "StoreUnavailable", "ConflictError",
        "EtcdServerError", "CatalogError", "BlobError", "VariantBuildError", "RuntimeLoadError", "ProtocolError"}}
    assert caller_errors <= set(mesh.__all__)
