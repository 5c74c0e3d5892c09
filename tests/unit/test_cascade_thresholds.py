"""Issue 33: choosing a cascade's thresholds (variant_store.cascade), as tables whose answers are known."""

from __future__ import annotations

import numpy as np
import pytest

from mesh.errors import CascadeRefused
from variant_store.cascade import (
    answered_by,
    choose_thresholds,
    default_cascade_id,
    digits_default_stages,
    evaluate,
    split_rows,
)
from variant_store.meta import VariantMeta

pytestmark = pytest.mark.unit

# ten rows, small model's confidence and whether each stage is right
CONF = np.array([[0.95, 0.9, 0.85, 0.8, 0.7, 0.6, 0.55, 0.5, 0.4, 0.3]])
SMALL = np.array([1, 1, 1, 1, 0, 1, 0, 0, 1, 0], dtype=bool)
LARGE = np.array([1, 1, 1, 1, 1, 1, 1, 1, 0, 1], dtype=bool)


@pytest.mark.parametrize(("target", "escalated", "accuracy"), [
    (0.6, 0, 0.6),     # the small model alone meets it: nothing escalates
    (0.7, 1, 0.7),     # escalate 0.3 alone (0.3, 0.4, 0.5 would do too, at three times the traffic)
    (0.8, 4, 0.8),     # 0.3, 0.4 (lost), 0.5, 0.55: a cut cannot skip the 0.4
    (0.9, 6, 0.9),     # ... and 0.7, 0.6 (0.6 is right either way, but the cut must pass it to reach 0.7)
])
def test_two_stages_fewest_escalations_meeting_the_target(target: float, escalated: int, accuracy: float) -> None:
    correct = np.stack([SMALL, LARGE])
    (t,) = choose_thresholds(CONF, correct, target)
    acc, esc = evaluate(CONF, correct, (t,))
    assert esc == (escalated / 10,)
    assert acc == pytest.approx(accuracy)
    assert 0.0 <= t <= 1.0
    if 0 < escalated < 10:  # midway between the last escalated confidence and the next
        order = np.sort(CONF[0])
        assert order[escalated - 1] < t < order[escalated]


def test_unreachable_target_is_refused() -> None:
    correct = np.stack([SMALL, LARGE])
    with pytest.raises(CascadeRefused) as exc:
        choose_thresholds(CONF, correct, 0.95)  # the large model alone is 0.9
    assert exc.value.reason == "unreachable"


def test_ties_escalate_together_and_a_certain_row_cannot_escalate() -> None:
    conf = np.array([[1.0, 0.5, 0.5, 0.5]])
    correct = np.array([[1, 0, 1, 1], [1, 1, 1, 1]], dtype=bool)
    (t,) = choose_thresholds(conf, correct, 1.0)
    assert evaluate(conf, correct, (t,)) == (1.0, (0.75,))  # the three 0.5s go together
    wrong_when_sure = np.array([[0, 1, 1, 1], [1, 1, 1, 1]], dtype=bool)
    with pytest.raises(CascadeRefused):  # no threshold <= 1 escalates a confidence of 1
        choose_thresholds(conf, wrong_when_sure, 1.0)


def test_three_stages_minimise_total_escalation() -> None:
    # rows 0-3: stage 1 sure and right; 4-5: stage 1 unsure, stage 2 sure and right; 6-7: only stage 3 right
    conf = np.array([[0.9, 0.9, 0.9, 0.9, 0.2, 0.2, 0.3, 0.3],
                     [0.5, 0.5, 0.5, 0.5, 0.9, 0.9, 0.1, 0.1]])
    correct = np.array([[1, 1, 1, 1, 0, 0, 0, 0],
                        [1, 1, 1, 1, 1, 1, 0, 0],
                        [1, 1, 1, 1, 1, 1, 1, 1]], dtype=bool)
    ts = choose_thresholds(conf, correct, 1.0)
    assert evaluate(conf, correct, ts) == (1.0, (0.5, 0.25))
    ts = choose_thresholds(conf, correct, 0.75)  # rows 4-5 to stage 2, stage 3 not needed
    assert evaluate(conf, correct, ts) == (0.75, (0.25, 0.0))
    with pytest.raises(CascadeRefused):
        choose_thresholds(conf, np.stack([correct[0], correct[1], correct[1]]), 1.0)


def test_answered_by_takes_the_first_sure_stage() -> None:
    conf = np.array([[0.9, 0.1, 0.1], [0.0, 0.8, 0.1]])
    assert answered_by(conf, (0.5, 0.5)).tolist() == [0, 1, 2]


def test_split_is_seeded_stratified_and_disjoint() -> None:
    y = np.repeat(np.arange(5), [10, 11, 3, 1, 25])
    cal, held = split_rows(y)
    again = split_rows(y)
    assert cal.tolist() == again[0].tolist() and held.tolist() == again[1].tolist()
    assert sorted([*cal, *held]) == list(range(len(y)))
    for label in range(5):
        a, b = int(np.sum(y[cal] == label)), int(np.sum(y[held] == label))
        assert a - b in (0, 1)
    assert split_rows(y, seed=1)[0].tolist() != cal.tolist()


def _v(vid: str, precision: str, size: int, acc: float, owner: str = "public") -> VariantMeta:
    return VariantMeta(task="t", family=vid.split(".")[0], variant_id=vid, format="onnx",  # type: ignore[arg-type]
                       precision=precision, runtime="onnxruntime", blob_digest="ab" * 32,  # type: ignore[arg-type]
                       size_bytes=size, accuracy=acc, owner=owner)


def test_digits_default_stages() -> None:
    vs = [_v("a.onnx.fp32", "fp32", 100, 0.96), _v("a.onnx.int8", "int8", 30, 0.95),
          _v("b.onnx.int8", "int8", 20, 0.94), _v("c.onnx.fp32", "fp32", 900, 0.99),
          _v("h.onnx.fp32", "fp32", 5, 0.995, owner="acme"), _v("h.onnx.int8", "int8", 1, 0.5, owner="acme")]
    assert digits_default_stages(vs) == ("b.onnx.int8", "c.onnx.fp32")
    assert digits_default_stages([_v("b.onnx.int8", "int8", 20, 0.99), _v("a", "fp32", 9, 0.9)]) is None
    assert default_cascade_id(("a", "b")) == "a-to-b"
    assert len(default_cascade_id(["x" * 100, "y" * 100])) <= 128
