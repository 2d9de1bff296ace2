"""What the trunk takes and what it gives, in one place and without TensorFlow.

Like timm's `default_cfg`, the preprocessing contract lives beside the model rather than being
retyped by each caller: `backbone.preprocess` implements it, the service checks preprocessed
uploads against it, and the protocol codecs describe it in their metadata.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InputSpec:
    """The eval-time input of the official slim Inception-V4 (`inception_preprocessing`).

    Attributes:
        image_size: side of the square input, in pixels.
        channels: RGB.
        central_fraction: fraction of each side kept by the central crop before the resize.
        value_range: range of the float32 values the trunk is fed ((x - 0.5) * 2).
    """

    image_size: int = 299
    channels: int = 3
    central_fraction: float = 0.875
    value_range: tuple[float, float] = (-1.0, 1.0)

    @property
    def shape(self) -> tuple[int, int, int]:
        """One image: (height, width, channels)."""
        return (self.image_size, self.image_size, self.channels)

    def describe(self) -> str:
        """One line for error messages: what a preprocessed image must be."""
        low, high = self.value_range
        return (f"float32 [{self.image_size}, {self.image_size}, {self.channels}] in "
                f"[{low:g}, {high:g}] (Inception preprocessing: central crop of "
                f"{self.central_fraction:g}, bilinear resize, (x - 0.5) * 2)")


INPUT = InputSpec()
IMAGE_SIZE = INPUT.image_size
# Width of the pre-logits features (`PreLogitsFlatten`): the seam between trunk and heads.
FEATURE_DIM = 1536
