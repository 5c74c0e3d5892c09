"""The topologies tests read, in one place.

``EXAMPLE`` is a copy of ``examples/topology.yaml`` as shipped, byte for byte: the README's tour tells a newcomer
to edit that file (a link's latency, then ``topology diff`` and ``apply``), and ``make test`` must not fail
because they did. The committed ``deploy/k8s`` is the render of this copy (its topology ConfigMap holds the file
verbatim), so the copy changes with the example: after editing ``examples/topology.yaml`` in the repository,
copy it here and render again (``python -m tiermesh.deploy render examples/topology.yaml --out deploy/k8s``).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["EXAMPLE", "SMALL"]

DATA = Path(__file__).resolve().parents[1] / "data"
EXAMPLE = DATA / "topology_example.yaml"
SMALL = DATA / "topology_small.yaml"
