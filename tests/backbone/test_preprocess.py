"""Eval preprocessing: values, modes, EXIF, bad input, bombs, and closeness to TF's resize."""

import numpy as np
import pytest
from PIL import Image

from backbone import ImageTooLarge, InvalidImage, preprocess
from backbone.preprocess import (
    REFERENCE_DECODE_BYTES,
    Header,
    central_crop,
    decode_cost,
    decode_image,
    peek,
    preprocess_array,
)
from tests.backbone.helpers import encode, pattern, png_header


@pytest.mark.parametrize("value", [0, 51, 128, 255])
def test_uniform_gray_maps_to_the_expected_constant(value):
    out = preprocess(encode(Image.new("RGB", (123, 77), (value, value, value))))
    assert out.shape == (299, 299, 3) and out.dtype == np.float32
    np.testing.assert_allclose(out, (value / 255 - 0.5) * 2, atol=1e-6)


def _red(mode):
    rgb = Image.new("RGB", (64, 48), (255, 0, 0))
    if mode == "RGB":
        return rgb
    if mode == "P":
        return rgb.convert("P")
    if mode == "RGBA":
        return Image.new("RGBA", (64, 48), (255, 0, 0, 128))
    if mode == "CMYK":
        return Image.new("CMYK", (64, 48), (0, 255, 255, 0))
    raise AssertionError(mode)


@pytest.mark.parametrize("mode,fmt", [("RGB", "PNG"), ("P", "PNG"), ("RGBA", "PNG"),
                                      ("CMYK", "JPEG"), ("CMYK", "TIFF")])
def test_colour_modes_become_rgb(mode, fmt):
    out = preprocess(encode(_red(mode), fmt))
    center = out[150, 150]
    assert center[0] > 0.9 and center[1] < -0.85 and center[2] < -0.85, (mode, center)


@pytest.mark.parametrize("mode", ["L", "LA"])
def test_gray_modes_become_rgb(mode):
    image = Image.new(mode, (40, 40), 200 if mode == "L" else (200, 10))
    out = preprocess(encode(image))
    np.testing.assert_allclose(out, (200 / 255 - 0.5) * 2, atol=1e-6)


def test_sixteen_bit_gray_is_scaled_not_clipped():
    image = Image.fromarray(np.full((30, 30), 49151, np.uint16))  # 0.75 of full scale
    assert image.mode.startswith("I;16")
    out = preprocess(encode(image))
    np.testing.assert_allclose(out, (49151 / 65535 - 0.5) * 2, atol=1e-5)


