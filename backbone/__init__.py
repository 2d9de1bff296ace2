"""The shared Inception-V4 trunk: built once, restored from a slim checkpoint; preprocessing.

Knows nothing of bots or HTTP. TensorFlow is imported lazily: `from backbone import preprocess`
does not load it.
"""
from backbone.device import Device, detect_device
from backbone.errors import BackboneError, CheckpointError, ImageTooLarge, InvalidImage
from backbone.inception_v4 import LOGITS_SCOPE, NUM_CLASSES, PRELOGITS, SCOPE
from backbone.preprocess import DEFAULT_MAX_PIXELS, decode_image, preprocess
from backbone.spec import FEATURE_DIM, IMAGE_SIZE, INPUT, InputSpec

_LAZY = {
    "Trunk": "backbone.trunk",
    "TrunkTimings": "backbone.trunk",
    "write_random_checkpoint": "backbone.checkpoint",
    "trunk_digest": "backbone.checkpoint",
    "default_trunk_checkpoint": "backbone.checkpoint",
    "resolve_prefix": "backbone.checkpoint",
    "check_layout": "backbone.checkpoint",
    "PrecisionUnsupported": "backbone.errors",
    "Int8ArtifactMissing": "backbone.errors",
    "RuntimeUnavailable": "backbone.errors",
    "PRECISIONS": "backbone.precision",
    "RUNTIMES": "backbone.precision",
    "resolve_precision": "backbone.precision",
    "resolve_runtime": "backbone.precision",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'backbone' has no attribute {name!r}")


__all__ = ["Device", "detect_device", "BackboneError", "CheckpointError", "ImageTooLarge",
           "InvalidImage", "FEATURE_DIM", "IMAGE_SIZE", "INPUT", "InputSpec", "LOGITS_SCOPE",
           "NUM_CLASSES", "PRELOGITS", "SCOPE", "DEFAULT_MAX_PIXELS", "decode_image", "preprocess",
           *_LAZY]
