"""A load generator in a process of its own: open-loop Poisson arrivals (or a closed loop) of pre-encoded
HTTP requests, bounded in count, time and requests in flight.

A generator that shares the event loop (or the interpreter) of what it measures saturates first on a fast
machine and then measures itself: the batching benchmark once "offered" 96k req/s and sent 13k. Here the
generator runs as ``python -m bench.loadgen`` (the spec as JSON on stdin, the result as JSON on stdout),
and says what it really offered: ``achieved_rps`` is the arrival rate it kept (requests sent over the time
it took to send them), ``lag_p99_ms`` how late sends were against their schedule, and ``valid`` is False
when it kept less than :data:`VALID_SHARE` of the offered rate, so a cell it could not load is marked, not
reported as the system's result. Latency runs from each request's *scheduled* arrival (no coordinated
omission). :func:`run_load` is the parent's side: it starts the process, feeds it and always reaps it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["VALID_SHARE", "LoadSpec", "run_load"]

_REPO = Path(__file__).resolve().parents[1]  # the generator runs `python -m bench.loadgen` from here
VALID_SHARE = 0.95   # a cell is valid when the generator kept at least this share of the offered rate


@dataclass(slots=True)
class LoadSpec:
    """What to offer. ``bodies``: request bodies sent in turn (round robin); ``headers`` go with each.
    ``mode``: ``open`` (Poisson at ``rate``/s) or ``closed`` (``concurrency`` callers back to back)."""

    url: str
    bodies: list[bytes]
    headers: dict[str, str]
    n: int
    mode: str = "open"
    rate: float = 100.0
    concurrency: int = 16
    seed: int = 0
    slo_s: float = 1.0               # a reply later than this after its scheduled arrival is 'late'
    time_cap_s: float = 60.0         # sending stops after this
    max_inflight: int = 2048         # open loop: arrivals beyond this many outstanding are not sent
    extra: dict[str, Any] = field(default_factory=dict)  # copied into the result (labels)
    body_headers: list[dict[str, str]] | None = None     # per body, added to ``headers``

    def to_json(self) -> str:
        d = asdict(self)
        d["bodies"] = [base64.b64encode(b).decode() for b in self.bodies]
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> LoadSpec:
        d = json.loads(text)
        d["bodies"] = [base64.b64decode(b) for b in d["bodies"]]
        spec = cls(**d)
        if spec.mode not in ("open", "closed") or spec.n < 1 or not spec.bodies:
            raise ValueError(f"bad load spec: mode {spec.mode!r}, n {spec.n}, {len(spec.bodies)} bodies")
        if spec.body_headers is not None and len(spec.body_headers) != len(spec.bodies):
            raise ValueError(f"{len(spec.body_headers)} body headers for {len(spec.bodies)} bodies")
        if spec.mode == "open" and not spec.rate > 0:
            raise ValueError(f"an open loop needs a positive rate, got {spec.rate}")
        return spec


def _summary(spec: LoadSpec, lat: list[float], statuses: dict[str, int], sent: int, send_span: float,
             last_done: float, lags: list[float]) -> dict[str, Any]:
    ms = np.asarray(lat) * 1000.0
    offered = spec.rate if spec.mode == "open" else float("nan")
    achieved = sent / send_span if send_span > 0 else 0.0
    valid = spec.mode == "closed" or (achieved >= VALID_SHARE * offered and statuses["not_sent"] == 0)
    return {**spec.extra, "mode": spec.mode, "offered_rps": round(offered, 1) if spec.mode == "open" else None,
            "achieved_rps": round(achieved, 1), "valid": bool(valid), "sent": sent, "completed": len(lat),
            **statuses, "throughput_rps": round(len(lat) / last_done, 1) if last_done > 0 else 0.0,
            "on_time_rps": round((len(lat) - statuses["late_replies"]) / last_done, 1) if last_done > 0 else 0.0,
            "p50_ms": round(float(np.percentile(ms, 50)), 2) if ms.size else None,
            "p99_ms": round(float(np.percentile(ms, 99)), 2) if ms.size else None,
            "lag_p99_ms": round(float(np.percentile(np.asarray(lags) * 1000.0, 99)), 2) if lags else 0.0}


async def _generate(spec: LoadSpec) -> dict[str, Any]:
    import aiohttp

    statuses = {"rejected": 0, "late": 0, "late_replies": 0, "failed": 0, "not_sent": 0}
    lat: list[float] = []
    lags: list[float] = []
    last_done = 0.0
    connector = aiohttp.TCPConnector(limit=max(spec.concurrency, spec.max_inflight if spec.mode == "open" else 0))
    timeout = aiohttp.ClientTimeout(total=spec.slo_s * 10 + 5.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        headers = [{**spec.headers, **h} for h in spec.body_headers] if spec.body_headers else [spec.headers]
        t0 = time.perf_counter()

        async def one(i: int, scheduled: float) -> None:
            nonlocal last_done
            try:
                async with session.post(spec.url, data=spec.bodies[i % len(spec.bodies)],
                                        headers=headers[i % len(headers)]) as resp:
                    await resp.read()
                    status = resp.status
            except Exception:  # connection errors, timeouts: counted, never fatal to the run
                statuses["failed"] += 1
                return
            done = time.perf_counter() - t0
            if status in (429, 503):
                statuses["rejected"] += 1
            elif status == 504:
                statuses["late"] += 1
            elif status != 200:
                statuses["failed"] += 1
            else:
                if done - scheduled > spec.slo_s:
                    statuses["late_replies"] += 1  # served (counted in completed), but past the SLO
                lat.append(done - scheduled)
                last_done = done

        tasks: set[asyncio.Task[None]] = set()
        sent = 0
        if spec.mode == "open":
            arrivals = np.cumsum(np.random.default_rng(spec.seed).exponential(1.0 / spec.rate, spec.n))
            # scaled so the schedule's own rate is the offered one: a Poisson draw of n arrivals runs a few
            # percent fast or slow (1/sqrt(n)), which would otherwise read as the generator's shortfall
            arrivals *= (spec.n / spec.rate) / arrivals[-1]
            while sent < spec.n and time.perf_counter() - t0 < spec.time_cap_s:
                now = time.perf_counter() - t0
                while sent < spec.n and arrivals[sent] <= now:
                    if len(tasks) >= spec.max_inflight:
                        statuses["not_sent"] += 1   # the bound holds: this arrival is dropped, and said so
                    else:
                        lags.append(now - float(arrivals[sent]))
                        task = asyncio.create_task(one(sent, float(arrivals[sent])))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                    sent += 1
                if sent < spec.n:
                    await asyncio.sleep(max(0.0, float(arrivals[sent]) - (time.perf_counter() - t0)))
            sent -= statuses["not_sent"]
        else:
            left = spec.n

            async def caller() -> None:
                nonlocal left, sent
                while left > 0 and time.perf_counter() - t0 < spec.time_cap_s:
                    left -= 1
                    i = sent
                    sent += 1
                    await one(i, time.perf_counter() - t0)

            await asyncio.gather(*(caller() for _ in range(spec.concurrency)))
        send_span = time.perf_counter() - t0
        if tasks:
            _, pending = await asyncio.wait(set(tasks), timeout=spec.slo_s * 10 + 5.0)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            statuses["failed"] += len(pending)
    return _summary(spec, lat, statuses, sent, send_span, last_done, lags)


async def run_load(spec: LoadSpec, *, python: str = sys.executable) -> dict[str, Any]:
    """Run ``spec`` in a generator process of its own; its result. The process is killed if this is
    cancelled or it overruns its own bounds by a wide margin."""
    proc = await asyncio.create_subprocess_exec(python, "-m", "bench.loadgen", stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                cwd=_REPO)
    try:
        out, err = await asyncio.wait_for(proc.communicate(spec.to_json().encode()),
                                          spec.time_cap_s + spec.slo_s * 10 + 60.0)
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"load generator exited with {proc.returncode}: {err.decode(errors='replace')[-2000:]}")
    result: dict[str, Any] = json.loads(out)
    return result


def main() -> int:
    spec = LoadSpec.from_json(sys.stdin.read())
    result = asyncio.run(_generate(spec))
    sys.stdout.write(json.dumps(result, allow_nan=False, default=lambda o: None) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
