"""The short chaos profile (``tiermesh.chaos.profiles.SHORT``): a real local mesh on the small topology
under the labelled workload while agents, the scheduler leader and etcd are killed or stopped, a link
black-holed, a site slowed and the edge flooded past its caps; every invariant of
:mod:`tiermesh.chaos.invariants` must hold and nothing may leak. ``make chaos`` runs the long profile.
With ``TIERMESH_CHAOS_OUT=DIR`` the report (JSON + plot) is written there too."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tiermesh.chaos.profiles import SHORT, SMALL_TOPOLOGY
from tiermesh.chaos.runner import run_chaos

pytestmark = [pytest.mark.chaos, pytest.mark.system, pytest.mark.slow, pytest.mark.timeout(420)]


async def test_short_chaos_profile_keeps_every_invariant(tmp_path: Path) -> None:
    out = Path(os.environ.get("TIERMESH_CHAOS_OUT", tmp_path / "report"))
    res = await run_chaos(SHORT, topology=SMALL_TOPOLOGY, out_dir=out)
    rep = res.report
    print(json.dumps({"verdict": rep["verdict"], "leaks": rep["leaks"], "errors": rep["errors"],
                      "faults": [(f["kind"], f["target"], f["start_s"], f["end_s"]) for f in rep["faults"]]},
                     indent=1))
    assert len(rep["faults"]) == len(SHORT.faults)
    assert rep["queries"] >= 0.8 * SHORT.qps * SHORT.duration_s
    assert res.verdict.ok, rep["verdict"]
    assert not res.leaks, res.leaks
    assert (out / "chaos-short.json").is_file() and (out / "chaos-short.png").is_file()
