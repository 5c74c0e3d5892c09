"""``tiermesh jobs submit | list | show | result | cancel``: offline jobs at an edge (the SDK's ``mesh.jobs``).

    tiermesh jobs submit --edge URL --tenant acme digit-classification rows.npz --min-accuracy 0.95 --wait
    tiermesh jobs submit ... --notify https://hooks.acme.example/tiermesh/done   (a URL the operator allowed)
    tiermesh jobs list   --edge URL --tenant acme
    tiermesh jobs show   --edge URL --tenant acme TASK JOB_ID [--follow]
    tiermesh jobs result --edge URL --tenant acme TASK JOB_ID --out result.npz [--format jsonl]
    tiermesh jobs cancel --edge URL --tenant acme TASK JOB_ID

An https:// edge takes ``--cert/--key/--ca`` (the tenant's certificate names the tenant); ``--tenant`` is for an
``--insecure`` one. ``submit --wait`` and ``show --follow`` show a progress bar (rich, when installed) until the job
is done, following it by long polls (the bar moves when the job does, not on a timer). ``submit`` of an input
already submitted with the same task and ``--min-accuracy`` answers with that job (``"deduplicated": true``) unless
``--fresh``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mesh.jobs import AsyncJobs
from mesh.jobspec import FORMATS
from tiermesh.cli.edge_options import add_edge_options, edge_client_args

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("jobs", help="offline jobs: submit, list, show, result, cancel", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    jsub = p.add_subparsers(dest="jobs_command", metavar="ACTION", required=True)
    s = jsub.add_parser("submit", help="submit a job (an .npz with 'x', a .jsonl file or OIP binary tensors)")
    add_edge_options(s)
    s.add_argument("task")
    s.add_argument("input", type=Path)
    s.add_argument("--min-accuracy", type=float, default=0.0)
    s.add_argument("--deadline-s", type=float, default=3600.0, help="seconds from now (default %(default)s)")
    s.add_argument("--max-cost", type=float, default=None, help="USD ceiling")
    s.add_argument("--format", choices=FORMATS, default=None,
                   help="default: from the file's suffix (.npz, .jsonl, .oip: the Open Inference Protocol's binary "
                        "tensor layout)")
    s.add_argument("--chunk-rows", type=int, default=None)
    s.add_argument("--wait", action="store_true", help="wait with a progress bar until it is done")
    s.add_argument("--fresh", action="store_true", help="run it again even if an identical job is live or done")
    s.add_argument("--notify", default=None, metavar="URL",
                   help="https URL to POST the outcome to when the job ends (under a prefix the operator allowed)")
    s.set_defaults(func=_submit)
    ls = jsub.add_parser("list", help="your jobs")
    add_edge_options(ls)
    ls.add_argument("task", nargs="?", default=None)
    ls.set_defaults(func=_list)
    for name, func, what in (("show", _show, "a job's state and progress"), ("cancel", _cancel, "cancel a job")):
        q = jsub.add_parser(name, help=what)
        add_edge_options(q)
        q.add_argument("task")
        q.add_argument("job_id")
        if name == "show":
            q.add_argument("--follow", action="store_true", help="follow it with a progress bar until it ends")
        q.set_defaults(func=func)
    r = jsub.add_parser("result", help="a done job's outputs")
    add_edge_options(r)
    r.add_argument("task")
    r.add_argument("job_id")
    r.add_argument("--out", type=Path, required=True, help="file to write")
    r.add_argument("--format", choices=("npz", "jsonl"), default="npz")
    r.set_defaults(func=_result)


def _jobs(args: argparse.Namespace) -> AsyncJobs:
    return AsyncJobs(args.edge, **edge_client_args(args))


def _print(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))


async def _wait_with_bar(jobs: AsyncJobs, task: str, job_id: str, rows: int) -> dict[str, Any]:
    try:
        from rich.progress import Progress
    except ImportError:  # the SDK install without rich: one line per poll instead of a bar
        return await jobs.wait(task, job_id, progress=lambda st: print(
            f"{st['state']}: {st['rows_done']}/{st['rows']} rows", file=sys.stderr))
    with Progress(transient=False) as bar:
        t = bar.add_task(f"job {job_id[:8]}", total=rows)
        status = await jobs.wait(task, job_id,
                                 progress=lambda st: bar.update(t, completed=st["rows_done"],
                                                                description=f"job {job_id[:8]} {st['state']}"))
    return status


async def _submit(args: argparse.Namespace) -> int:
    async with _jobs(args) as jobs:
        job = await jobs.submit(args.task, args.input, min_accuracy=args.min_accuracy, deadline_s=args.deadline_s,
                                max_cost=args.max_cost, format=args.format, chunk_rows=args.chunk_rows,
                                fresh=args.fresh, notify=args.notify)
        _print(job.admitted)
        if args.wait:
            _print(await _wait_with_bar(jobs, args.task, job.id, int(job.admitted["rows"])))
    return 0


async def _list(args: argparse.Namespace) -> int:
    async with _jobs(args) as jobs:
        _print(await jobs.list(args.task))
    return 0


async def _show(args: argparse.Namespace) -> int:
    async with _jobs(args) as jobs:
        status = await jobs.show(args.task, args.job_id)
        if args.follow and status["state"] not in ("done", "failed", "cancelled"):
            status = await _wait_with_bar(jobs, args.task, args.job_id, int(status["rows"]))
        _print(status)
    return 0


async def _cancel(args: argparse.Namespace) -> int:
    async with _jobs(args) as jobs:
        _print(await jobs.cancel(args.task, args.job_id))
    return 0


async def _result(args: argparse.Namespace) -> int:
    async with _jobs(args) as jobs:  # streamed to the file: a result larger than memory is fine
        size = await jobs.result_to(args.task, args.job_id, args.out, args.format)
    print(f"wrote {size} bytes to {args.out}", file=sys.stderr)
    return 0
