"""Train and export the digit-classification family (needs the ``convert`` extra: torch CPU).

    python -m variant_store.families.digits --out variant_store/models/digits

retrains every model on the fixed split of :mod:`variant_store.families.datasets`, exports FP32 ONNX
(opset 17, TorchScript exporter, dynamic batch), checks each file with ``onnx.checker`` and against
torch's own outputs in ONNX Runtime, measures holdout accuracy in ONNX Runtime, and rewrites
``manifest.json`` and ``digits_val.npz``. Seeds, one intra-op thread and deterministic kernels make a
rerun on the same machine produce byte-identical files.

Models (family ids): ``mlp-tiny``, ``mlp-wide``, ``cnn-small``, ``cnn-large``, plus a shared
``backbone`` (x -> features) with two tenant heads: ``head-digits`` (acme) and ``head-parity`` (globex).
Every classifier takes ``x`` (N, 64); CNNs reshape to (N, 1, 8, 8) inside the graph.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from variant_store.families.datasets import (
    CALIB_COUNT,
    SPLIT_SEED,
    TRAIN_FRACTION,
    DigitsSplit,
    load_digits_split,
    save_validation_npz,
)

__all__ = ["FAMILIES", "TrainSpec", "build_all", "export_onnx", "fold_batchnorm", "main", "ort_predict", "train"]

TASK = "digit-classification"
PARITY_TASK = "digit-parity"
FEATURES = 64
OPSET = 17
TRAIN_SEED = 7


def _to_image(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, 1, 8, 8)


class _Image(nn.Module):
    """(N, 64) -> (N, 1, 8, 8): keeps the task signature identical for MLPs and CNNs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _to_image(x)


def _conv_bn(cin: int, cout: int) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]


def mlp_tiny() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def mlp_wide() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Dropout(0.2),
                         nn.Linear(512, 256), nn.ReLU(), nn.Dropout(0.2), nn.Linear(256, 10))


def cnn_small() -> nn.Module:
    return nn.Sequential(_Image(), nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(64, 10))


def cnn_large() -> nn.Module:
    return nn.Sequential(_Image(), *_conv_bn(1, 32), *_conv_bn(32, 32), nn.MaxPool2d(2),
                         *_conv_bn(32, 64), *_conv_bn(64, 64), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Dropout(0.3), nn.Linear(256, 128), nn.ReLU(), nn.Dropout(0.3), nn.Linear(128, 10))


def backbone() -> nn.Module:
    return nn.Sequential(_Image(), nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(128, FEATURES), nn.ReLU())


def head_digits() -> nn.Module:
    return nn.Linear(FEATURES, 10)


def head_parity() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, 2))


@dataclass(frozen=True, slots=True)
class TrainSpec:
    build: Callable[[], nn.Module]
    epochs: int
    lr: float
    batch: int = 32
    weight_decay: float = 1e-4
    shift_augment: bool = False   # random ±1 pixel shifts: the CNNs overfit 1078 images without it


FAMILIES: dict[str, TrainSpec] = {
    "mlp-tiny": TrainSpec(mlp_tiny, epochs=60, lr=3e-3),
    "mlp-wide": TrainSpec(mlp_wide, epochs=80, lr=1e-3, weight_decay=1e-3),
    "cnn-small": TrainSpec(cnn_small, epochs=60, lr=3e-3),
    "cnn-large": TrainSpec(cnn_large, epochs=40, lr=2e-3, shift_augment=True),
}
# ``build`` is unused for the trunk: build_all keeps handles on both halves of the joint model.
BACKBONE_SPEC = TrainSpec(lambda: nn.Sequential(backbone(), head_digits()), epochs=60, lr=3e-3)
PARITY_SPEC = TrainSpec(head_parity, epochs=30, lr=3e-3)


