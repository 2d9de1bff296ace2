"""The real Inception-V4 trunk: layout, restore, errors, batching, threads, several trunks."""
import json
import logging
from pathlib import Path

import numpy as np
import pytest

from backbone import CheckpointError, Trunk, preprocess
from backbone.checkpoint import (
    check_layout,
    random_variables,
    trunk_digest,
    write_checkpoint,
    write_random_checkpoint,
)
from backbone.inception_v4 import aux_logits_specs, variable_specs
from backbone.runners.tf import GraphCache
from tests.backbone.helpers import (
    concurrent_features,
    copy_graphs,
    encode,
    graph_cache_of,
    pattern,
)

CONTRACT = json.loads((Path(__file__).parents[1] / "data" / "inception_v4_contract.json").read_text())


def _contract_specs(key):
    return [(v["name"], v["shape"]) for v in CONTRACT[key]]


@pytest.fixture(scope="module")
def images():
    """Seven structured images, preprocessed: [7, 299, 299, 3]."""
    return np.stack([preprocess(encode(pattern(seed))) for seed in range(7)])


def test_variables_equal_the_contract(trunk):
    assert len(CONTRACT["trunk_variables"]) == 596
    assert all(v["dtype"] == "float32" for v in CONTRACT["trunk_variables"])
    want = _contract_specs("trunk_variables") + _contract_specs("logits_variables")
    assert trunk.variables == want  # the built graph, names, shapes and creation order
    assert variable_specs(num_classes=1001) == want  # the table used to check checkpoints
    assert aux_logits_specs() == _contract_specs("aux_logits_variables")


def test_end_point_shapes_equal_the_contract(trunk):
    expected = {k: v for k, v in CONTRACT["endpoints"].items() if k != "AuxLogits"}
    assert set(trunk.end_points) == set(expected)
    for name, shape in expected.items():
        assert trunk.end_points[name] == [None] + shape[1:], name


def test_features_shape_and_variation(trunk, images):
    features = trunk.features(images[:4])
    assert features.shape == (4, 1536) and features.dtype == np.float32
    assert np.isfinite(features).all()
    # Different images give clearly different features (not a constant vector).
    spread = np.linalg.norm(features - features.mean(0), axis=1).mean()
    assert spread > 0.05 * np.linalg.norm(features, axis=1).mean()


def test_batch_invariance(trunk, images):
    batch = trunk.features(images)
    alone = trunk.features(images[3:4])
    np.testing.assert_allclose(alone[0], batch[3], atol=1e-4)


def test_concurrent_calls_equal_serial_calls(trunk, images):
    batches = [images[i:i + 2] for i in range(4)]
    serial = [trunk.features(batch) for batch in batches]
    for got, want in zip(concurrent_features(trunk, batches), serial):
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_logits_are_the_checkpoint_layer(trunk, trunk_checkpoint, images):
    import tensorflow as tf

    features, logits = trunk.features_and_logits(images[:2])
    reader = tf.train.load_checkpoint(trunk_checkpoint)
    weights = reader.get_tensor("InceptionV4/Logits/Logits/weights")
    biases = reader.get_tensor("InceptionV4/Logits/Logits/biases")
    assert logits.shape == (2, 1001)
    np.testing.assert_allclose(logits, features @ weights + biases, atol=1e-4)


