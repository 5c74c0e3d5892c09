"""What a serving process's own Python costs a backbone's batches on two cores (a diagnostic, not a scenario).

``python -m bench.backbone_contention [--write]`` times the shared_backbone scenario's backbone
(``bench.wide_backbone``) as bare ONNX Runtime runs, batches back to back for ``SECONDS`` per cell, two ways:

* ``one batch, 2 threads``: one batch at a time on two intra-op threads (how a site runs a shared backbone);
* ``two batches, 1 thread each``: two threads each running their own batch on one intra-op thread (how the
  scenario's copies run: one session per thread);

each alone and beside a Python thread that holds the interpreter for ``BUSY`` of one core in 1 ms slices (about
what the event loop of the scenario's process spends answering ~15 k requests/s). Rows/s per batch size, and a
batch's median time; JSON on stdout (``--write``: also ``bench/results/backbone_contention.json``).

What it shows on this 2-core machine (see README): a batch split over two threads waits at every operator for
the slower half, so a busy event loop on one core slows it far more than its share of the CPU; two batches on
one thread each lose only that share, but each batch then takes twice as long.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import git_commit
from bench.wide_backbone import build_models
from variant_store.runtimes import open_runtime

__all__ = ["BATCHES", "BUSY", "measure"]

BATCHES = (32, 64, 128)
BUSY = 0.3  # of one core, in 1 ms slices, holding the GIL
SECONDS = 2.0


def _busy_python(until: float, share: float) -> None:
    while time.perf_counter() < until:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < share * 0.001:
            pass
        time.sleep((1.0 - share) * 0.001)


def _cell(path: Path, threads: int, batches_at_once: int, batch: int, busy: float) -> dict[str, float]:
    rt = open_runtime("onnx", path, intra_op_threads=threads)
    rt.load_sync()
    feed = {rt.input_specs[0].name: np.zeros((batch, rt.input_specs[0].shape[1]), np.float32)}
    try:
        rt.run_checked_sync(feed)  # warm: arenas
        until = time.perf_counter() + SECONDS
        rows = [0] * batches_at_once
        took: list[float] = []

        def worker(k: int) -> None:
            while time.perf_counter() < until:
                t0 = time.perf_counter()
                rt.run_checked_sync(feed)
                took.append(time.perf_counter() - t0)
                rows[k] += batch

        pool = [threading.Thread(target=worker, args=(k,)) for k in range(batches_at_once)]
        if busy:
            pool.append(threading.Thread(target=_busy_python, args=(until, busy)))
        t0 = time.perf_counter()
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        return {"rows_per_s": round(sum(rows) / (time.perf_counter() - t0), 1),
                "batch_p50_ms": round(float(np.median(took)) * 1000.0, 2)}
    finally:
        rt.unload_sync()


def measure() -> dict[str, Any]:
    path = Path(build_models()["root"]) / "backbone.onnx"
    ways = {"one batch, 2 threads": (2, 1), "two batches, 1 thread each": (1, 2)}
    out: dict[str, Any] = {"command": "python -m bench.backbone_contention", "git_commit": git_commit(),
                           "busy_share_of_a_core": BUSY, "seconds_per_cell": SECONDS, "cells": []}
    for batch in BATCHES:
        for way, (threads, at_once) in ways.items():
            for busy in (0.0, BUSY):
                out["cells"].append({"batch": batch, "way": way, "busy_python": busy,
                                     **_cell(path, threads, at_once, batch, busy)})
    return out


if __name__ == "__main__":
    text = json.dumps(measure(), indent=1)
    print(text)
    if "--write" in sys.argv:  # kept beside the scenarios' results, for the README's account of what bounds them
        (Path(__file__).parent / "results" / "backbone_contention.json").write_text(text + "\n")