def _setup_torch() -> None:
    # Denormals make CPU training 10-25x slower; one thread makes float reductions reproducible.
    torch.set_flush_denormal(True)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def _shift(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Shift each image by up to one pixel in each direction, zero-filled."""
    img = nn.functional.pad(_to_image(x), (1, 1, 1, 1))
    offs = torch.randint(0, 3, (x.shape[0], 2), generator=gen)
    out = torch.empty(x.shape[0], 1, 8, 8)
    for dy in range(3):
        for dx in range(3):
            sel = (offs[:, 0] == dy) & (offs[:, 1] == dx)
            out[sel] = img[sel, :, dy:dy + 8, dx:dx + 8]
    return out.reshape(-1, 64)


def train(model: nn.Module, spec: TrainSpec, x: np.ndarray, y: np.ndarray, seed: int,
          on_epoch: Callable[[float], None] | None = None,
          features: Callable[[torch.Tensor], torch.Tensor] | None = None) -> nn.Module:
    """Adam + cosine schedule, full passes over shuffled mini-batches; ``features`` is a frozen trunk."""
    gen = torch.Generator().manual_seed(seed)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    opt = torch.optim.Adam(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    steps = spec.epochs * ((len(xt) + spec.batch - 1) // spec.batch)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(spec.epochs):
        model.train()
        perm = torch.randperm(len(xt), generator=gen)
        total = 0.0
        for i in range(0, len(xt), spec.batch):
            idx = perm[i:i + spec.batch]
            xb, yb = xt[idx], yt[idx]
            if spec.shift_augment:
                xb = _shift(xb, gen)
            if features is not None:
                with torch.no_grad():
                    xb = features(xb)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(xb), yb)
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item() * len(idx)
        if on_epoch is not None:
            on_epoch(total / len(xt))
    return model.eval()


def fold_batchnorm(model: nn.Module) -> nn.Module:
    """An eval copy with every Conv2d+BatchNorm2d pair fused, so the graph has no BatchNormalization."""
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    model = copy.deepcopy(model).eval()
    for seq in [m for m in model.modules() if isinstance(m, nn.Sequential)]:
        for i in range(len(seq) - 1):
            conv, bn = seq[i], seq[i + 1]
            if isinstance(conv, nn.Conv2d) and isinstance(bn, nn.BatchNorm2d):
                seq[i] = fuse_conv_bn_eval(conv, bn)
                seq[i + 1] = nn.Identity()
    return model


def export_onnx(model: nn.Module, in_dim: int, input_name: str, output_name: str) -> bytes:
    """FP32 ONNX bytes with a dynamic batch axis, checked by ``onnx.checker``."""
    import onnx

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.onnx"
        torch.onnx.export(
            model.eval(), (torch.zeros(2, in_dim),), str(path), dynamo=False, opset_version=OPSET,
            input_names=[input_name], output_names=[output_name], do_constant_folding=True,
            dynamic_axes={input_name: {0: "batch"}, output_name: {0: "batch"}})
        proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    return proto.SerializeToString()


def ort_predict(blob: bytes, x: np.ndarray) -> np.ndarray:
    """Run one ONNX model (bytes) on ``x`` in ONNX Runtime's CPU provider."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(blob, opts, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    return np.asarray(sess.run(None, {name: x.astype(np.float32)})[0])


def _param_count(blob: bytes) -> int:
    import onnx
    from onnx import TensorProto

    proto = onnx.load_from_string(blob)
    return sum(int(np.prod(t.dims)) for t in proto.graph.initializer if t.data_type == TensorProto.FLOAT)


def _verify(model: nn.Module, blob: bytes, x: np.ndarray) -> float:
    """Max abs difference between torch and ONNX Runtime outputs on ``x``."""
    with torch.no_grad():
        ref = model.eval()(torch.from_numpy(x)).numpy()
    got = ort_predict(blob, x)
    if got.shape != ref.shape:
        raise RuntimeError(f"ONNX output shape {got.shape} != torch {ref.shape}")
    return float(np.max(np.abs(got - ref)))


def _entry(name: str, family: str, blob: bytes, role: str, owner: str, task: str,
           accuracy: float | None, diff: float, extra: dict[str, Any]) -> dict[str, Any]:
    return {"file": name, "family": family, "task": task, "role": role, "owner": owner,
            "sha256": hashlib.sha256(blob).hexdigest(), "size_bytes": len(blob),
            "accuracy": None if accuracy is None else round(accuracy, 6),
            "metric": "top1" if accuracy is not None else None, "params": _param_count(blob),
            "format": "onnx", "precision": "fp32", "opset": OPSET,
            "max_abs_diff_vs_torch": float(f"{diff:.3g}"), **extra}


def _acc(logits: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.argmax(logits, axis=1) == y))


