"""Typed errors of the trunk layer. No HTTP here: the service maps them to statuses."""


class BackboneError(Exception):
    """Base class of every error the trunk layer raises on purpose."""


class InvalidImage(BackboneError, ValueError):
    """The bytes are not a decodable image (truncated, not an image, unsupported)."""


class ImageTooLarge(InvalidImage):
    """The image has more pixels than allowed (decompression-bomb guard)."""


class CheckpointError(BackboneError):
    """A trunk checkpoint is missing, unreadable or does not match the Inception-V4 layout."""


class PrecisionUnsupported(BackboneError):
    """The requested trunk precision cannot run natively on this device (never emulated)."""


class RuntimeUnavailable(BackboneError):
    """The requested trunk runtime is not installed or cannot run on this device."""


class Int8ArtifactMissing(PrecisionUnsupported):
    """Precision "int8" was asked for and no INT8 trunk was calibrated for this checkpoint
    (`multihead quantize` makes one)."""
