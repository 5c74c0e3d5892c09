"""``python -m tiermesh.chaos [--profile short|long] [--out DIR]``: run a chaos profile, write its report
(JSON + plot) and exit 0 when every invariant held and nothing leaked, 1 otherwise."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from mesh.log import configure
from tiermesh.chaos.profiles import PROFILES, SMALL_TOPOLOGY
from tiermesh.chaos.runner import run_chaos


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tiermesh.chaos", description=__doc__)
    p.add_argument("--profile", choices=sorted(PROFILES), default="long")
    p.add_argument("--out", type=Path, default=Path(".tiermesh") / "chaos", help="report directory")
    p.add_argument("--topology", type=Path, default=SMALL_TOPOLOGY)
    args = p.parse_args(argv)
    configure("WARNING")
    res = asyncio.run(run_chaos(PROFILES[args.profile], topology=args.topology, out_dir=args.out))
    print(json.dumps({"ok": res.ok, "verdict": res.verdict.as_dict(), "leaks": res.leaks,
                      "report": str(args.out / f"chaos-{args.profile}.json")}, indent=1))
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
