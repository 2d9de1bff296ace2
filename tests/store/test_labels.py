"""The label rules (issue 34): every way a head version enters the store refuses a label over
`MAX_LABEL_CHARS` characters or holding a control, line-breaking or bidirectional formatting
character, naming the label (and its line) and showing only its escaped start; a version stored
before the rules still loads and serves."""
from __future__ import annotations

import numpy as np
import pytest

from heads import MAX_LABEL_CHARS, InvalidHead, InvalidLabel, escape_text, read_labels
from heads.head import validate_labels
from tests.support.builders import random_head
from tests.support.heads import write_labels

MEGABYTE_OF_CONTROLS = "\x07" * 2**20


@pytest.mark.parametrize("label, match", [
    ("x" * (MAX_LABEL_CHARS + 1), r"label 1 'x{40}\.\.\.': 257 characters, at most 256"),
    (MEGABYTE_OF_CONTROLS, r"label 1 '(\\x07){40}\.\.\.': 1,048,576 characters, at most 256"),
    ("ding\x07", r"label 1 'ding\\x07': control character U\+0007 at character 5"),
    ("red\x1b[31m", r"control character U\+001B"),
    ("a\tb", r"control character U\+0009 \(a line break\)|control character U\+0009"),
    ("a\x85b", r"control character U\+0085 \(a line break\)"),
    ("a\u2028b", r"line separator U\+2028"),
    ("a\u202eb", r"bidirectional formatting character U\+202E"),
    ("a\ud800", r"lone surrogate U\+D800"),
])
def test_a_label_against_the_rules_is_refused_naming_it(label, match):
    with pytest.raises(InvalidLabel, match=match) as caught:
        validate_labels(["cat", label])
    assert isinstance(caught.value, InvalidHead) and len(str(caught.value)) < 300


@pytest.mark.parametrize("label", ["x" * MAX_LABEL_CHARS, "é" * MAX_LABEL_CHARS,
                                   "\U0001F468\u200d\U0001F469", "sea lion", "a\u00adb"])
def test_labels_within_the_rules_are_accepted(label):
    assert validate_labels(["cat", label]) == ("cat", label)


def test_a_labels_file_refusal_names_the_line(tmp_path):
    path = tmp_path / "labels.txt"
    path.write_text("cat\r\ndog\r\nbad\x1b[2J\r\n", "utf-8")
    with pytest.raises(InvalidLabel, match=r"label 2 \(line 3 of labels file '.*labels\.txt'\) "
                                           r"'bad\\x1b\[2J': control character U\+001B"):
        read_labels(path)
    # A line break other than LF, CRLF or CR is a refused character on its own line, not a
    # new line that shifts every following label.
    path.write_text("cat\ndo\u2028g\nbird\n", "utf-8")
    with pytest.raises(InvalidLabel, match=r"label 1 \(line 2 .*line separator U\+2028"):
        read_labels(path)
    path.write_text("cat\rdog\r", "utf-8")
    assert read_labels(path) == ("cat", "dog")


def test_escape_text_makes_a_label_safe_to_print():
    assert escape_text("cat") == "cat"
    assert escape_text("\x1b[2Jred\x07\u202e\\") == "\\x1b[2Jred\\x07\\u202e\\\\"
    assert escape_text("\U000e0001") == "\\U000e0001"


@pytest.mark.parametrize("label", ["x" * (MAX_LABEL_CHARS + 1), "a\x1b[31mb"])
def test_every_registration_path_refuses_a_bad_label(any_store, tmp_path, label):
    from backbone.checkpoint import write_checkpoint

    weights, biases, labels = random_head(3, seed=1)
    bad = [labels[0], label, labels[2]]
    with pytest.raises(InvalidLabel, match="label 1"):
        any_store.register("arrays", weights, biases, bad)
    labels_file = write_labels(tmp_path / "labels.txt", bad)
    prefix = write_checkpoint(str(tmp_path / "ck" / "head.ckpt"),
                              {"weights": weights, "biases": biases})
    with pytest.raises(InvalidLabel, match=r"label 1 \(line 2 of labels file"):
        any_store.register_checkpoint("ckpt", prefix, labels_file)
    any_store.register("live", weights, biases, labels)
    with pytest.raises(InvalidLabel, match="label 1"):
        any_store.register("live", weights, biases, bad, candidate="shadow")
    assert [i.bot_id for i in any_store.list()] == ["live"]
    assert any_store.get("live").version == 1


def test_a_version_stored_before_the_rules_still_loads_and_serves(any_store):
    """An old store's label (written before the rules, here through the backend under the
    rules) loads; only new versions are held to the rules."""
    from store.front import _step

    weights, biases, labels = random_head(3, seed=2)
    old = ("cat", "\x1b[2J" + "y" * 5000, "dog")
    any_store._backend.bots.add_version("old", weights, biases, old, "old store", _step)
    any_store._snapshots.refresh(force=True)
    head = any_store.get("old")
    assert head.labels == old
    top = head.top_k(np.ones((1, weights.shape[0]), np.float32), 3)
    assert {label for label, _ in top[0]} == set(old)
