"""Small image makers, graph cache helpers and a fake runner shared by the backbone tests."""
from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
from PIL import Image

from backbone.runners.base import Layout, LoadReport, LoadRequest, Runner, RunnerInfo
from backbone.runners.registry import ANYWHERE, RunnerSpec
from backbone.spec import FEATURE_DIM, IMAGE_SIZE


def encode(image: Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


def pattern(seed: int, size=(320, 240)) -> Image.Image:
    """A deterministic image with structure (blocks of colour and a gradient)."""
    rng = np.random.default_rng(seed)
    width, height = size
    blocks = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
    big = np.kron(blocks, np.ones((height // 6 + 1, width // 8 + 1, 1), np.uint8))[:height, :width]
    ramp = np.linspace(0, 60, width, dtype=np.float32)[None, :, None]
    return Image.fromarray(np.clip(big + ramp, 0, 255).astype(np.uint8), "RGB")


def write_v1_checkpoint(source_prefix: str, path) -> str:
    """Copies the trunk, Logits and AuxLogits of a checkpoint into a V1 single-file checkpoint
    at `path`, the format of the official model-zoo `inception_v4.ckpt`. Returns its path."""
    import tensorflow as tf

    from backbone.inception_v4 import aux_logits_specs, variable_specs

    reader = tf.train.load_checkpoint(source_prefix)
    graph = tf.Graph()
    with graph.as_default():
        for name, _ in variable_specs(num_classes=1001) + aux_logits_specs():
            tf.compat.v1.get_variable(name, initializer=reader.get_tensor(name))
        saver = tf.compat.v1.train.Saver(write_version=tf.compat.v1.train.SaverDef.V1)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            return saver.save(session, str(path), write_meta_graph=False)


def graph_cache_of(prefix: str) -> Path:
    """Where `serve` keeps the graph of a trunk checkpoint: graph_cache/ next to it."""
    return Path(prefix).parent / "graph_cache"


def copy_graphs(source: Path, directory: Path) -> Path:
    """Copies the saved TF graphs of a graph cache (not its compiled OpenVINO models nor INT8
    trunks, nor another process's half-written temporary files) into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    for path in Path(source).glob("inception_v4-*"):
        if path.suffix in (".meta", ".json") and not path.name.startswith(
                ("inception_v4-ov-", "inception_v4-int8-")):
            shutil.copy2(path, directory / path.name)
    return directory


def concurrent_features(trunk, batches: list) -> list:
    """`trunk.features` of each batch, all called at once from one thread per batch."""
    import threading

    results = [None] * len(batches)
    start = threading.Barrier(len(batches))

    def work(i):
        start.wait()
        results[i] = trunk.features(batches[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


STRIDE = 23  # the fake samples every 23rd pixel: 13 x 13 x 3 values per image
SAMPLED = len(range(0, IMAGE_SIZE, STRIDE)) ** 2 * 3


class FakeRunner(Runner):
    """A runner in pure numpy, registered by tests only (`backbone.runners.registry.registered`
    with `FAKE`): features = a fixed random projection of a sparse sample of the pixels,
    deterministic, different for different images, [N, 1536] float32; no weights, no Logits."""

    def __init__(self, request: LoadRequest):
        self.info = RunnerInfo("fake", request.precision, request.device)
        self.layout = Layout([], {}, 0)
        self.report = LoadReport()
        self.projection = np.random.default_rng(0).standard_normal(
            (SAMPLED, FEATURE_DIM)).astype(np.float32)
        self.closed = False

    @classmethod
    def load(cls, request: LoadRequest) -> FakeRunner:
        return cls(request)

    def features(self, images: np.ndarray) -> np.ndarray:
        sampled = images[:, ::STRIDE, ::STRIDE, :].reshape(len(images), -1)  # [N, 507]
        # One image at a time: a batched product may sum in another order (batch-invariant).
        return np.stack([row @ self.projection for row in sampled])  # [N, 1536]

    def features_and_logits(self, images):
        raise NotImplementedError("the fake has no Logits layer")

    def close(self) -> None:
        self.closed = True


# Runs anywhere, fp32 only, installed (no package), ranked last (TensorFlow's rank is 100): `auto`
# never picks it unless a test ranks it first.
FAKE = RunnerSpec(name="fake", title="Fake", precisions={"fp32": ANYWHERE}, rank=1000)


def png_header(width: int, height: int, bit_depth: int = 8, colour_type: int = 2) -> bytes:
    """A PNG of that size and depth whose pixel data is missing: its header reads, its decode
    fails (cheap, whatever the size it declares)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, colour_type, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0"))
            + chunk(b"IEND", b""))
