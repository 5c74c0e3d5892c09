"""``tiermesh up`` keeps its own process's log records and library warnings off the screen (HOME/logs/up.log),
unless ``--verbose``: ONNX Runtime's quantization notices (``logging.warning`` on the root logger), Python
``warnings``, the in-process scheduler's and etcd's records."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

import pytest

from mesh.log import LogToFile, configure

pytestmark = pytest.mark.unit

QUANT = "Please consider to run pre-processing before quantization."  # what onnxruntime.quantization logs


def _emit() -> None:
    logging.warning(QUANT)  # as onnxruntime.quantization does: the root logger
    logging.getLogger("core_scheduler.scheduler").info("placement round")
    warnings.warn("a library's deprecation notice", DeprecationWarning, stacklevel=1)


def test_library_warnings_and_records_go_to_the_file_not_the_screen(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    before = list(root.handlers)
    try:
        configure("INFO")  # as `tiermesh` does before any command: records on stderr
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            with LogToFile(tmp_path / "logs" / "up.log"):
                _emit()
        out, err = capsys.readouterr()
        assert out == "" and err == "", (out, err)
        logged = (tmp_path / "logs" / "up.log").read_text()
        assert QUANT in logged and "placement round" in logged and "deprecation notice" in logged, logged
        # after it, as before: records on the screen again
        logging.getLogger("x").warning("after")
        assert "after" in capsys.readouterr().err
    finally:
        root.handlers[:] = before


def test_verbose_shows_them_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    before = list(root.handlers)
    try:
        configure("INFO")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            with LogToFile(tmp_path / "up.log", echo=True):
                _emit()
        err = capsys.readouterr().err
        assert QUANT in err and "placement round" in err and "deprecation notice" in err, err
        assert QUANT in (tmp_path / "up.log").read_text()
    finally:
        root.handlers[:] = before


def test_what_c_libraries_write_to_stderr_goes_to_the_file(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """TF Lite and ONNX Runtime log from C, straight to file descriptor 2 (seen under `make demo | cat`)."""
    line = b"INFO: Created TensorFlow Lite XNNPACK delegate for CPU.\n"
    with LogToFile(tmp_path / "up.log", native=True):
        os.write(2, line)
    os.write(2, b"after\n")
    out, err = capfd.readouterr()
    assert "XNNPACK" not in out + err and "after" in err, (out, err)
    assert line.decode() in (tmp_path / "up.log").read_text()
    with LogToFile(tmp_path / "verbose.log", echo=True, native=True):  # --verbose: on the screen
        os.write(2, line)
    assert "XNNPACK" in capfd.readouterr().err