def test_exif_orientation_is_applied():
    # Stored 60x30, left half red, right half blue; orientation 6 = rotate 90 clockwise on display.
    array = np.zeros((30, 60, 3), np.uint8)
    array[:, :30] = (255, 0, 0)
    array[:, 30:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6
    data = encode(Image.fromarray(array), "JPEG", exif=exif, quality=95)
    decoded = decode_image(data)
    assert decoded.shape == (60, 30, 3)  # displayed upright: tall
    assert decoded[5, 15, 0] > 0.8 and decoded[55, 15, 2] > 0.8  # red on top, blue below


def test_truncated_jpeg_is_invalid():
    data = encode(pattern(1), "JPEG")
    with pytest.raises(InvalidImage):
        preprocess(data[: len(data) // 2])


@pytest.mark.parametrize("data", [b"", b"not an image at all", b"\x89PNG\r\n\x1a\n" + b"\0" * 40])
def test_non_images_are_invalid(data):
    with pytest.raises(InvalidImage):
        preprocess(data)


def test_decompression_bomb_is_refused_before_decoding():
    bomb = encode(Image.new("1", (12_000, 12_000)))  # 144 Mpx in a few kB
    assert len(bomb) < 100_000
    with pytest.raises(ImageTooLarge, match="144000000 pixels"):
        preprocess(bomb)
    with pytest.raises(ImageTooLarge):
        preprocess(encode(pattern(2)), max_pixels=1000)


def test_central_crop_keeps_87_5_percent_of_each_side():
    assert central_crop(np.zeros((375, 500, 3))).shape == (329, 438, 3)
    assert central_crop(np.zeros((299, 299, 3))).shape == (263, 263, 3)
    assert central_crop(np.zeros((342, 342, 3))).shape == (300, 300, 3)


@pytest.mark.parametrize("shape", [(375, 500), (299, 299), (90, 70), (1000, 700)])
def test_matches_slim_eval_preprocessing_in_tensorflow(shape):
    """The numpy pipeline against slim's ops (convert, central_crop, resize_bilinear legacy)."""
    import tensorflow as tf

    rng = np.random.default_rng(sum(shape))
    image = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
    ours = preprocess_array(image.astype(np.float32) / 255)
    from_uint8 = preprocess_array(image)  # the fast path: gather uint8, then convert
    x = tf.image.convert_image_dtype(tf.constant(image), tf.float32)
    x = tf.image.central_crop(x, central_fraction=0.875)
    x = tf.compat.v1.image.resize_bilinear(x[None], [299, 299], align_corners=False)[0]
    reference = ((x - 0.5) * 2.0).numpy()
    # Measured: max |diff| 3.6e-7 (float32 rounding of the lerp).
    assert np.abs(ours - reference).max() < 2e-6
    assert np.abs(from_uint8 - reference).max() < 2e-6


def test_jpeg_draft_mode_is_close_to_a_full_decode():
    big = pattern(3, size=(2400, 1800)).resize((2400, 1800))
    data = encode(big, "JPEG", quality=92)
    fast = preprocess_array(decode_image(data))
    full = preprocess_array(decode_image(data, draft=False))
    # DCT-domain downscale then bilinear vs full decode then bilinear: small average change.
    assert np.abs(fast - full).mean() < 0.03


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_a_bytearray_or_view_upload_decodes_like_bytes(fmt):
    """Uploads arrive as a bytearray filled in place (see service.transports.http.app); trailing bytes after the
    image are ignored, as for bytes."""
    data = encode(pattern(5, size=(200, 150)), fmt)
    want = preprocess(data)
    for given in (bytearray(data), bytearray(data) + bytearray(5000), memoryview(data)):
        np.testing.assert_array_equal(preprocess(given), want)
    with pytest.raises(InvalidImage):
        preprocess(bytearray(b"not an image at all"))


# -- the fast route of `preprocess` (OpenCV's remap on uint8) -------------------------------


def _photos() -> list[Image.Image]:
    """Real photos that ship with the installed stack: scikit-learn's two sample photos (a
    dependency of NNCF) and matplotlib's portrait of Grace Hopper (the bench extra)."""
    import matplotlib.cbook
    from sklearn.datasets import load_sample_images

    photos = [Image.fromarray(array) for array in load_sample_images().images]
    with Image.open(matplotlib.cbook.get_sample_data("grace_hopper.jpg")) as hopper:
        photos.append(hopper.convert("RGB"))
    return photos


# Upload sizes: phone and camera photos, small web images, portrait and landscape; all crop to
# at least 299 on each side (the fast route), the largest through JPEG draft mode first.
PHOTO_SIZES = [(640, 480), (480, 640), (1024, 768), (343, 343), (2000, 1500), (4032, 3024)]


def _jpegs() -> list[bytes]:
    return [encode(photo.resize(size), "JPEG", quality=90)
            for photo in _photos() for size in PHOTO_SIZES]


@pytest.mark.parametrize("shape", [(342, 342), (375, 500), (1000, 700), (481, 641)])
def test_fast_route_on_pure_noise_is_unbiased_and_within_opencvs_grid_of_the_exact_path(shape):
    rng = np.random.default_rng(sum(shape))
    pixels = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
    data = encode(Image.fromarray(pixels))  # PNG: lossless, so both routes see these pixels
    fast, exact = preprocess(data), preprocess(data, exact=True)
    np.testing.assert_array_equal(exact, preprocess_array(pixels))
    steps = (fast - exact) / (2.0 / 255)  # in uint8 steps
    # OpenCV rounds each coordinate to 1/32 of a pixel: at most 1/64 of the neighbours'
    # difference (<= 255) per axis, plus its rounding of the result to half a step.
    assert np.abs(steps).max() <= 2 * 255 / 64 + 0.51  # measured 5.8-6.5 on noise
    assert np.abs(steps).mean() <= 1.0  # measured 0.87
    assert abs(steps.mean()) < 1 / 20  # unbiased
    assert not np.array_equal(fast, exact)  # it did take the fast route
    assert fast.min() >= -1 and fast.max() <= 1  # the trunk's input range (values 0 and 255)


def test_fast_route_on_photos_is_unbiased_and_off_by_a_quarter_step_on_average():
    steps = np.concatenate([((preprocess(j) - preprocess(j, exact=True)) / (2.0 / 255)).ravel()
                            for j in _jpegs()])
    # Measured on these 18 photos: mean |error| 0.22-0.29 of a step (Pillow's affine route
    # before: 0.25), at most 4.3 steps on a sharp edge.
    assert np.abs(steps).mean() <= 0.35
    assert np.abs(steps).max() <= 2 * 255 / 64 + 0.51
    assert abs(steps.mean()) < 1 / 50


def test_a_uniform_image_is_exact_on_the_fast_route():
    data = encode(Image.new("RGB", (640, 480), (0, 128, 255)), "PNG")
    np.testing.assert_array_equal(preprocess(data), preprocess(data, exact=True))


def test_an_image_longer_than_opencvs_coordinates_takes_the_exact_path():
    from backbone.preprocess import REMAP_MAX_SIDE

    for side in (REMAP_MAX_SIDE, REMAP_MAX_SIDE + 1):  # the fast route's last, the first past it
        ramp = np.linspace(0, 255, side).astype(np.uint8)
        pixels = np.repeat(np.repeat(ramp[None, :, None], 342, axis=0), 3, axis=2)
        data = encode(Image.fromarray(pixels))  # side x 342: within max_pixels
        fast, exact = preprocess(data), preprocess(data, exact=True)
        if side > REMAP_MAX_SIDE:
            np.testing.assert_array_equal(fast, exact)
        else:  # still OpenCV's (no error), within its grid of the exact path
            assert np.abs(fast - exact).max() <= (2 * 255 / 64 + 0.51) * (2.0 / 255)


def test_small_deep_or_exact_images_take_the_exact_path():
    small = encode(pattern(4, size=(300, 200)))  # crop 262 x 175: an upscale
    np.testing.assert_array_equal(preprocess(small), preprocess(small, exact=True))
    deep = encode(Image.fromarray(np.full((400, 400), 30000, np.uint16)))
    np.testing.assert_array_equal(preprocess(deep), preprocess(deep, exact=True))


def test_fast_route_features_stay_within_cosine_0_9999_of_the_exact_path(trunk):
    """The request path's fast route against the exact one, through the real trunk, on real
    photos at the sizes users upload (issue 20's bound for a preprocessing change)."""
    jpegs = _jpegs()
    fast = trunk.features(np.stack([preprocess(j) for j in jpegs]))
    exact = trunk.features(np.stack([preprocess(j, exact=True) for j in jpegs]))
    cosine = (fast * exact).sum(1) / (np.linalg.norm(fast, axis=1) * np.linalg.norm(exact, axis=1))
    assert cosine.min() >= 0.9999, cosine.min()
    assert not np.array_equal(fast, exact)


# -- peek and decode_cost: what a decode will cost, from the header ------------------------------


@pytest.mark.parametrize("image,fmt,header", [
    (Image.new("RGB", (640, 480)), "JPEG", Header(640, 480, "RGB", 8)),
    (Image.new("L", (30, 20)), "PNG", Header(30, 20, "L", 8)),
    (Image.new("I;16", (30, 20)), "PNG", Header(30, 20, "I;16", 16)),
])
def test_peek_reads_size_mode_and_depth(image, fmt, header):
    assert peek(encode(image, fmt)) == header


def test_peek_reads_the_header_only_and_sees_sixteen_bit_rgb():
    # 36 megapixels declared, no pixel data: peek answers, decoding fails.
    assert peek(png_header(6000, 6000, 16, 2)) == Header(6000, 6000, "RGB", 16)
    assert peek(png_header(6000, 6000, 16, 0)) == Header(6000, 6000, "I;16", 16)
    with pytest.raises(InvalidImage):
        preprocess(png_header(6000, 6000, 16, 0))


@pytest.mark.parametrize("data", [b"", b"not an image"])
def test_peek_of_a_non_image_is_invalid(data):
    with pytest.raises(InvalidImage):
        peek(data)


@pytest.mark.parametrize("header,cost", [
    (Header(640, 480, "RGB", 8), 1.0),  # the reference
    (Header(40, 30, "RGB", 8), 1.0),  # at least 1
    (Header(1280, 960, "RGB", 8), 4.0),  # pixels
    (Header(640, 480, "I;16", 16), 2.0),  # bit depth
    (Header(1280, 960, "RGB", 16), 8.0),
    (Header(640, 480, "F", 32), 4.0),
    (Header(6000, 6000, "I;16", 16), 6000 * 6000 * 6 / (640 * 480 * 3)),  # ~234
])
def test_decode_cost_follows_pixels_and_bit_depth(header, cost):
    assert decode_cost(header) == pytest.approx(cost)
    assert REFERENCE_DECODE_BYTES == 640 * 480 * 3


def _whole_image_reference(image: Image.Image) -> np.ndarray:
    """What a deep-mode image was before the gather-first route: the whole image scaled to
    [0, 1] as float32, repeated on three channels, then `preprocess_array`."""
    grey = np.asarray(image, dtype=np.float32)
    if image.mode != "F":
        grey = grey / 65535.0
    return preprocess_array(np.repeat(np.clip(grey, 0.0, 1.0)[:, :, None], 3, axis=2))


@pytest.mark.parametrize("mode", ["I;16", "I", "F"])
def test_deep_images_are_resized_from_the_pixels_read_bit_for_bit(mode):
    """A deep (16-bit, 32-bit, float) grey image takes only the pixels the crop and resize read
    (a 36-megapixel one is no longer 400 MB of float arrays): the same floats as scaling the
    whole image first, out-of-range values (mode I, F) clipped alike."""
    from backbone.preprocess import _deep_to_input

    rng = np.random.default_rng(3)
    if mode == "I;16":
        image = Image.fromarray(rng.integers(0, 65536, (517, 401), dtype=np.uint16))
    elif mode == "I":
        image = Image.fromarray(rng.integers(-9000, 90000, (517, 401)).astype(np.int32), "I")
    else:
        image = Image.fromarray(rng.uniform(-0.5, 1.5, (517, 401)).astype(np.float32), "F")
    assert image.mode == mode
    np.testing.assert_array_equal(_deep_to_input(image), _whole_image_reference(image))
    png = encode(image) if mode == "I;16" else None
    if png is not None:  # through preprocess, as a request's 16-bit PNG
        np.testing.assert_array_equal(preprocess(png), _whole_image_reference(image))


def test_opencv_runs_without_a_thread_pool_of_its_own():
    """The fast route's OpenCV adds no threads beside the decode pool's (`prepare`, which the
    engine calls at start-up, sets it)."""
    import cv2

    from backbone.preprocess import prepare

    prepare()
    assert cv2.getNumThreads() == 1
