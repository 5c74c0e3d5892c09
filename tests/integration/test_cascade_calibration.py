"""Issue 33, the store's half: a cascade of the digits family calibrated on real ONNX Runtime sessions, registered
in a real etcd, read back through the catalog and a MeshView (and its snapshot), and removed with its variant."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from core_scheduler.state.view import MeshView
from mesh.errors import CascadeRefused
from mesh.etcd.keys import cascade_key
from mesh.etcd.store import Store
from variant_store.blobs import BlobStore
from variant_store.build import ensure_digits_family, load_validation
from variant_store.cascade import calibrate, digits_default_stages, register_cascade
from variant_store.catalog import Catalog
from variant_store.catalog_remove import apply_removal, plan_removal

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TASK = "digit-classification"
KINDS = ["onnx.fp32", "onnx.int8-static"]


async def _wait(cond: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10.0
    while not cond():
        assert time.monotonic() < deadline, "the view did not follow in time"
        await asyncio.sleep(0.05)


async def test_digits_cascade_calibrated_registered_and_followed(store: Store, tmp_path: Path) -> None:
    catalog, blobs = Catalog(store), BlobStore(tmp_path / "blobs")
    await ensure_digits_family(catalog, blobs, repeats=2, progress=False, kinds=KINDS)
    variants = await catalog.list_variants(TASK)
    stages = digits_default_stages(variants)
    assert stages is not None
    small, large = (next(v for v in variants if v.variant_id == s) for s in stages)
    assert small.precision == "int8" and large.accuracy == max(v.accuracy for v in variants if v.owner == "public")

    # the family's build registered its built-in cascade
    built = await catalog.cascades(TASK)
    assert [c.stages for c in built] == [stages]
    meta = built[0]
    cal = await calibrate(catalog, blobs, TASK, stages, load_rows=load_validation)
    assert cal.meta.thresholds == meta.thresholds  # seeded split: the same figures every time
    large_heldout = cal.stage_accuracy[-1]
    assert meta.accuracy >= large_heldout - 0.003 - 1.0 / meta.heldout_rows  # 0.3 points, one row of slack
    assert meta.accuracy > cal.stage_accuracy[0] or cal.stage_accuracy[0] >= large_heldout
    assert 0.0 < meta.escalation[0] < 0.5  # most rows are answered by the small variant
    assert meta.calibration_rows + meta.heldout_rows == 519
    assert cal.seconds < 5.0

    # an unreachable target is refused, nothing written
    with pytest.raises(CascadeRefused) as exc:
        await register_cascade(catalog, blobs, TASK, stages, load_rows=load_validation, target_accuracy=1.0,
                               cascade_id="too-good")
    assert exc.value.reason == "unreachable"
    assert await store.get(cascade_key(TASK, "too-good")) is None
    # stages of another task, or a stage twice
    with pytest.raises(CascadeRefused):
        await calibrate(catalog, blobs, TASK, (stages[0], "head-parity.onnx.fp32"), load_rows=load_validation)
    with pytest.raises(CascadeRefused):
        await calibrate(catalog, blobs, "digit-parity", ("head-parity.onnx.fp32", stages[1]),
                        load_rows=load_validation)

    # the mesh's view follows cascades/ like the catalog, hostile entries refused
    view = MeshView(store, "test")
    await view.start()
    try:
        await _wait(lambda: meta.cascade_id in view.cascades.get(TASK, {}))
        assert view.cascades[TASK][meta.cascade_id] == meta
        await store.put(cascade_key(TASK, "junk"), {"task": TASK, "cascade_id": "junk", "stages": "nope"})
        await _wait(lambda: cascade_key(TASK, "junk") in view.rejected)
        assert "junk" not in view.cascades[TASK]
        reading = await catalog.read_cascades(TASK)
        assert [b.name for b in reading.broken] == ["junk"] and len(reading.cascades) == 1

        # removing the small variant removes the cascade that chains it
        plan = await plan_removal(catalog, TASK, variant=stages[0])
        assert cascade_key(TASK, meta.cascade_id) in plan.keys
        await apply_removal(catalog, plan)
        await _wait(lambda: meta.cascade_id not in view.cascades.get(TASK, {}))
        assert await catalog.cascades(TASK) == []
        plan = await plan_removal(catalog, TASK, cascade="junk")
        assert plan.keys == [cascade_key(TASK, "junk")]
        await apply_removal(catalog, plan)
        await _wait(lambda: cascade_key(TASK, "junk") not in view.rejected)
    finally:
        await view.stop()