def build_all(out: Path, split: DigitsSplit, progress: Any = None) -> dict[str, Any]:
    """Train, export, verify and measure everything; write the files and return the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    xh, yh = split.x_holdout, split.y_holdout
    sig_in = {"name": "x", "dtype": "float32", "shape": [-1, 64]}
    entries: list[dict[str, Any]] = []

    def track(label: str, epochs: int) -> Callable[[float], None]:
        task = progress.add_task(label, total=epochs, loss=float("nan")) if progress else None

        def step(loss: float) -> None:
            if progress is not None:
                progress.update(task, advance=1, loss=loss)
        return step

    def write(fname: str, blob: bytes) -> None:
        (out / fname).write_bytes(blob)

    for i, (family, spec) in enumerate(FAMILIES.items()):
        torch.manual_seed(TRAIN_SEED + i)
        model = train(spec.build(), spec, split.x_train, split.y_train, seed=TRAIN_SEED + i,
                      on_epoch=track(family, spec.epochs))
        model = fold_batchnorm(model)
        blob = export_onnx(model, 64, "x", "logits")
        diff = _verify(model, blob, xh)
        write(f"{family}.onnx", blob)
        entries.append(_entry(f"{family}.onnx", family, blob, "model", "public", TASK,
                              _acc(ort_predict(blob, xh), yh), diff,
                              {"inputs": [sig_in], "outputs": [
                                  {"name": "logits", "dtype": "float32", "shape": [-1, 10]}]}))

    # Shared trunk: trained jointly with the digits head, then frozen for the parity head.
    torch.manual_seed(TRAIN_SEED + 100)
    trunk, digits_head = backbone(), head_digits()   # same init order as BACKBONE_SPEC.build
    train(nn.Sequential(trunk, digits_head), BACKBONE_SPEC, split.x_train, split.y_train,
          seed=TRAIN_SEED + 100, on_epoch=track("backbone+head-digits", BACKBONE_SPEC.epochs))
    for p in trunk.parameters():
        p.requires_grad_(False)
    torch.manual_seed(TRAIN_SEED + 200)
    parity = train(PARITY_SPEC.build(), PARITY_SPEC, split.x_train, split.y_train % 2,
                   seed=TRAIN_SEED + 200, on_epoch=track("head-parity (frozen trunk)", PARITY_SPEC.epochs),
                   features=trunk)

    trunk_blob = export_onnx(trunk, 64, "x", "features")
    feats = ort_predict(trunk_blob, xh)
    write("backbone.onnx", trunk_blob)
    entries.append(_entry("backbone.onnx", "backbone", trunk_blob, "backbone", "public", "digit-features",
                          None, _verify(trunk, trunk_blob, xh),
                          {"inputs": [sig_in], "outputs": [
                              {"name": "features", "dtype": "float32", "shape": [-1, FEATURES]}]}))
    with torch.no_grad():
        feats_torch = trunk(torch.from_numpy(xh)).numpy()
    for fname, head, task, owner, labels, ncls in (
            ("head-digits.onnx", digits_head, TASK, "acme", yh, 10),
            ("head-parity.onnx", parity, PARITY_TASK, "globex", yh % 2, 2)):
        blob = export_onnx(head, FEATURES, "features", "logits")
        write(fname, blob)
        entries.append(_entry(
            fname, fname.removesuffix(".onnx"), blob, "head", owner, task,
            _acc(ort_predict(blob, feats), labels), _verify(head, blob, feats_torch),
            {"backbone": "backbone.onnx", "backbone_sha256": hashlib.sha256(trunk_blob).hexdigest(),
             "inputs": [{"name": "features", "dtype": "float32", "shape": [-1, FEATURES]}],
             "outputs": [{"name": "logits", "dtype": "float32", "shape": [-1, ncls]}]}))

    val_path = out / "digits_val.npz"
    save_validation_npz(val_path, split)
    manifest = {
        "schema": 1,
        "task": TASK,
        "dataset": {
            "source": "sklearn.datasets.load_digits", "scaling": "pixels / 16 -> [0, 1]",
            "split_seed": SPLIT_SEED, "train_fraction": TRAIN_FRACTION, "stratified": True,
            "train": len(split.y_train), "calib": len(split.y_calib), "holdout": len(split.y_holdout),
            "file": val_path.name, "sha256": hashlib.sha256(val_path.read_bytes()).hexdigest(),
            "calib_count": CALIB_COUNT,
        },
        "trainer": {"torch": torch.__version__.split("+")[0], "seed": TRAIN_SEED, "exporter": "torchscript"},
        "models": entries,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m variant_store.families.digits", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("variant_store/models/digits"),
                        help="directory for the ONNX files, digits_val.npz and manifest.json")
    args = parser.parse_args(argv)

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    _setup_torch()
    console = Console(stderr=True)
    started = time.perf_counter()
    with Progress(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("epochs  loss {task.fields[loss]:.4f}"), TimeElapsedColumn(),
                  console=console) as progress:
        manifest = build_all(args.out, load_digits_split(), progress)
    table = Table(title=f"digits family -> {args.out} ({time.perf_counter() - started:.0f} s)")
    for col in ("file", "role", "owner", "task", "holdout acc", "params", "KiB", "max|ort-torch|"):
        table.add_column(col)
    for m in manifest["models"]:
        acc = "-" if m["accuracy"] is None else f"{100 * m['accuracy']:.2f} %"
        table.add_row(m["file"], m["role"], m["owner"], m["task"], acc, str(m["params"]),
                      f"{m['size_bytes'] / 1024:.1f}", f"{m['max_abs_diff_vs_torch']:.1e}")
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
