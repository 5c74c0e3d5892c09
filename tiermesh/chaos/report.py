"""A chaos run's report on disk: ``<stem>.json`` and ``<stem>.png`` (attainment over time, each fault a
shaded span from injection to heal, the target and the recovery bound drawn in). The plot needs
matplotlib (the ``dev`` extra); without it only the JSON is written, and the JSON says so."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["write_report"]


def write_report(report: dict[str, Any], stem: Path) -> list[Path]:
    stem.parent.mkdir(parents=True, exist_ok=True)
    written = []
    png = stem.with_suffix(".png")
    try:
        _plot(report, png)
        report = {**report, "plot": str(png)}
        written.append(png)
    except ImportError as exc:
        report = {**report, "plot": f"not drawn: {exc}"}
    path = stem.with_suffix(".json")
    path.write_text(json.dumps(report, indent=1, default=str))
    written.insert(0, path)
    return written


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    line = [(p["t"], p["attainment"]) for p in report["timeline"] if p["attainment"] is not None]
    bounds = report["bounds"]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    try:
        if line:
            ts, att = zip(*line, strict=True)
            # drawn at each window's end: the point at t is the attainment of the queries sent in the last
            # window_s seconds, so a dip never shows before the fault that caused it
            ax.plot([t + bounds["window_s"] for t in ts], [100 * a for a in att], lw=1.5, color="tab:blue",
                    label=f"SLO attainment of the queries sent in the last {bounds['window_s']:.0f} s")
        ax.axhline(100 * bounds["target_attainment"], color="tab:green", ls="--", lw=1,
                   label=f"target {100 * bounds['target_attainment']:.0f} %")
        for i, f in enumerate(report["faults"]):
            ax.axvspan(f["start_s"], max(f["end_s"], f["start_s"] + 0.2), color="tab:red", alpha=0.15)
            ax.axvline(f["end_s"] + bounds["recovery_bound_s"], color="tab:red", lw=0.5, ls=":")
            ax.text(f["start_s"], 2 + 7 * (i % 4), f"{f['kind']} {f.get('target', '')}".strip(), fontsize=7,
                    rotation=0, color="darkred")
        verdict = "PASS" if report["verdict"]["ok"] and not report["leaks"] else "FAIL"
        ax.set_title(f"tiermesh chaos, profile {report['profile']}: {verdict} "
                     f"({report['queries']} queries; dotted: recovery bound {bounds['recovery_bound_s']} s "
                     f"after each heal)", fontsize=10)
        ax.set_xlabel("seconds into the workload")
        ax.set_ylabel("% of queries within SLO")
        ax.set_ylim(0, 115)
        ax.legend(loc="upper right", fontsize=8, framealpha=0.9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
