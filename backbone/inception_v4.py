"""Inception-V4 (Szegedy et al. 2016, arXiv:1602.07261) written with tf-slim layers.

The layer names, shapes and creation order are those of the official slim checkpoint
`inception_v4_2016_09_09` (see ../shared/inception_v4_contract.json): they are the checkpoint's
keys, so they are an API. Each block is declared as data (branches of layers) and built by one
function; `build_inception_v4` returns the end points, among them `PreLogitsFlatten` [N, 1536],
the seam between the shared trunk and the per-bot heads.

Only graph mode (tf.compat.v1) is supported: call inside `with graph.as_default():`.
"""
from __future__ import annotations

from dataclasses import dataclass

from backbone.compat import import_slim
from backbone.spec import FEATURE_DIM

# Scope strings are the checkpoint's keys: defined once here.
SCOPE = "InceptionV4"
LOGITS_SCOPE = f"{SCOPE}/Logits/Logits"
NUM_CLASSES = 1001
PRELOGITS = "PreLogitsFlatten"

# inception_utils.inception_arg_scope() defaults, which the official checkpoint was trained with.
BATCH_NORM_DECAY = 0.9997
BATCH_NORM_EPSILON = 0.001


@dataclass(frozen=True)
class Conv:
    depth: int
    kernel: str  # "3x3", "1x7" (rows x cols, as slim's [kh, kw])
    tag: str  # "0a", "1a", ...: part of the scope name
    stride: int = 1
    padding: str = "SAME"

    @property
    def scope(self) -> str:
        return f"Conv2d_{self.tag}_{self.kernel}"


@dataclass(frozen=True)
class Pool:
    kind: str  # "Max" or "Avg"
    kernel: str
    tag: str
    stride: int = 1
    padding: str = "SAME"

    @property
    def scope(self) -> str:
        return f"{self.kind}Pool_{self.tag}_{self.kernel}"


@dataclass(frozen=True)
class Split:
    """Two layers applied to the same input, concatenated on channels (Inception-C)."""

    left: Conv
    right: Conv


Layer = Conv | Pool | Split
Branch = tuple  # tuple[Layer, ...]

VALID = "VALID"

MIXED_3A = (
    (Pool("Max", "3x3", "0a", 2, VALID),),
    (Conv(96, "3x3", "0a", 2, VALID),),
)
MIXED_4A = (
    (Conv(64, "1x1", "0a"), Conv(96, "3x3", "1a", padding=VALID)),
    (Conv(64, "1x1", "0a"), Conv(64, "1x7", "0b"), Conv(64, "7x1", "0c"),
     Conv(96, "3x3", "1a", padding=VALID)),
)
MIXED_5A = (
    (Conv(192, "3x3", "1a", 2, VALID),),
    (Pool("Max", "3x3", "1a", 2, VALID),),
)
INCEPTION_A = (
    (Conv(96, "1x1", "0a"),),
    (Conv(64, "1x1", "0a"), Conv(96, "3x3", "0b")),
    (Conv(64, "1x1", "0a"), Conv(96, "3x3", "0b"), Conv(96, "3x3", "0c")),
    (Pool("Avg", "3x3", "0a"), Conv(96, "1x1", "0b")),
)
REDUCTION_A = (
    (Conv(384, "3x3", "1a", 2, VALID),),
    (Conv(192, "1x1", "0a"), Conv(224, "3x3", "0b"), Conv(256, "3x3", "1a", 2, VALID)),
    (Pool("Max", "3x3", "1a", 2, VALID),),
)
INCEPTION_B = (
    (Conv(384, "1x1", "0a"),),
    (Conv(192, "1x1", "0a"), Conv(224, "1x7", "0b"), Conv(256, "7x1", "0c")),
    (Conv(192, "1x1", "0a"), Conv(192, "7x1", "0b"), Conv(224, "1x7", "0c"),
     Conv(224, "7x1", "0d"), Conv(256, "1x7", "0e")),
    (Pool("Avg", "3x3", "0a"), Conv(128, "1x1", "0b")),
)
REDUCTION_B = (
    (Conv(192, "1x1", "0a"), Conv(192, "3x3", "1a", 2, VALID)),
    (Conv(256, "1x1", "0a"), Conv(256, "1x7", "0b"), Conv(320, "7x1", "0c"),
     Conv(320, "3x3", "1a", 2, VALID)),
    (Pool("Max", "3x3", "1a", 2, VALID),),
)
INCEPTION_C = (
    (Conv(256, "1x1", "0a"),),
    (Conv(384, "1x1", "0a"), Split(Conv(256, "1x3", "0b"), Conv(256, "3x1", "0c"))),
    (Conv(384, "1x1", "0a"), Conv(448, "3x1", "0b"), Conv(512, "1x3", "0c"),
     Split(Conv(256, "1x3", "0d"), Conv(256, "3x1", "0e"))),
    (Pool("Avg", "3x3", "0a"), Conv(256, "1x1", "0b")),
)

