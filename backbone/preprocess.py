"""Eval-time Inception preprocessing with Pillow and numpy (no TensorFlow in the request path).

Reference: slim's `inception_preprocessing.preprocess_for_eval` (central_fraction=0.875):
  1. uint8 -> float32 in [0, 1];
  2. `tf.image.central_crop`: keep the central 87.5% of EACH side, offset
     int((dim - dim * 0.875) / 2), size dim - 2 * offset;
  3. `tf.compat.v1.image.resize_bilinear(align_corners=False, half_pixel_centers=False)` to
     299 x 299, aspect ratio not kept: source coordinate = dst * in / out (legacy TF1
     sampling, not TF2's half-pixel centres and not Pillow's antialiased resize);
  4. (x - 0.5) * 2 -> [-1, 1].
Steps 2-4 are reproduced exactly in numpy by `preprocess_array` (same sampling grid and lerp
weights; float32 rounding differs by ~1e-6, measured against TF in
tests/backbone/test_preprocess.py).

`preprocess` (image bytes, the request path) takes a faster route for the common case, an 8-bit
image whose crop is at least 299 pixels on each side (a downscale): OpenCV's `remap` samples the
SAME legacy grid (offset by the crop; the maps kept per image size) with bilinear weights, on
the uint8 pixels, in vectorised C that releases the GIL: about 0.3 ms for a 640 x 480 photo,
where Pillow's affine transform (the route before, issue 31) took 1.5-1.9 ms on one core.
OpenCV interpolates at coordinates rounded to 1/32 of a pixel with 15-bit weights and rounds
the result: unbiased, on photos a quarter of a uint8 step from the exact path on average
(Pillow's route: the same) and at most 4.3 steps on a sharp edge (on pure noise, where
neighbours differ by up to 255, at most 6.5); the features stay within cosine 0.9999 of the
exact path's on real photos (0.9999998 measured; tests/backbone/test_preprocess.py).
Smaller images (an upscale), 16-bit and float images, images with a side over REMAP_MAX_SIDE
(OpenCV's int16 coordinates) and `exact=True` take the exact path.

Decoding differs from TF only where it is a deliberate choice:
  - EXIF orientation is applied (TF's decode_jpeg ignores it; phones rely on it);
  - every common mode becomes RGB: L/LA/P/RGBA/CMYK via Pillow's conversions (alpha dropped,
    as `decode_png(channels=3)` does), 16-bit (I;16*, I) scaled by 1/65535, F clipped to [0,1];
  - JPEGs much larger than needed are decoded with Pillow's draft mode (DCT-domain downscale
    by 1/2, 1/4 or 1/8, never below the size the crop needs), which cuts decode time of a 12 Mpx
    photo several-fold; the result then goes through the same crop and bilinear resize.
"""
from __future__ import annotations

import contextlib
import functools
import io
import warnings
from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np
from PIL import Image, ImageOps

from backbone.errors import ImageTooLarge, InvalidImage
from backbone.spec import IMAGE_SIZE, INPUT

CENTRAL_FRACTION = INPUT.central_fraction
# Refuse images with more pixels than this before decoding them (decompression bombs).
DEFAULT_MAX_PIXELS = 40_000_000
# The longest side `cv2.remap` takes (its fixed-point maps hold int16 coordinates: it asserts
# every side < 32,767); a longer side takes the exact path.
REMAP_MAX_SIDE = 32_766
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


_DEEP_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")


def _decode(data: bytes | bytearray, *, max_pixels: int, draft: bool) -> np.ndarray:
    """RGB [H, W, 3]: uint8 for 8-bit images (most), float32 in [0, 1] for deeper ones."""
    return _to_rgb(_open(data, max_pixels=max_pixels, draft=draft))


class Header(NamedTuple):
    """What an image's header says, before any pixel is decoded (`peek`)."""

    width: int
    height: int
    mode: str  # Pillow's mode of the decoded image ("RGB", "L", "I;16", ...)
    bits: int  # bits per sample as stored: 8, 16 (16-bit PNG, also as "RGB"), 32 (I, F)

    @property
    def pixels(self) -> int:
        return self.width * self.height


# The decode cost of one reference image: 640 x 480 RGB, 8 bits per sample.
REFERENCE_DECODE_BYTES = 640 * 480 * 3


