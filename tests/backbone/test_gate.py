"""The INT8 gate (`backbone.gate`) on synthetic features, pure numpy: each head's top-1
agreement from one matmul per trunk, the three bounds each failing alone, the minimum cosine
reported and not gated, the mean cosine alone without a head, the one-line summary the serve
log and the demo print, the report's round trip, and the score NNCF's accuracy control reads."""
from __future__ import annotations

import json

import numpy as np
import pytest

from backbone import gate
from backbone.gate import HeldOut, agreement, judge, score

N = 200  # held-out images: a flipped answer is 0.5 %


def two_class_head(h: int) -> tuple[np.ndarray, np.ndarray]:
    """A head whose two logits are features 2h and 2h + 1."""
    weights = np.zeros((1536, 2), np.float32)
    weights[2 * h, 0] = weights[2 * h + 1, 1] = 1.0
    return weights, np.zeros(2, np.float32)


def features(flips: dict[int, int], *, noise: float = 0.0, seed: int = 0) -> HeldOut:
    """N images whose features under head h's two dimensions flip its top-1 class on the first
    `flips[h]` images (features otherwise alike: cosines near 1), plus `noise` on the rest."""
    rng = np.random.default_rng(seed)
    fp32 = rng.uniform(0.5, 1.5, (N, 1536)).astype(np.float32)
    for h in range(8):
        fp32[:, 2 * h:2 * h + 2] = [2.0, 0.0]
    int8 = fp32.copy()
    for h, count in flips.items():
        fp32[:count, 2 * h:2 * h + 2] = [1.0, 0.99]
        int8[:count, 2 * h:2 * h + 2] = [0.99, 1.0]  # the near tie swaps under "int8"
    int8[:, 16:] += noise * rng.normal(size=(N, 1536 - 16)).astype(np.float32)
    return HeldOut(tuple(f"img{i}.png" for i in range(N)), fp32, int8)


def judged(held: HeldOut, heads: int):
    return judge(held, {f"h{h}": agreement(held, *two_class_head(h)) for h in range(heads)})


def test_agreement_is_the_share_of_images_keeping_their_top1_class():
    held = features({0: 3, 1: 0})
    assert agreement(held, *two_class_head(0)) == pytest.approx(1 - 3 / N)
    assert agreement(held, *two_class_head(1)) == 1.0
    # one matmul per trunk: a head is weights [1536, n] and biases [n], nothing else
    weights, biases = two_class_head(0)
    assert agreement(held, weights, biases + np.array([10.0, 0.0])) == 1.0  # no near tie left
    with pytest.raises(ValueError, match=r"\[1536, n\]"):
        agreement(held, weights[:100], biases)
    with pytest.raises(ValueError):
        agreement(held, weights, np.zeros(3))


def test_a_faithful_int8_trunk_passes_and_says_so_in_one_line():
    report = judged(features({}, noise=0.001), heads=3)
    assert report.passed and report.failures == []
    assert report.agreement == {"h0": 1.0, "h1": 1.0, "h2": 1.0}
    assert report.summary() == (f"gate passed for 3 heads (min agreement 100.00 %, overall "
                                f"100.00 %, mean cosine {report.mean_cosine:.4f})")
    assert score(report) > 1 - gate.SCALE


def test_one_head_below_its_bound_fails_the_gate_alone():
    report = judged(features({0: 3}), heads=4)  # h0: 3 of 200 flipped
    assert report.agreement["h0"] == pytest.approx(0.985)
    assert report.overall_agreement >= gate.MIN_OVERALL_AGREEMENT  # the others carry it
    assert report.mean_cosine >= gate.MIN_MEAN_COSINE
    assert report.failures == ["head 'h0' (agreement 98.50 % < 99 %)"]
    assert not report.passed
    assert report.summary() == "gate fails for head 'h0' (agreement 98.50 % < 99 %)"
    assert score(report) < 1 - gate.SCALE