# The trunk in order: (end point, either a stem Conv or the branches of a mixed block).
STEM = (
    ("Conv2d_1a_3x3", Conv(32, "3x3", "1a", 2, VALID)),
    ("Conv2d_2a_3x3", Conv(32, "3x3", "2a", padding=VALID)),
    ("Conv2d_2b_3x3", Conv(64, "3x3", "2b")),
)
BLOCKS = (
    (("Mixed_3a", MIXED_3A), ("Mixed_4a", MIXED_4A), ("Mixed_5a", MIXED_5A))
    + tuple((f"Mixed_5{c}", INCEPTION_A) for c in "bcde")
    + (("Mixed_6a", REDUCTION_A),)
    + tuple((f"Mixed_6{c}", INCEPTION_B) for c in "bcdefgh")
    + (("Mixed_7a", REDUCTION_B),)
    + tuple((f"Mixed_7{c}", INCEPTION_C) for c in "bcd")
)


def _kernel(kernel: str) -> list[int]:
    rows, cols = kernel.split("x")
    return [int(rows), int(cols)]


def _apply(slim, tf, net, layer: Layer):
    if isinstance(layer, Conv):
        return slim.conv2d(net, layer.depth, _kernel(layer.kernel), stride=layer.stride,
                           padding=layer.padding, scope=layer.scope)
    if isinstance(layer, Pool):
        pool = slim.max_pool2d if layer.kind == "Max" else slim.avg_pool2d
        return pool(net, _kernel(layer.kernel), stride=layer.stride, padding=layer.padding,
                    scope=layer.scope)
    return tf.concat([_apply(slim, tf, net, layer.left), _apply(slim, tf, net, layer.right)],
                     axis=3)


def _mixed(slim, tf, net, branches):
    outputs = []
    for index, branch in enumerate(branches):
        with tf.compat.v1.variable_scope(f"Branch_{index}"):
            out = net
            for layer in branch:
                out = _apply(slim, tf, out, layer)
            outputs.append(out)
    return tf.concat(outputs, axis=3)


def arg_scope():
    """The Inception arg scope for inference: conv without biases, batch norm without gamma.

    Without it the restore fails with `.../biases not found in checkpoint`.
    """
    import tensorflow as tf

    slim = import_slim()
    batch_norm_params = {
        "decay": BATCH_NORM_DECAY,
        "epsilon": BATCH_NORM_EPSILON,
        "scale": False,
        "fused": None,
        "is_training": False,
    }
    with slim.arg_scope([slim.conv2d], weights_initializer=slim.variance_scaling_initializer(),
                        activation_fn=tf.nn.relu, normalizer_fn=slim.batch_norm,
                        normalizer_params=batch_norm_params) as scope:
        return scope


