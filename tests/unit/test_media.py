"""Image decoding guard rails and content identity."""

import hashlib

import grpc
import pytest
from helpers import image_bytes

from services.common.errors import BadInput
from services.common.media import content_id, decode_image

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("fmt, mode", [("PNG", "RGB"), ("PNG", "RGBA"), ("PNG", "L"), ("JPEG", "RGB"), ("JPEG", "L")])
def test_valid_images_decode_to_rgb(fmt, mode):
    img = decode_image(image_bytes(fmt, size=(8, 6), mode=mode))
    assert img.mode == "RGB" and img.size == (8, 6)


def test_decoded_pixels_are_the_encoded_ones():
    img = decode_image(image_bytes("PNG", size=(3, 2)))
    assert img.getpixel((2, 1)) == (10, 200, 30)


@pytest.mark.parametrize(
    "data, needle",
    [
        (b"", "image is empty"),
        (b"definitely not an image", "could not be decoded"),
        (b"\x89PNG\r\n\x1a\n", "could not be decoded"),  # a signature and nothing else
    ],
    ids=["empty", "garbage", "signature-only"],
)
def test_bad_bytes_raise_badinput(data, needle):
    with pytest.raises(BadInput, match=needle):
        decode_image(data)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_a_truncated_image_raises_badinput(fmt):
    data = image_bytes(fmt, size=(64, 64), noise=True)
    with pytest.raises(BadInput, match="could not be decoded"):
        decode_image(data[: len(data) // 2])


def test_an_image_over_max_pixels_is_refused_before_decoding():
    data = image_bytes("PNG", size=(10, 10))
    assert decode_image(data, max_pixels=100).size == (10, 10)  # the limit itself is fine
    with pytest.raises(BadInput, match="10x10, more than 99 pixels"):
        decode_image(data, max_pixels=99)


def test_badinput_maps_to_invalid_argument():
    assert BadInput.code is grpc.StatusCode.INVALID_ARGUMENT


def test_content_id_is_the_sha256_hex_of_the_bytes():
    data = image_bytes("PNG")
    assert content_id(data) == hashlib.sha256(data).hexdigest()
    assert content_id(data) != content_id(data + b"\0")
