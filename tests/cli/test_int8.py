"""What `multihead register` and `multihead train` say about the INT8 trunk: the new version's
top-1 agreement with the float trunk on the held-out images of the INT8 trunk calibrated for
the serving checkpoint (the session's one real calibration, tests/support/int8.py), recorded
beside it so that `serve` does not score it again; nothing where there is no INT8 trunk."""
from __future__ import annotations

import numpy as np
import pytest

from backbone import quantize as q
from backbone.gate import agreement, percent
from cli.main import main
from service.core.bots import agreement_key
from store import HeadStore
from tests.support.heads import save_checkpoint, write_labels

pytest.importorskip("nncf")


def head_files(tmp_path, weights, biases) -> tuple[str, str]:
    prefix = save_checkpoint(tmp_path / "head" / "head.ckpt",
                             {"weights": weights, "biases": biases})
    return prefix, write_labels(tmp_path / "labels.txt",
                                [f"class-{i}" for i in range(weights.shape[1])])


def tie_head(held_out):
    """Flips its answer on the first held-out image: below the bound on 8 images."""
    d = held_out.int8[0] - held_out.fp32[0]
    weights = np.stack([d, np.zeros_like(d)], axis=1).astype(np.float32)
    biases = np.array([-(held_out.fp32[0] @ d + held_out.int8[0] @ d) / 2, 0.0], np.float32)
    return weights, biases


def test_register_prints_and_records_the_agreement_with_the_int8_trunk(int8_calibrated,
                                                                       tmp_path, capsys):
    artifact = q.Int8Artifact.find(int8_calibrated.cache_dir, int8_calibrated.prefix)
    held = artifact.held_out()
    store = tmp_path / "store"
    weights, biases = tie_head(held)
    ckpt, labels = head_files(tmp_path, weights, biases)
    argv = ["register", "tie", "--weights-checkpoint", ckpt, "--labels", labels, "--store",
            str(store), "--trunk-checkpoint", int8_calibrated.prefix]
    assert main(argv) == 0
    out = capsys.readouterr().out
    value = agreement(held, weights, biases)
    assert value <= 7 / 8
    assert (f"INT8 trunk agreement: bot 'tie' version 1 keeps its top-1 class on "
            f"{percent(value)} of the INT8 trunk's 8 held-out images (bound >= 99 %); below "
            f"it, `serve --precision auto` serves the float trunk from its next start") in out
    with HeadStore(store) as heads:
        info = heads.info("tie")
    assert artifact.agreements()[agreement_key("tie", 1, info.created)] == value
    # A candidate: its own version, judged the same way.
    assert main([*argv, "--candidate", "shadow"]) == 0
    out = capsys.readouterr().out
    assert "bot 'tie' candidate version 2 keeps its top-1 class on" in out
    assert "from its next start once it is promoted" in out


def test_train_prints_the_agreement_of_the_head_it_trained(int8_calibrated, int8_images,
                                                           tmp_path, capsys):
    from cli.bots import cmd_train
    from cli.main import build_parser
    from tests.support.int8 import ProjectingTrunk

    store = tmp_path / "store"
    args = build_parser().parse_args([
        "train", "colors", "--images", str(int8_images / "colors"), "--store", str(store),
        "--trunk-checkpoint", int8_calibrated.prefix, "--no-progress"])
    assert cmd_train(args, trunk=ProjectingTrunk(int8_calibrated.prefix)) == 0
    out = capsys.readouterr().out
    with HeadStore(store) as heads:
        head = heads.get("colors")
    held = q.Int8Artifact.find(int8_calibrated.cache_dir, int8_calibrated.prefix).held_out()
    value = agreement(held, head.weights, head.biases)
    assert (f"INT8 trunk agreement: bot 'colors' version 1 keeps its top-1 class on "
            f"{percent(value)} of the INT8 trunk's 8 held-out images (bound >= 99 %)") in out


def test_without_an_int8_trunk_register_says_nothing_of_it(trunk_checkpoint, tmp_path, capsys):
    ckpt, labels = head_files(tmp_path, np.zeros((1536, 2), np.float32),
                              np.zeros(2, np.float32))
    assert main(["register", "plain", "--weights-checkpoint", ckpt, "--labels", labels,
                 "--store", str(tmp_path / "store"), "--trunk-checkpoint",
                 trunk_checkpoint]) == 0
    out = capsys.readouterr().out
    assert "registered bot 'plain' version 1" in out and "INT8" not in out