def build_inception_v4(images, *, num_classes: int = 0):
    """Builds Inception-V4 for inference in the current graph.

    Args:
      images: float32 tensor [N, 299, 299, 3] in [-1, 1].
      num_classes: 0 builds the trunk only (up to `PreLogitsFlatten`); otherwise also the
        `Logits` layer (1536 -> num_classes) and `Predictions`, as in the slim checkpoint.

    Returns:
      Dict of end point name -> tensor, in the contract's order (AuxLogits is never built).
    """
    import tensorflow as tf

    slim = import_slim()
    end_points = {}
    with slim.arg_scope(arg_scope()), tf.compat.v1.variable_scope(SCOPE, values=[images]):
        with slim.arg_scope([slim.conv2d, slim.max_pool2d, slim.avg_pool2d],
                            stride=1, padding="SAME"):
            net = images
            for name, conv in STEM:
                net = end_points[name] = _apply(slim, tf, net, conv)
            for name, branches in BLOCKS:
                with tf.compat.v1.variable_scope(name):
                    net = end_points[name] = _mixed(slim, tf, net, branches)
            with tf.compat.v1.variable_scope("Logits"):
                # 8 x 8 x 1536 -> 1 x 1 x 1536. Dropout is the identity at eval: not built.
                net = end_points["global_pool"] = slim.avg_pool2d(
                    net, net.shape[1:3], padding=VALID, scope="AvgPool_1a")
                net = end_points[PRELOGITS] = slim.flatten(net, scope=PRELOGITS)
                if num_classes:
                    logits = end_points["Logits"] = slim.fully_connected(
                        net, num_classes, activation_fn=None, scope="Logits")
                    end_points["Predictions"] = tf.nn.softmax(logits, name="Predictions")
    return end_points


def aux_logits_specs(num_classes: int = NUM_CLASSES) -> list[tuple[str, list[int]]]:
    """Names and shapes of the AuxLogits head of a slim checkpoint (training only, never built)."""
    scope = f"{SCOPE}/AuxLogits"
    bn = ("beta", "moving_mean", "moving_variance")
    return ([(f"{scope}/Conv2d_1b_1x1/weights", [1, 1, 1024, 128])]
            + [(f"{scope}/Conv2d_1b_1x1/BatchNorm/{n}", [128]) for n in bn]
            + [(f"{scope}/Conv2d_2a/weights", [5, 5, 128, 768])]
            + [(f"{scope}/Conv2d_2a/BatchNorm/{n}", [768]) for n in bn]
            + [(f"{scope}/Aux_logits/weights", [768, num_classes]),
               (f"{scope}/Aux_logits/biases", [num_classes])])


def variable_specs(*, num_classes: int = 0) -> list[tuple[str, list[int]]]:
    """Names and shapes of the variables `build_inception_v4` creates, in creation order.

    Derived from the block tables without TensorFlow, so that checkpoints can be checked,
    digested and written without building the graph; a test holds it equal to the built graph.
    """
    specs: list[tuple[str, list[int]]] = []

    def conv(prefix: str, layer: Conv, cin: int) -> int:
        rows, cols = _kernel(layer.kernel)
        scope = f"{prefix}/{layer.scope}"
        specs.append((f"{scope}/weights", [rows, cols, cin, layer.depth]))
        for name in ("beta", "moving_mean", "moving_variance"):
            specs.append((f"{scope}/BatchNorm/{name}", [layer.depth]))
        return layer.depth

    def layer_out(prefix: str, layer: Layer, cin: int) -> int:
        if isinstance(layer, Conv):
            return conv(prefix, layer, cin)
        if isinstance(layer, Pool):
            return cin
        return conv(prefix, layer.left, cin) + conv(prefix, layer.right, cin)

    channels = 3
    for _, layer in STEM:
        channels = conv(SCOPE, layer, channels)
    for name, branches in BLOCKS:
        total = 0
        for index, branch in enumerate(branches):
            cin = channels
            for layer in branch:
                cin = layer_out(f"{SCOPE}/{name}/Branch_{index}", layer, cin)
            total += cin
        channels = total
    assert channels == FEATURE_DIM
    if num_classes:
        specs.append((f"{LOGITS_SCOPE}/weights", [FEATURE_DIM, num_classes]))
        specs.append((f"{LOGITS_SCOPE}/biases", [num_classes]))
    return specs