def decode_cost(header: Header) -> float:
    """The cost of decoding an image, in reference images (`REFERENCE_DECODE_BYTES`): its
    pixels x 3 samples x bytes per sample / 640 x 480 x 3 bytes, at least 1. A 36-megapixel
    16-bit PNG costs 36e6 x 6 / 921600 = 234."""
    return max(1.0, header.pixels * 3 * (header.bits // 8) / REFERENCE_DECODE_BYTES)


def _bits(image: Image.Image) -> int:
    if image.mode in ("I", "F"):
        return 32
    if image.mode.startswith("I;16"):
        return 16
    # A 16-bit RGB(A) PNG opens as 8-bit RGB; its tile's raw mode tells the stored depth.
    raw = image.tile[0][3] if image.tile and len(image.tile[0]) > 3 else None
    return 16 if isinstance(raw, str) and ";16" in raw else 8


def peek(data: bytes | bytearray) -> Header:
    """The image's size, mode and bit depth, read from its header only (no pixel decoded).

    Raises:
      InvalidImage: empty, or not an image Pillow recognises.
      ImageTooLarge: a decompression bomb by Pillow's own limit (the pixel limit is not
        checked here).
    """
    with _errors():
        image = _opened(data)
        return Header(image.width, image.height, image.mode, _bits(image))


@contextlib.contextmanager
def _errors() -> Iterator[None]:
    """Pillow's errors as `InvalidImage` / `ImageTooLarge`."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            yield
    except ImageTooLarge:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageTooLarge(f"image refused as a decompression bomb: {exc}") from None
    except Image.UnidentifiedImageError:
        raise InvalidImage("not a recognised image format") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise InvalidImage(f"cannot decode image: {exc}") from None


def _opened(data: bytes | bytearray) -> Image.Image:
    """The image opened, its header read (call within `_errors`)."""
    if not data:
        raise InvalidImage("empty image")
    return Image.open(_file_of(data))


def _open(data: bytes | bytearray, *, max_pixels: int, draft: bool) -> Image.Image:
    """The decoded image, EXIF orientation applied: RGB for 8-bit images, 16-bit and float
    modes as they are (see `_to_rgb`)."""
    with _errors():
        image = _opened(data)
        width, height = image.size
        if width * height > max_pixels:
            raise ImageTooLarge(f"image has {width}x{height} = {width * height} pixels, "
                                f"more than the limit of {max_pixels}")
        if draft and image.format == "JPEG":
            # Picks the largest DCT scale that keeps both sides >= the requested size.
            image.draft("RGB", (_DRAFT_SIDE, _DRAFT_SIDE))
        image.load()
        image = ImageOps.exif_transpose(image)
        if image.mode not in _DEEP_MODES and image.mode != "RGB":
            image = image.convert("RGB")  # L, LA, P, PA, RGBA, CMYK, YCbCr, 1, ...
        return image


def _to_rgb(image: Image.Image) -> np.ndarray:
    """The whole image as RGB [H, W, 3]: uint8, or float32 in [0, 1] for the deep modes
    (grey, repeated on the three channels)."""
    if image.mode in _DEEP_MODES:
        return np.repeat(_unit(image.mode)(np.asarray(image))[:, :, None], 3, axis=2)
    return np.asarray(image)  # RGB (`_open`)


def _unit(mode: str) -> Callable[[np.ndarray], np.ndarray]:
    """A deep mode's grey values -> float32 in [0, 1] (16-bit and 32-bit integers / 65535)."""
    def unit(pixels: np.ndarray) -> np.ndarray:
        grey = pixels.astype(np.float32)
        if mode != "F":
            grey = grey / 65535.0
        return np.clip(grey, 0.0, 1.0)

    return unit


def _deep_to_input(image: Image.Image) -> np.ndarray:
    """`preprocess_array(_to_rgb(image))` of a deep-mode (grey) image, bit for bit, without
    converting the whole image: the crop and the resize gather the 4 x 299 x 299 pixels they
    read from the grey values as decoded, and only those are scaled (`_unit`). A 36-megapixel
    16-bit PNG is then its decode plus milliseconds, not 400 MB of float arrays."""
    grey = np.asarray(image)
    resized = resize_bilinear(central_crop(grey[:, :, None]), pixel=_unit(image.mode))
    out = ((resized - 0.5) * 2.0).astype(np.float32, copy=False)
    return np.repeat(out, 3, axis=2)


def central_crop(image: np.ndarray, fraction: float = CENTRAL_FRACTION) -> np.ndarray:
    """`tf.image.central_crop`: the central `fraction` of each side of [H, W, C]."""
    top, left, crop_h, crop_w = _crop_box(*image.shape[:2], fraction)
    return image[top:top + crop_h, left:left + crop_w]


def _axis_weights(size_in: int, size_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # Legacy TF bilinear (align_corners=False, half_pixel_centers=False): src = dst * in/out,
    # computed in float32 as TF's kernel does, so that the lerp weights match bit for bit.
    scale = np.float32(size_in) / np.float32(size_out)
    src = np.arange(size_out, dtype=np.float32) * scale
    lower = np.floor(src)
    upper = np.minimum(np.ceil(src), size_in - 1).astype(np.int64)
    return lower.astype(np.int64), upper, (src - lower).astype(np.float32)


def _as_float32(pixels: np.ndarray) -> np.ndarray:
    return pixels.astype(np.float32)


def resize_bilinear(image: np.ndarray, height: int = IMAGE_SIZE,
                    width: int = IMAGE_SIZE, *,
                    pixel: Callable[[np.ndarray], np.ndarray] = _as_float32) -> np.ndarray:
    """`tf.compat.v1.image.resize_bilinear` (legacy sampling) of [H, W, C] -> float32.

    The four neighbours are gathered in the input's dtype (uint8 is 4x less to move) and
    only then converted (`pixel`: to float32, or any elementwise map to float32 that the
    caller would otherwise apply to the whole image first); the lerps run in float32 in TF's
    order (columns, then rows).
    """
    top, bottom, dy = _axis_weights(image.shape[0], height)
    left, right, dx = _axis_weights(image.shape[1], width)
    upper, lower = image[top], image[bottom]
    dx = dx[None, :, None]
    top_left, top_right = pixel(upper[:, left]), pixel(upper[:, right])
    bottom_left, bottom_right = pixel(lower[:, left]), pixel(lower[:, right])
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


def _crop_box(height: int, width: int,
              fraction: float = CENTRAL_FRACTION) -> tuple[int, int, int, int]:
    """(top, left, crop height, crop width) of `central_crop`."""
    top = int((height - height * fraction) / 2)
    left = int((width - width * fraction) / 2)
    return top, left, height - 2 * top, width - 2 * left


def _downscale_8bit(image: Image.Image) -> np.ndarray:
    """The central crop of an RGB image resized to 299 x 299 by OpenCV on the legacy grid, as
    float32 in [-1, 1] (the fast route of `preprocess`; see the module doc)."""
    cv2 = _cv2()
    maps = _legacy_maps(image.height, image.width)
    resized = cv2.remap(np.asarray(image), *maps, cv2.INTER_LINEAR)
    out = np.multiply(resized, np.float32(2.0 / 255.0), dtype=np.float32)
    return np.subtract(out, np.float32(1.0), out=out)


@functools.cache
def _cv2():
    """OpenCV, imported once, without a thread pool of its own: the request path's threads
    are the decode pool's (`service.core.cores` keeps them off the trunk's cores)."""
    import cv2

    cv2.setNumThreads(1)
    return cv2


def prepare() -> None:
    """Imports what `preprocess`'s fast route needs (OpenCV, about 0.1 s) now, at start-up,
    rather than in the first request."""
    _cv2()


@functools.lru_cache(maxsize=8)  # ~0.5 MB each; uploads come in a few sizes
def _legacy_maps(height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """`cv2.remap`'s fixed-point maps that sample output pixel (y, x) at source
    (top + y * crop_h / 299, left + x * crop_w / 299): the legacy grid of
    `resize_bilinear`, offset by the central crop (scale computed in float32, as TF's kernel
    does). Within the crop: for a downscale the last row read is below crop_h - 1."""
    cv2 = _cv2()
    top, left, crop_h, crop_w = _crop_box(height, width)
    scale_y = np.float32(crop_h) / np.float32(IMAGE_SIZE)
    scale_x = np.float32(crop_w) / np.float32(IMAGE_SIZE)
    steps = np.arange(IMAGE_SIZE, dtype=np.float32)
    xs, ys = np.meshgrid(left + steps * scale_x, top + steps * scale_y)
    maps = cv2.convertMaps(xs.astype(np.float32), ys.astype(np.float32), cv2.CV_16SC2)
    for m in maps:
        m.flags.writeable = False
    return maps


def preprocess(data: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS,
               exact: bool = False) -> np.ndarray:
    """Image bytes -> float32 [299, 299, 3] in [-1, 1], ready for `Trunk.features`.

    Args:
      exact: always the exact numpy path (`preprocess_array`); by default an 8-bit image whose
        crop is at least 299 on each side takes Pillow's faster, near-exact route (module doc).

    Raises:
      InvalidImage / ImageTooLarge: see `decode_image`.
    """
    image = _open(data, max_pixels=max_pixels, draft=True)
    if image.mode in _DEEP_MODES:
        return _deep_to_input(image)
    if not exact:
        _, _, crop_h, crop_w = _crop_box(image.height, image.width)
        if min(crop_h, crop_w) >= IMAGE_SIZE and max(image.height, image.width) <= REMAP_MAX_SIDE:
            return _downscale_8bit(image)
    return preprocess_array(_to_rgb(image))
