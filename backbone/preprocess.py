"""Eval-time Inception preprocessing with Pillow and numpy (no TensorFlow in the request path).

Reference: slim's `inception_preprocessing.preprocess_for_eval` (central_fraction=0.875):
  1. uint8 -> float32 in [0, 1];
  2. `tf.image.central_crop`: keep the central 87.5% of EACH side, offset
     int((dim - dim * 0.875) / 2), size dim - 2 * offset;
  3. `tf.compat.v1.image.resize_bilinear(align_corners=False, half_pixel_centers=False)` to
     299 x 299, aspect ratio not kept: source coordinate = dst * in / out (legacy TF1
     sampling, not TF2's half-pixel centres and not Pillow's antialiased resize);
  4. (x - 0.5) * 2 -> [-1, 1].
Steps 2-4 are reproduced exactly in numpy (same sampling grid and lerp weights; float32
rounding differs by ~1e-6, measured against TF in tests/backbone/test_preprocess.py).

Decoding differs from TF only where it is a deliberate choice:
  - EXIF orientation is applied (TF's decode_jpeg ignores it; phones rely on it);
  - every common mode becomes RGB: L/LA/P/RGBA/CMYK via Pillow's conversions (alpha dropped,
    as `decode_png(channels=3)` does), 16-bit (I;16*, I) scaled by 1/65535, F clipped to [0,1];
  - JPEGs much larger than needed are decoded with Pillow's draft mode (DCT-domain downscale
    by 1/2, 1/4 or 1/8, never below the size the crop needs), which cuts decode time of a 12 Mpx
    photo several-fold; the result then goes through the same crop and bilinear resize.
"""
from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image, ImageOps

from backbone.errors import ImageTooLarge, InvalidImage
from backbone.spec import IMAGE_SIZE, INPUT

CENTRAL_FRACTION = INPUT.central_fraction
# Refuse images with more pixels than this before decoding them (decompression bombs).
DEFAULT_MAX_PIXELS = 40_000_000
# The draft size keeps at least this many source pixels per output pixel after the crop.
_DRAFT_SIDE = int(np.ceil(IMAGE_SIZE / CENTRAL_FRACTION))


def decode_image(data: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS,
                 draft: bool = True) -> np.ndarray:
    """Decodes image bytes to float32 RGB [H, W, 3] in [0, 1], EXIF orientation applied.

    Raises:
      InvalidImage: empty, truncated, or not an image Pillow can decode.
      ImageTooLarge: more than `max_pixels` pixels (checked from the header, before decoding).
    """
    image = _decode(data, max_pixels=max_pixels, draft=draft)
    if image.dtype == np.uint8:
        return image.astype(np.float32) / np.float32(255.0)
    return image


