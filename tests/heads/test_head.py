"""`Head` maths, id and array validation, error types. Pure numpy: no trunk, no files."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from backbone.spec import FEATURE_DIM
from heads import Head, InvalidBotId, InvalidHead, UnknownBot, validate_bot_id
from heads.head import validate_head_arrays
from tests.support.heads import random_head


def make_head(n=5, seed=0, version=1) -> Head:
    w, b, labels = random_head(n, seed)
    return Head("acme", version, tuple(labels), w, b)


def test_feature_dim_is_the_official_logits_input():
    import json
    from pathlib import Path

    contract = json.loads((Path(__file__).parents[1] / "data" /
                           "inception_v4_contract.json").read_text())
    (weights,) = [v for v in contract["logits_variables"] if v["name"].endswith("/weights")]
    assert weights["shape"][0] == FEATURE_DIM


def test_logits_equal_float64_reference():
    head = make_head(7)
    f = np.random.default_rng(1).standard_normal((4, FEATURE_DIM)).astype(np.float32)
    ref = f.astype(np.float64) @ head.weights.astype(np.float64) + head.biases
    out = head.logits(f)
    assert out.shape == (4, 7) and out.dtype == np.float32
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_probabilities_are_a_stable_softmax():
    head = make_head(3)
    f = np.random.default_rng(2).standard_normal((5, FEATURE_DIM)).astype(np.float32) * 1e4
    p = head.probabilities(f)  # logits of order 1e4: a naive exp overflows
    assert np.isfinite(p).all()
    np.testing.assert_allclose(p.sum(axis=1), 1.0, rtol=1e-6)
    np.testing.assert_array_equal(p.argmax(axis=1), head.logits(f).argmax(axis=1))
    small = np.random.default_rng(3).standard_normal((2, FEATURE_DIM)).astype(np.float32)
    z = head.logits(small).astype(np.float64)
    ref = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(head.probabilities(small), ref, rtol=1e-5)


@pytest.mark.parametrize("k", [1, 3, 5, 9])
def test_top_k_is_sorted_and_clipped(k):
    head = make_head(5)
    f = np.random.default_rng(4).standard_normal((3, FEATURE_DIM)).astype(np.float32)
    p = head.probabilities(f)
    top = head.top_k(f, k)
    assert len(top) == 3
    for row, probs in zip(top, p):
        assert len(row) == min(k, 5)
        expected = sorted(zip(head.labels, probs.tolist()), key=lambda t: -t[1])[: min(k, 5)]
        assert [label for label, _ in row] == [label for label, _ in expected]
        np.testing.assert_allclose([q for _, q in row], [q for _, q in expected], rtol=1e-6)


def test_head_is_immutable():
    head = make_head()
    with pytest.raises(dataclasses.FrozenInstanceError):
        head.version = 2
    with pytest.raises(ValueError):
        head.weights[0, 0] = 1.0
    assert head.n_classes == 5 and isinstance(head.labels, tuple)
    assert head.nbytes >= head.weights.nbytes + head.biases.nbytes


def test_logits_refuse_wrong_feature_width():
    with pytest.raises(ValueError, match=r"\[2, 1000\]"):
        make_head().logits(np.zeros((2, 1000), np.float32))


@pytest.mark.parametrize("bot_id", ["a", "acme-7", "Acme_bot.v2", "0", "x" * 64])
def test_valid_bot_ids(bot_id):
    assert validate_bot_id(bot_id) == bot_id


@pytest.mark.parametrize("bot_id", ["", "-acme", ".hidden", "../etc", "a/b", "a b", "x" * 65,
                                    "acme\n", "é", "a\\b", None])
def test_invalid_bot_ids_are_refused_by_name(bot_id):
    with pytest.raises(InvalidBotId) as exc:
        validate_bot_id(bot_id)
    if isinstance(bot_id, str) and len(bot_id) <= 64:
        assert repr(bot_id) in str(exc.value)
    assert isinstance(exc.value, ValueError)


def test_unknown_bot_message_and_types():
    exc = UnknownBot("acme-7")
    assert str(exc) == "unknown bot 'acme-7'"
    assert isinstance(exc, LookupError) and exc.bot_id == "acme-7"


W3, B3, L3 = random_head(3)


@pytest.mark.parametrize("weights, biases, labels, match", [
    (W3[:-1], B3, L3, r"\[1535, 3\]"),
    (W3.T, B3, L3, r"\[3, 1536\]"),
    (W3[:, :1], B3[:1], L3[:1], "at least 2 classes"),
    (W3, B3[:2], L3, r"biases have shape \[2\]"),
    (np.where(np.arange(3) == 1, np.nan, W3), B3, L3, r"NaN/Inf.*index \[0, 1\]"),
    (W3, np.array([0, np.inf, 0], np.float32), L3, "biases contain 1 non-finite"),
    (W3.astype(np.float64) * 1e300, B3, L3, "weights contain"),
    (W3, B3, L3[:2], "2 labels given for a head with 3 classes"),
    (W3, B3, ["a", "b\nc", "d"], "line break"),
    (W3, B3, ["a", "  ", "d"], "label 1 is empty"),
    (W3, B3, "abc", "not a single string"),
])
def test_invalid_heads_are_refused_with_the_reason(weights, biases, labels, match):
    with pytest.raises(InvalidHead, match=match):
        validate_head_arrays(weights, biases, labels)


def test_valid_arrays_are_cast_to_float32_copies():
    w = W3.astype(np.float64)
    w32, b32, labels = validate_head_arrays(w, B3.tolist(), L3)
    assert w32.dtype == np.float32 and b32.dtype == np.float32 and labels == tuple(L3)
    w[0, 0] = 99.0
    assert w32[0, 0] != 99.0