def test_second_trunk_from_a_fine_tuned_checkpoint(trunk, trunk_checkpoint, images, tmp_path):
    """A slim fine-tuned checkpoint (5-class Logits, optimizer slots) restores the same trunk,
    and building a second Trunk in the process leaves the first one working."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(trunk_checkpoint)
    values = {name: reader.get_tensor(name) for name, _ in variable_specs()}
    rng = np.random.default_rng(1)
    values["InceptionV4/Logits/Logits/weights"] = rng.standard_normal((1536, 5), np.float32)
    values["InceptionV4/Logits/Logits/biases"] = np.zeros(5, np.float32)
    values["InceptionV4/Conv2d_1a_3x3/weights/RMSProp"] = np.ones((3, 3, 3, 32), np.float32)
    values["global_step"] = np.array(1000, np.int64)
    prefix = write_checkpoint(str(tmp_path / "fine_tuned.ckpt"), values)

    before = trunk.features(images[:2])
    second = Trunk.from_checkpoint(prefix, with_logits=True)
    try:
        assert second.num_classes == 5
        features, logits = second.features_and_logits(images[:2])
        assert logits.shape == (2, 5)
        np.testing.assert_allclose(features, before, atol=1e-4)
        np.testing.assert_allclose(trunk.features(images[:2]), before, atol=1e-5)
        assert second.runner.graph is not trunk.runner.graph
        assert not tf.compat.v1.get_default_graph().get_operations()  # nothing leaked
    finally:
        second.close()
    assert trunk_digest(prefix) == trunk_digest(trunk_checkpoint)
    # The build compared tensors by identity (runners.tf._identity_equality), and only then.
    assert (tf.constant([1, 2]) == tf.constant([1, 3])).numpy().tolist() == [True, False]


def test_missing_checkpoint_names_the_path(tmp_path):
    missing = str(tmp_path / "nowhere" / "model.ckpt")
    with pytest.raises(CheckpointError, match="nowhere/model.ckpt"):
        Trunk.from_checkpoint(missing)


@pytest.fixture(scope="module")
def small_values():
    return random_variables(seed=5, num_classes=3, aux_logits=False)


def test_missing_variable_is_named(tmp_path, small_values):
    name = "InceptionV4/Mixed_6c/Branch_2/Conv2d_0d_7x1/weights"
    values = dict(small_values)
    del values[name]
    prefix = write_checkpoint(str(tmp_path / "missing.ckpt"), values)
    with pytest.raises(CheckpointError, match=f"no variable '{name}'"):
        Trunk.from_checkpoint(prefix)


def test_misshaped_variable_names_both_shapes(tmp_path, small_values):
    name = "InceptionV4/Mixed_7d/Branch_1/Conv2d_0b_1x3/weights"
    values = dict(small_values)
    values[name] = np.zeros((3, 1, 384, 256), np.float32)
    prefix = write_checkpoint(str(tmp_path / "misshaped.ckpt"), values)
    with pytest.raises(CheckpointError) as err:
        Trunk.from_checkpoint(prefix)
    assert name in str(err.value)
    assert "[3, 1, 384, 256]" in str(err.value) and "[1, 3, 384, 256]" in str(err.value)


def test_bad_input_shape_is_refused(trunk):
    with pytest.raises(ValueError, match="299"):
        trunk.features(np.zeros((1, 224, 224, 3), np.float32))


def test_init_trunk_layout_and_determinism(trunk_checkpoint):
    import tensorflow as tf

    assert check_layout(trunk_checkpoint, with_logits=True) == 1001
    shapes = tf.train.load_checkpoint(trunk_checkpoint).get_variable_to_shape_map()
    official = (_contract_specs("trunk_variables") + _contract_specs("logits_variables")
                + _contract_specs("aux_logits_variables"))
    assert {name: list(shape) for name, shape in shapes.items()} == dict(official)
    same = random_variables(seed=0)
    other = random_variables(seed=1)
    name = "InceptionV4/Mixed_5b/Branch_0/Conv2d_0a_1x1/weights"
    stored = tf.train.load_checkpoint(trunk_checkpoint).get_tensor(name)
    np.testing.assert_array_equal(stored, same[name])
    assert not np.array_equal(same[name], other[name])
    # He scaling: std sqrt(2 / fan_in)
    assert abs(float(stored.std()) - np.sqrt(2 / 384)) < 0.01


def test_corrupt_checkpoint_is_a_clear_error(tmp_path):
    prefix = tmp_path / "corrupt.ckpt"
    write_random_checkpoint(str(prefix), seed=2, num_classes=2, aux_logits=False)
    index = Path(f"{prefix}.index")
    index.write_bytes(index.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="corrupt.ckpt"):
        Trunk.from_checkpoint(str(prefix))


def test_graph_cache_restart_gives_the_same_features(trunk, trunk_checkpoint, images, tmp_path,
                                                     serving_graph_cache, caplog):
    """A saved graph is imported instead of rebuilt; a corrupt one is rebuilt and saved again.
    (`serving_graph_cache` is the first start: it built the graph and saved it.)"""
    cache_dir = copy_graphs(serving_graph_cache, tmp_path / "graph_cache")
    saved = sorted(cache_dir.glob("*.meta"))
    assert saved
    second = Trunk.from_checkpoint(trunk_checkpoint, graph_cache_dir=cache_dir)
    try:
        assert second.graph_from_cache
        assert second.variables == trunk.variables[:596]
        np.testing.assert_allclose(second.features(images[:2]), trunk.features(images[:2]),
                                   atol=1e-4)
    finally:
        second.close()
    # A corrupt cache entry is ignored, never fatal: the graph is then built and saved as on a
    # first start (the path that saved `serving_graph_cache`; not built a third time here).
    cache = GraphCache(cache_dir, 0)
    assert cache.path in saved
    for meta in saved:
        meta.write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING, logger="backbone.runners.tf"):
        assert cache.load("/cpu:0") is None
    assert f"ignoring unusable graph cache {cache.path}" in caplog.text


def test_v1_checkpoint_file_like_the_official_one(trunk, trunk_checkpoint, images, tmp_path):
    """The model-zoo `inception_v4.ckpt` is a V1 single-file checkpoint: it must load too."""
    from backbone.checkpoint import default_trunk_checkpoint
    from tests.backbone.helpers import write_v1_checkpoint

    store = tmp_path / "store"
    (store / "trunk").mkdir(parents=True)
    path = write_v1_checkpoint(trunk_checkpoint, store / "trunk" / "inception_v4.ckpt")
    assert not Path(f"{path}.index").exists()  # V1: one file
    assert default_trunk_checkpoint(store) == path
    assert trunk_digest(path) == trunk_digest(trunk_checkpoint)
    # The session trunk's saved graph (same layout): what is tested is the V1 restore.
    official = Trunk.from_checkpoint(path, with_logits=True,
                                     graph_cache_dir=graph_cache_of(trunk_checkpoint))
    try:
        np.testing.assert_allclose(official.features_and_logits(images[:2])[1],
                                   trunk.features_and_logits(images[:2])[1], atol=1e-4)
    finally:
        official.close()
