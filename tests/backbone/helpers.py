"""Small image makers shared by the backbone tests."""
import io

import numpy as np
from PIL import Image


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
