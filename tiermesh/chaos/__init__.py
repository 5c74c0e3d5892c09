"""Chaos runs: a real local mesh under a labelled workload while faults are injected on a schedule, then
invariants checked from the workload's own records (see :mod:`tiermesh.chaos.invariants`).

``python -m tiermesh.chaos --profile long --out DIR`` (``make chaos``) runs one and writes the report;
the ``chaos`` tests run the short profile.
"""

from tiermesh.chaos.faults import KINDS, ChaosMesh, Fault
from tiermesh.chaos.invariants import FaultWindow, Verdict, check
from tiermesh.chaos.runner import ChaosResult, Profile, run_chaos

__all__ = ["KINDS", "ChaosMesh", "ChaosResult", "Fault", "FaultWindow", "Profile", "Verdict", "check", "run_chaos"]
