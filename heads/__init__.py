"""Per-bot heads as data: the head maths, the checkpoint format and files, training, slim
import, the resident cache, and the generated labelled images the demo and the benchmark train
heads on (`heads.demo_images`). Knows nothing of tenants, stores or HTTP.

A bot is a fully connected head `weights [1536, n]`, `biases [n]` with n labels, applied with
numpy to the shared trunk's features; registering, replacing or removing one never touches the
TF graph. `import heads` does not import TensorFlow (only writing/reading checkpoints does).

    head = Head("acme", 1, weights, biases, ("cat", "dog"))
    head.top_k(trunk.features(images), k=3)

Where bots are kept (a directory or PostgreSQL) is the `store` package's; who owns them
(tenants, keys, audit, candidates) the `accounts` package's.
"""
from heads.errors import (
    HeadLoadError,
    HeadsError,
    InvalidBotId,
    InvalidHead,
    InvalidLabel,
    InvalidTrainingData,
    TrunkMismatch,
    UnknownBot,
)
from heads.files import read_labels
from heads.head import MAX_LABEL_CHARS, Head, escape_text, top_indices, validate_bot_id
from heads.train import TrainResult, extract_features, scan_image_folder, train_head

__all__ = [
    "MAX_LABEL_CHARS", "Head", "HeadLoadError", "HeadsError", "InvalidBotId", "InvalidHead",
    "InvalidLabel", "InvalidTrainingData", "TrainResult", "TrunkMismatch", "UnknownBot",
    "escape_text", "extract_features", "read_labels", "scan_image_folder", "top_indices",
    "train_head", "validate_bot_id",
]