def test_all_heads_answers_below_their_bound_fail_the_gate_alone():
    report = judged(features({0: 2, 1: 2}), heads=2)  # each exactly at 99 %
    assert report.agreement == {"h0": 0.99, "h1": 0.99}  # each within its bound
    assert report.mean_cosine >= gate.MIN_MEAN_COSINE
    assert report.failures == ["all heads' answers (agreement 99.00 % < 99.5 %)"]
    assert not report.passed and score(report) < 1 - gate.SCALE


def test_a_low_mean_cosine_fails_the_gate_alone():
    report = judged(features({}, noise=0.05), heads=2)
    assert report.agreement == {"h0": 1.0, "h1": 1.0}
    assert report.mean_cosine < gate.MIN_MEAN_COSINE
    assert report.failures == [f"mean cosine ({report.mean_cosine:.6f} < 0.999)"]
    assert not report.passed and score(report) < 1 - gate.SCALE


def test_the_min_cosine_and_the_lowest_images_are_reported_not_gated():
    held = features({})
    int8 = held.int8.copy()
    int8[7, 16:] = np.random.default_rng(3).uniform(0.5, 1.5, 1536 - 16)  # one image far off
    report = judged(HeldOut(held.names, held.fp32, int8), heads=1)
    assert report.min_cosine < 0.95 <= gate.MIN_MEAN_COSINE <= report.mean_cosine
    assert report.lowest[0] == {"image": "img7.png", "cosine": report.min_cosine,
                                "norm_ratio": pytest.approx(1.0, abs=0.1)}
    assert report.passed
    text = "\n".join(report.lines())
    assert f"min cosine vs fp32: {report.min_cosine:.6f} (reported, not gated)" in text
    assert "lowest cosines: img7.png" in text and text.endswith("PASS")


def test_without_a_head_the_mean_cosine_alone_decides_and_the_report_says_so():
    report = judge(features({0: 50}))  # answers would flip, but no head is registered
    assert report.agreement == {} and report.overall_agreement is None and report.passed
    assert report.summary() == (f"gate passed with no registered head (mean cosine "
                                f"{report.mean_cosine:.4f})")
    assert "top-1 agreement: no registered head (the mean cosine alone decides)" in \
        report.lines()
    assert not judge(features({}, noise=0.05)).passed
    assert score(report) > 1 - gate.SCALE


def test_the_same_int8_trunk_judged_for_other_heads():
    report = judged(features({0: 3}), heads=4)
    again = report.for_heads({"h1": 1.0, "new": 0.97})
    assert (again.mean_cosine, again.min_cosine, again.lowest) == (
        report.mean_cosine, report.min_cosine, report.lowest)
    assert again.failures == ["head 'new' (agreement 97.00 % < 99 %)",
                              "all heads' answers (agreement 98.50 % < 99.5 %)"]
    assert report.for_heads({"h0": 1.0}).passed
    with pytest.MonkeyPatch.context() as mp:  # judged again: against the bounds of now
        mp.setattr(gate, "MIN_MEAN_COSINE", 1.01)
        assert not report.for_heads({"h0": 1.0}).passed


def test_many_failing_heads_are_named_three_at_a_time():
    report = judged(features({h: 3 + h for h in range(6)}), heads=6)
    assert len(report.failures) == 7  # six heads and all answers
    summary = report.summary()
    assert summary.startswith("gate fails for head 'h5' (agreement 96.00 % < 99 %); head 'h4'")
    assert summary.endswith("; all heads' answers (agreement 97.25 % < 99.5 %) and 3 more heads")
    assert "'h2'" not in summary


def test_the_bounds_in_force_at_judging_are_the_reports():
    held = features({0: 1})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gate, "MIN_HEAD_AGREEMENT", 1.0)
        strict = judged(held, heads=1)
    assert strict.min_agreement_bound == 1.0 and not strict.passed
    assert judged(held, heads=1).passed
    assert score(strict) < 1 - gate.SCALE  # a bound of 1 allows nothing


