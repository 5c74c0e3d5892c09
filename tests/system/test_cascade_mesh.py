"""Issue 33 on a live mesh (small topology): a digits cascade, calibrated here on the holdout's first half (the
smallest INT8 variant, then the most accurate one, both run as the store built them), registered in etcd where the
catalog keeps cascades, and served through the SDK from an edge, every answer carrying its stages.

Why queries of 32 rows with a 24 ms budget: routing chooses a cascade only when it is the cheapest feasible
candidate. On this machine every digits variant computes one row within the profiles' resolution (0.05 ms), so a
one-row query costs the same on the small variant as on the large one, and the large one alone is cheaper than
a cascade. At 32 rows the large variant computes about 0.35 ms and the small one still 0.05: stage 1 at the edge
plus the escalation share of the large one inwards costs less than the large one anywhere. The budget leaves stage
1 at the edge (stage 1 at the middle, then stage 2 there, takes two round trips: over 24 ms) and stage 2 one round
trip inwards. A batch of rows stage 1 is sure of is answered ``cascade_local`` at the edge; a batch mixing unsure
rows is ``cascade_escalated``, its unsure rows answered inwards and merged in order.

Other cascades of the task (the store may register its own) are removed first, so that every answer is checked
against the thresholds calibrated here."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mesh.client import AsyncClient, InferResult
from mesh.errors import MeshError
from mesh.etcd.keys import cascade_key
from tests.system.conftest import TASK, Holdout, catalog_variants, mesh_running, wait_warm
from variant_store.cascade_meta import CascadeMeta, confidence
from variant_store.meta import VariantMeta

pytestmark = [pytest.mark.system, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

EDGE = "edge-par-1"
LATENCY_MS = 24.0
ROWS = 32
QUERIES = 30


def _logits(meta: VariantMeta, path: Path, x: np.ndarray) -> np.ndarray:
    from variant_store.runtimes import open_runtime

    rt = open_runtime(meta.format, path, intra_op_threads=1)
    rt.load_sync()
    try:
        name, out = rt.input_specs[0].name, rt.output_specs[0].name
        return np.concatenate([np.asarray(rt.infer_sync({name: x[i:i + 256]})[out]) for i in range(0, len(x), 256)])
    finally:
        rt.unload_sync()


@dataclass(frozen=True)
class Calibrated:
    meta: CascadeMeta
    conf: np.ndarray      # stage 1's confidence in each holdout row
    small: np.ndarray     # each stage's logits for each holdout row
    large: np.ndarray


def calibrate(small: VariantMeta, large: VariantMeta, paths: tuple[Path, Path], h: Holdout) -> Calibrated:
    """The lowest threshold whose cascade is within 0.3 points of the large variant on the first half, its accuracy
    and escalation measured on the second half."""
    x, y = np.ascontiguousarray(h.x, dtype=np.float32), h.y
    logits1, logits2 = _logits(small, paths[0], x), _logits(large, paths[1], x)
    conf = confidence("max_softmax", logits1)
    right1, right2 = logits1.argmax(1) == y, logits2.argmax(1) == y
    half = len(y) // 2
    cal, held = slice(0, half), slice(half, None)
    target = float(right2[cal].mean()) - 0.003
    u = np.unique(conf[cal])
    chosen = 1.0
    # midway between neighbouring confidences, so that no row sits on the threshold (served logits may differ in
    # the last bits from these)
    for t in np.concatenate([[0.0], (u[1:] + u[:-1]) / 2]):
        if float(np.where(conf[cal] >= t, right1[cal], right2[cal]).mean()) >= target:
            chosen = float(t)
            break
    acc = float(np.where(conf[held] >= chosen, right1[held], right2[held]).mean())
    esc = float((conf[held] < chosen).mean())
    meta = CascadeMeta(task=TASK, cascade_id="sys-cascade", stages=(small.variant_id, large.variant_id),
                       rule="max_softmax", thresholds=(chosen,), accuracy=acc, escalation=(esc,),
                       target_accuracy=max(0.0, target), calibration_rows=half, heldout_rows=len(y) - half)
    return Calibrated(meta, conf, logits1, logits2)


async def _get(url: str) -> str:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s, s.get(url) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.text()


def batches(c: Calibrated) -> list[tuple[np.ndarray, int]]:
    """(holdout row indices, rows stage 1 is unsure of) for each query: all-sure batches and batches with a quarter
    of unsure rows, alternating."""
    t = c.meta.thresholds[0]
    sure, unsure = np.flatnonzero(c.conf >= t), np.flatnonzero(c.conf < t)
    out: list[tuple[np.ndarray, int]] = []
    for k in range(QUERIES // 2):
        out.append((np.roll(sure, -k * ROWS)[:ROWS], 0))
        mix = np.concatenate([np.roll(sure, -k * ROWS - 7)[:ROWS - ROWS // 4], np.roll(unsure, -k * 3)[:ROWS // 4]])
        out.append((np.random.default_rng(k).permutation(mix), ROWS // 4))
    return out


async def test_digits_cascade_served_from_an_edge(holdout: Holdout) -> None:
    async with mesh_running() as mesh:
        await wait_warm(mesh, holdout.x)
        assert mesh.store is not None and mesh.blobs is not None
        metas = list((await catalog_variants(mesh)).values())
        public = [m for m in metas if m.owner == "public" and m.shared_base_digest is None]
        small = min((m for m in public if m.precision == "int8"), key=lambda m: (m.size_bytes, m.variant_id))
        large = min(public, key=lambda m: (-m.accuracy, m.size_bytes, m.variant_id))
        assert small.variant_id != large.variant_id
        paths = (mesh.blobs.path(small.blob_digest), mesh.blobs.path(large.blob_digest))
        cal = await asyncio.get_running_loop().run_in_executor(None, calibrate, small, large, paths, holdout)
        meta = cal.meta
        assert 0.0 < meta.escalation[0] < 0.6, meta
        await mesh.store.delete_prefix(cascade_key(TASK))
        await mesh.store.put(cascade_key(TASK, meta.cascade_id), meta.to_json())
        tiers = {n: s.tier for n, s in mesh.topology.sites.items()}
        x = np.ascontiguousarray(holdout.x, dtype=np.float32)
        plan = batches(cal)
        answers: list[InferResult | str] = []
        async with AsyncClient(mesh.edge_urls()[EDGE], timeout=10.0) as client:

            async def ask(rows: np.ndarray) -> InferResult | str:
                try:
                    return await client.infer(TASK, x[rows], latency_ms=LATENCY_MS, min_accuracy=meta.accuracy)
                except MeshError as exc:
                    return exc.code

            # until routing has this cascade (not one it held before: its stage 1 answers the rows whose confidence
            # reaches this threshold) and placement its stages, twice in a row (bounded: 120 s)
            deadline, seen, ours = time.monotonic() + 120.0, [], 0
            while time.monotonic() < deadline and ours < 2:
                r = await ask(plan[1][0])
                seen.append(r if isinstance(r, str) else f"{r.reason}@{r.site}")
                ok = isinstance(r, InferResult) and r.reason.startswith("cascade_") and r.stages[0].site == EDGE \
                    and r.stages[0].answered == sum(c >= meta.thresholds[0] for c in r.stages[0].confidence)
                ours = ours + 1 if ok else 0
                await asyncio.sleep(0.3)
            assert ours == 2, f"no answer by this cascade from {EDGE} in 120 s: {seen[-20:]}"
            for rows, _ in plan:
                answers.append(await ask(rows))
            traced = await client.infer(TASK, x[plan[1][0]], latency_ms=LATENCY_MS, min_accuracy=meta.accuracy,
                                        trace=True)
        edge_url = mesh.edge_urls()[EDGE]
        trace = json.loads(await _get(f"{edge_url}/v2/traces/{traced.request_id}"))
        counted = {(s.labels["answered"], s.labels["site"]): s.value
                   for f in text_string_to_metric_families(await _get(f"{edge_url}/metrics"))
                   if f.name == "tiermesh_cascade_queries" for s in f.samples if s.name.endswith("_total")}
        # what each stage answers for exactly the rows it got (a dynamically quantized variant's answer depends on its
        # batch): stage 1 on each query's rows, stage 2 on the rows stage 1 was unsure of, as served
        t = meta.thresholds[0]
        done: list[tuple[InferResult, np.ndarray, np.ndarray, np.ndarray]] = []
        for (rows, _), r in zip(plan, answers, strict=True):
            if isinstance(r, InferResult) and r.reason.startswith("cascade_"):
                conf = np.array(r.stages[0].confidence)
                unsure = rows[conf < t]
                first = await asyncio.to_thread(_logits, small, paths[0], x[rows])
                last = await asyncio.to_thread(_logits, large, paths[1], x[unsure]) if len(unsure) else first[:0]
                done.append((r, conf, first, last))
    # a loaded machine may delay a query at the door past what the cascade needs: routed otherwise, never wrong
    assert len(done) >= 0.7 * len(plan), [a if isinstance(a, str) else (a.reason, a.site) for a in answers]
    reasons = [r.reason for r, *_ in done]
    # the door counted them (local and escalated, at its site) and traced each stage as a record of its own
    assert counted.get(("local", EDGE), 0) >= reasons.count("cascade_local"), counted
    assert counted.get(("escalated", EDGE), 0) >= reasons.count("cascade_escalated"), counted
    choices = [h["choice"] for h in trace["hops"] if h["site"] == EDGE and h["choice"]]
    assert traced.reason.startswith("cascade_"), traced
    stage_records = [(c["reason"], c["site"], c["variant"]) for c in choices if c["reason"].startswith("cascade_")]
    assert stage_records[0] == ("cascade_stage_1", EDGE, small.variant_id), choices
    assert stage_records[-1] == (traced.reason, traced.site, traced.variant), choices
    assert len(stage_records) == len(traced.stages) + 1, choices
    print(f"cascade {meta}: {len(done)}/{len(plan)} answered by it, {reasons.count('cascade_local')} local, "
          f"stage 2 at {sorted({r.stages[1].site for r, *_ in done if len(r.stages) > 1})}")
    assert "cascade_local" in reasons and "cascade_escalated" in reasons, reasons
    for r, conf, one_logits, two_logits in done:
        s1 = r.stages[0]
        sure = conf >= t
        assert (s1.site, s1.variant, s1.rows, s1.answered) == (EDGE, small.variant_id, ROWS, int(sure.sum()))
        np.testing.assert_allclose(conf, confidence("max_softmax", one_logits), atol=1e-4)
        assert s1.total_ms > 0
        want = one_logits.copy()
        want[~sure] = two_logits
        np.testing.assert_allclose(r.output(), want, rtol=1e-4, atol=1e-4)  # merged in the rows' order
        if sure.all():
            assert r.reason == "cascade_local" and r.site == EDGE and len(r.stages) == 1
        else:
            s2 = r.stages[1]
            assert r.reason == "cascade_escalated" and len(r.stages) == 2 and r.site == s2.site
            assert (s2.variant, s2.rows, s2.answered) == (large.variant_id, int((~sure).sum()), int((~sure).sum()))
            assert tiers[s2.site] != "edge", s2