class _BufferFile(io.RawIOBase):
    """A read-only file over a buffer (bytearray, memoryview) that copies only what is read."""

    def __init__(self, data) -> None:
        super().__init__()
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), len(self._view) - self._pos))
        buffer[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


def _file_of(data) -> io.IOBase:
    """A file over the image bytes without copying them: BytesIO shares a bytes object, and an
    upload read into a bytearray (often megabytes, mostly trailing bytes the decoder never
    reads) is read through a view."""
    if isinstance(data, bytes):
        return io.BytesIO(data)
    return io.BufferedReader(_BufferFile(data))


def _decode(data: bytes | bytearray, *, max_pixels: int, draft: bool) -> np.ndarray:
    """RGB [H, W, 3]: uint8 for 8-bit images (most), float32 in [0, 1] for deeper ones."""
    if not data:
        raise InvalidImage("empty image")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(_file_of(data))
            width, height = image.size
            if width * height > max_pixels:
                raise ImageTooLarge(f"image has {width}x{height} = {width * height} pixels, "
                                    f"more than the limit of {max_pixels}")
            if draft and image.format == "JPEG":
                # Picks the largest DCT scale that keeps both sides >= the requested size.
                image.draft("RGB", (_DRAFT_SIDE, _DRAFT_SIDE))
            image.load()
            image = ImageOps.exif_transpose(image)
            return _to_rgb(image)
    except ImageTooLarge:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageTooLarge(f"image refused as a decompression bomb: {exc}") from None
    except Image.UnidentifiedImageError:
        raise InvalidImage("not a recognised image format") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise InvalidImage(f"cannot decode image: {exc}") from None


def _to_rgb(image: Image.Image) -> np.ndarray:
    mode = image.mode
    if mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        gray = np.asarray(image, dtype=np.float32) / 65535.0
        return np.repeat(np.clip(gray, 0.0, 1.0)[:, :, None], 3, axis=2)
    if mode == "F":
        gray = np.clip(np.asarray(image, dtype=np.float32), 0.0, 1.0)
        return np.repeat(gray[:, :, None], 3, axis=2)
    if mode != "RGB":
        image = image.convert("RGB")  # L, LA, P, PA, RGBA, CMYK, YCbCr, 1, ...
    return np.asarray(image)


def central_crop(image: np.ndarray, fraction: float = CENTRAL_FRACTION) -> np.ndarray:
    """`tf.image.central_crop`: the central `fraction` of each side of [H, W, C]."""
    height, width = image.shape[:2]
    top = int((height - height * fraction) / 2)
    left = int((width - width * fraction) / 2)
    return image[top:height - top, left:width - left]


def _axis_weights(size_in: int, size_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # Legacy TF bilinear (align_corners=False, half_pixel_centers=False): src = dst * in/out,
    # computed in float32 as TF's kernel does, so that the lerp weights match bit for bit.
    scale = np.float32(size_in) / np.float32(size_out)
    src = np.arange(size_out, dtype=np.float32) * scale
    lower = np.floor(src)
    upper = np.minimum(np.ceil(src), size_in - 1).astype(np.int64)
    return lower.astype(np.int64), upper, (src - lower).astype(np.float32)


def resize_bilinear(image: np.ndarray, height: int = IMAGE_SIZE,
                    width: int = IMAGE_SIZE) -> np.ndarray:
    """`tf.compat.v1.image.resize_bilinear` (legacy sampling) of [H, W, C] -> float32.

    The four neighbours are gathered in the input's dtype (uint8 is 4x less to move) and
    only then converted; the lerps run in float32 in TF's order (columns, then rows).
    """
    top, bottom, dy = _axis_weights(image.shape[0], height)
    left, right, dx = _axis_weights(image.shape[1], width)
    upper, lower = image[top], image[bottom]
    dx = dx[None, :, None]
    top_left, top_right = upper[:, left].astype(np.float32), upper[:, right].astype(np.float32)
    bottom_left = lower[:, left].astype(np.float32)
    bottom_right = lower[:, right].astype(np.float32)
    rows_top = top_left + (top_right - top_left) * dx
    rows_bottom = bottom_left + (bottom_right - bottom_left) * dx
    return rows_top + (rows_bottom - rows_top) * dy[:, None, None]


def preprocess_array(image: np.ndarray) -> np.ndarray:
    """Crop, resize and scale RGB [H, W, 3] -> float32 [299, 299, 3] in [-1, 1].

    Args:
      image: uint8 in [0, 255], or float32 in [0, 1] (as slim's `convert_image_dtype` makes).
    """
    resized = resize_bilinear(central_crop(image))
    if image.dtype == np.uint8:
        # (x / 255 - 0.5) * 2 in one multiply-add; differs from TF's order by < 1e-6.
        return (resized * np.float32(2.0 / 255.0) - np.float32(1.0)).astype(np.float32, copy=False)
    return ((resized - 0.5) * 2.0).astype(np.float32, copy=False)


def preprocess(data: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """Image bytes -> float32 [299, 299, 3] in [-1, 1], ready for `Trunk.features`.

    Raises:
      InvalidImage / ImageTooLarge: see `decode_image`.
    """
    return preprocess_array(_decode(data, max_pixels=max_pixels, draft=True))
