"""The routing study of ``bench.gpu_routing`` on the committed GPU profile: with the measured GPU at the core,
64-row topic queries are served there within their SLO from every edge; with a CPU core nothing can, and they
are answered best effort. Rows are what decides it: one-row topic queries never need the GPU."""

from __future__ import annotations

import json

import pytest

from bench.gpu_routing import PROFILE_JSON, decisions

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def doc() -> dict[str, object]:
    if not PROFILE_JSON.is_file():
        pytest.skip("no bench/results/gpu_profile.json (python -m bench --only gpu_profile on a GPU host)")
    loaded: dict[str, object] = json.loads(PROFILE_JSON.read_text())
    return loaded


def _pick(rows: list[dict[str, object]], cls: str, n: int) -> list[dict[str, object]]:
    return [r for r in rows if r["class"] == cls and r["rows"] == n]


def test_big_text_batches_go_to_the_gpu_core_and_meet_their_slo(doc: dict[str, object]) -> None:
    gpu, cpu = decisions(doc, gpu_core=True), decisions(doc, gpu_core=False)
    big_gpu, big_cpu = _pick(gpu, "text-topic", 64), _pick(cpu, "text-topic", 64)
    assert len(big_gpu) == 4  # one per edge of examples/topology.yaml
    assert all(r["tier"] == "core" and r["meets_slo"] for r in big_gpu), big_gpu
    assert not any(r["meets_slo"] for r in big_cpu), big_cpu
    # one description at a time: an edge or middle CPU computes it within the SLO, the GPU is not needed
    assert all(r["meets_slo"] and r["tier"] != "core" for r in _pick(gpu, "text-topic", 1))


def test_placement_puts_the_encoder_where_64_rows_meet_the_slo(doc: dict[str, object]) -> None:
    """The mesh as the scheduler places it (floor + demand), not every variant everywhere: with the GPU core,
    64-row topic demand gets the encoder's head loaded there and every edge's 64-row queries meet the SLO.
    Planned as before placement knew rows (one row a demand), the head is nowhere it can answer 64 rows in time
    (the live H200 run's failure): best effort everywhere."""
    from bench.gpu_routing import placed_decisions

    planned = _pick(placed_decisions(doc, gpu_core=True), "text-topic", 64)
    assert planned and all(r["meets_slo"] and r["tier"] == "core" for r in planned)
    blind = _pick(placed_decisions(doc, gpu_core=True, rows_aware=False), "text-topic", 64)
    assert blind and not any(r["meets_slo"] for r in blind)
    # one-row queries and the digits keep meeting their SLOs as placed
    assert all(r["meets_slo"] for r in placed_decisions(doc, gpu_core=True))
