"""tiermesh benchmarks: overhead against measured floors, routing decision time, dynamic batching.

    python -m bench [--quick] [--only NAME ...]

Each scenario writes ``bench/results/<name>.json`` (machine, versions, git commit, rows, targets)
and ``bench/results/<name>.png``; ``bench.report`` turns every JSON there into ``BENCHMARKS.md``.
Benchmarks are not tests: they are run by ``make bench`` / ``make bench-quick``, never by pytest.
"""

__all__: list[str] = []
