"""A fresh virtualenv with the SDK's base install only: the tiermesh wheel built from this tree and its base
dependencies (``pip install tiermesh``, no extra), as a device that only calls the mesh would have it.

The environment has no pip of its own (``venv --without-pip``): this interpreter's pip installs into it
(``pip --python``), so what lies in its ``site-packages`` is exactly the install. Wheels come from a local
cache (``.whl/`` at the repository root, git-ignored) when it holds them; otherwise pip downloads them into
the cache first (PyPI, or whatever index pip is configured with) and installs from there, so a second run
needs no network.

Used by the ``footprint`` benchmark (install size) and by the test that calls a mesh from such a venv.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.common import REPO_ROOT

__all__ = ["WHEEL_CACHE", "SdkVenv", "build_wheel", "clean_env", "make_sdk_venv"]

WHEEL_CACHE = Path(os.environ.get("TIERMESH_WHEEL_CACHE", REPO_ROOT / ".whl"))


@dataclass(frozen=True, slots=True)
class SdkVenv:
    root: Path
    python: Path
    wheel: Path
    downloaded: bool          # the cache lacked a wheel: pip fetched them from the index this time

    def site_packages_bytes(self) -> dict[str, int]:
        """Bytes on disk per installed distribution (from each one's RECORD), measured by the venv's own
        interpreter."""
        code = ("import json, importlib.metadata as md\n"
                "out = {}\n"
                "for d in md.distributions():\n"
                "    total = 0\n"
                "    for f in d.files or ():\n"
                "        p = d.locate_file(f)\n"
                "        try:\n"
                "            total += p.stat().st_size\n"
                "        except OSError:\n"
                "            pass\n"
                "    out[d.metadata['Name']] = out.get(d.metadata['Name'], 0) + total\n"
                "print(json.dumps(out))\n")
        res = subprocess.run([str(self.python), "-c", code], capture_output=True, text=True, timeout=120, check=True,
                             env=clean_env(), cwd=self.root)
        sizes: dict[str, int] = json.loads(res.stdout)
        return sizes


def clean_env() -> dict[str, str]:
    """This environment without PYTHONPATH: a development tree on it (and the ``tiermesh.egg-info`` a wheel build
    leaves there) would make the venv's interpreter see this tree instead of its own install."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _pip(*args: str | Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=clean_env())


def build_wheel(out_dir: Path, *, timeout: float = 300.0) -> Path:
    """The tiermesh wheel of this source tree, built in an isolated environment with the build-system requirements
    of pyproject.toml (pip fetches setuptools and wheel from its index: the dev venv's setuptools may be too old)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    # setuptools writes its scratch (build/, tiermesh.egg-info) beside pyproject.toml: both are git-ignored
    res = _pip("wheel", "--no-deps", "--wheel-dir", out_dir, REPO_ROOT, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"building the tiermesh wheel failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    wheels = sorted(out_dir.glob("tiermesh-*.whl"), key=lambda p: p.stat().st_mtime)
    if not wheels:
        raise RuntimeError(f"pip wheel wrote no tiermesh wheel into {out_dir}")
    return wheels[-1]


def make_sdk_venv(root: Path, *, cache: Path = WHEEL_CACHE, timeout: float = 600.0) -> SdkVenv:
    """A venv at ``root`` holding the base install of this tree's tiermesh and nothing else."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120,
                   capture_output=True)
    python = root / "bin" / "python"
    wheel = build_wheel(root.parent / f"{root.name}-wheel", timeout=timeout)
    cache.mkdir(parents=True, exist_ok=True)
    # as `pip install` does on a device: bytecode compiled at install time counts as installed size
    install = ("--python", python, "install", "--no-index", "--find-links", cache, wheel)
    res = _pip(*install, timeout=timeout)
    downloaded = False
    if res.returncode != 0:  # the cache lacks a wheel: fetch the base dependencies into it, then again offline
        got = _pip("download", "--dest", cache, "--only-binary", ":all:", wheel, timeout=timeout)
        if got.returncode != 0:
            raise RuntimeError(f"downloading the SDK's dependencies failed:\n{got.stderr[-2000:]}")
        downloaded = True
        res = _pip(*install, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"installing the SDK into {root} failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    return SdkVenv(root=root, python=python, wheel=wheel, downloaded=downloaded)
