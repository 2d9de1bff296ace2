"""Per-bot heads as data: checkpoint format, registry, resident cache, training, slim import.

A bot is a fully connected head `weights [1536, n]`, `biases [n]` with n labels, applied with
numpy to the shared trunk's features; registering, replacing or removing one never touches the
TF graph. `import heads` does not import TensorFlow (only writing/reading checkpoints does).

    store = HeadStore("checkpoints")
    store.register("acme", weights, biases, ["cat", "dog"])    # -> version 1
    head = store.get("acme")
    head.top_k(trunk.features(images), k=3)
"""
from heads.errors import (
                          HeadLoadError,
                          HeadsError,
                          InvalidBotId,
                          InvalidHead,
                          InvalidTrainingData,
                          TrunkMismatch,
                          UnknownBot,
                          UnknownVersion,
)
from heads.files import read_labels
from heads.head import Head, top_indices, validate_bot_id
from heads.store import BotInfo, HeadStore
from heads.train import TrainResult, extract_features, scan_image_folder, train_head

__all__ = [
    "BotInfo", "Head", "HeadLoadError", "HeadStore", "HeadsError", "InvalidBotId",
    "InvalidHead", "InvalidTrainingData", "TrainResult", "TrunkMismatch", "UnknownBot",
    "UnknownVersion", "extract_features", "read_labels", "scan_image_folder",
    "top_indices", "train_head",
    "validate_bot_id",
]