def test_the_report_and_the_features_survive_their_files():
    held = features({0: 3}, noise=0.001)
    report = judged(held, heads=4)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["passed"] is False and data["overall_agreement"] == report.overall_agreement
    assert gate.FidelityReport.from_dict(data) == report
    again = HeldOut.from_bytes(held.to_bytes())
    assert again.names == held.names
    np.testing.assert_array_equal(again.fp32, held.fp32)
    np.testing.assert_array_equal(again.int8, held.int8)
    assert judged(again, heads=4) == report


@pytest.mark.parametrize("fp32, int8, names, match", [
    (np.zeros((2, 1536)), np.zeros((3, 1536)), ("a", "b"), "both be"),
    (np.zeros((2, 100)), np.zeros((2, 100)), ("a", "b"), "both be"),
    (np.zeros((0, 1536)), np.zeros((0, 1536)), (), "both be"),
    (np.zeros((2, 1536)), np.zeros((2, 1536)), ("a",), "1 names for 2 images"),
])
def test_held_out_features_are_checked(fp32, int8, names, match):
    with pytest.raises(ValueError, match=match):
        HeldOut(names, fp32, int8)


def test_cosines_of_zero_vectors():
    zero, one = np.zeros((1, 1536)), np.ones((1, 1536))
    assert gate.cosines(zero, zero).tolist() == [1.0]
    assert gate.cosines(zero, one).tolist() == [-1.0]
    assert gate.cosines(one, -one).tolist() == [pytest.approx(-1.0)]


def test_the_report_names_the_lowest_images_and_why_by_their_feature_norm():
    rng = np.random.default_rng(1)
    fp32 = np.abs(rng.normal(size=(6, 1536))).astype(np.float32)
    fp32[2] *= 0.05  # a flat picture: small features
    fp32[4] *= 3.0  # a bright one: large features
    noise = rng.normal(size=fp32.shape).astype(np.float32)
    # The same absolute error on every image, except a clipped-looking extra one on image 4.
    int8 = fp32 + 0.01 * noise
    int8[4] += 0.2 * noise[4]
    names = [f"img{i}.png" for i in range(6)]
    report = gate.fidelity(fp32, int8, names=names)
    assert [row["image"] for row in report.lowest][:2] == ["img2.png", "img4.png"]
    assert report.lowest[0]["cosine"] == report.min_cosine
    assert report.lowest[0]["norm_ratio"] < gate.LOW_NORM < 1 < gate.HIGH_NORM < \
        report.lowest[1]["norm_ratio"]
    assert len(report.lowest) == gate.LOWEST_SHOWN
    text = "\n".join(report.lines())
    assert "lowest cosines: img2.png" in text
    assert "img2.png: a low-signal picture" in text  # below 0.999, whatever the gate says
    # The reason printed is the lowest image's: a large-feature image gets the clipping one.
    swapped = gate.fidelity(fp32[[4, 0, 1]], int8[[4, 0, 1]], names=["b", "c", "d"])
    assert swapped.lowest[0]["image"] == "b"
    assert "b: stronger activations" in "\n".join(swapped.lines())
    # No reason when the lowest image is within 0.999; "#i" names by default.
    close = gate.fidelity(fp32, fp32 + 1e-6 * noise)
    assert close.passed and close.lowest[0]["image"].startswith("#")
    assert not any(line.startswith("  ") for line in close.lines())
    with pytest.raises(ValueError):
        gate.fidelity(fp32, int8, names=names[:2])


def test_fidelity_judges_heads_given_as_heads():
    class Head:  # anything with weights and biases: a `heads.Head`
        weights, biases = two_class_head(0)

    held = features({0: 4})
    report = gate.fidelity(held.fp32, held.int8, {"h": Head()})
    assert report.agreement == {"h": 0.98} and not report.passed
    assert gate.fidelity(held.fp32, held.fp32, {"h": Head()}).passed
