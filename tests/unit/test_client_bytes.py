"""Client bytes the gateway reads before anyone else: its work on each grows at most linearly with their
size, whatever their shape (a speech form's part headers, deeply nested JSON, a million media parts, a
data: URL's header, an image's header structures). Each test builds the worst shape found for one reader
and asserts what bounds the reader's work (what it refuses, where it stops); one coarse wall-clock bound
stands where the old reading took hours."""

from __future__ import annotations

import asyncio
import io
import json
import struct
import time
import tracemalloc
import zlib

import httpx
import pytest
from PIL import Image

from services.common.errors import BadInput, MediaError
from services.common.media import content_id
from services.common.media_checks import MAX_READS, check_image, decode_image
from services.gateway.config import GatewayConfig
from services.gateway.errors import ApiError
from services.gateway.fetch import decode_data_url
from services.gateway.form import MAX_HEADER_LINE, MAX_HEADER_LINES, MAX_PARTS, file_span
from services.gateway.request import loads_strict, multipart_upload, parse_openai, upload_key
from tests.unit.helpers import data_url, image_bytes

pytestmark = pytest.mark.unit

CFG = GatewayConfig(lms="x:1")
CTYPE = "multipart/form-data; boundary=XYZ"


def _form(*parts: bytes, boundary: bytes = b"XYZ") -> bytes:
    """A form of ``parts`` (each a part's header lines and content, joined by a blank line)."""
    return b"".join(b"--" + boundary + b"\r\n" + p + b"\r\n" for p in parts) + b"--" + boundary + b"--\r\n"


def _file_of(body: bytes, content_type: str = CTYPE) -> bytes | None:
    span = file_span(body, content_type)
    return body[span[0]:span[1]] if span else None


# -- a speech upload's form -----------------------------------------------------------------------------

def test_an_86_mib_header_shaped_upload_is_keyed_whole_in_seconds_not_hours():
    """One part whose headers never end: the old reading ran a regex from each of its 4.5 million
    ``content-disposition:`` (200 KB of them froze the event loop 4.3 s; 86 MiB would take days)."""
    body = b"--XYZ\r\n" + b"content-disposition:" * ((86 << 20) // 20) + b"\r\n\r\nabc\r\n--XYZ--"
    start = time.monotonic()
    assert upload_key(body, CTYPE) == content_id(body)
    assert time.monotonic() - start < 5


def test_a_parts_headers_are_read_only_within_python_multiparts_bounds():
    line = b"Content-Disposition: form-data; name=file; filename=a"
    assert _file_of(_form(line + b"\r\n\r\nclip")) == b"clip"
    padded = b"X-Pad: " + b"p" * (MAX_HEADER_LINE - 7)
    assert _file_of(_form(padded + b"\r\n" + line + b"\r\n\r\nclip")) == b"clip"
    assert _file_of(_form(padded + b"p\r\n" + line + b"\r\n\r\nclip")) is None  # a line too long
    extra = b"".join(b"X-%d: v\r\n" % i for i in range(MAX_HEADER_LINES - 1))
    assert _file_of(_form(extra + line + b"\r\n\r\nclip")) == b"clip"
    assert _file_of(_form(b"X-0: v\r\n" + extra + line + b"\r\n\r\nclip")) is None  # one line too many


def test_a_form_of_more_parts_than_starlette_takes_is_keyed_whole():
    field = b'Content-Disposition: form-data; name="f"\r\n\r\nv'
    clip = b'Content-Disposition: form-data; name="file"; filename="a"\r\n\r\nclip'
    assert _file_of(_form(clip, *[field] * (MAX_PARTS - 1))) == b"clip"
    body = _form(clip, *[field] * MAX_PARTS)
    assert _file_of(body) is None and upload_key(body, CTYPE) == content_id(body)


def test_a_long_boundary_or_a_pathological_content_type_is_read_in_one_pass():
    clip = b'Content-Disposition: form-data; name="file"; filename="a"\r\n\r\nclip'
    mark = b"b" * 256
    assert _file_of(_form(clip, boundary=mark), f"multipart/form-data; boundary={mark.decode()}") == b"clip"
    assert _file_of(_form(clip, boundary=mark + b"b"), f"multipart/form-data; boundary={mark.decode()}b") is None
    for content_type in ("multipart/form-data;" + ";" * 230 + "boundary=XYZ", 'multipart/form-data; boundary="XYZ"',
                         "Multipart/Form-Data; charset=utf-8; boundary=XYZ"):
        assert _file_of(_form(clip), content_type) == b"clip"
    assert _file_of(_form(clip), "application/x-www-form-urlencoded; boundary=XYZ") is None


starlette_requests = pytest.importorskip("starlette.requests")


async def _starlette_file(body: bytes, content_type: str) -> bytes | None:
    """The ``file`` value vLLM's app takes from a form (Starlette's ``Request.form()``), or None."""
    scope = {"type": "http", "method": "POST", "path": "/", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", content_type.encode("latin-1"))]}

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        form = await starlette_requests.Request(scope, receive).form()
    except Exception:  # noqa: BLE001 - a form Starlette refuses: vLLM's app answers 400
        return None
    try:
        file = form.get("file")
        return await file.read() if hasattr(file, "read") else None
    finally:
        await form.close()


def test_the_form_reader_finds_the_file_vllms_app_finds():
    clip, other = b"RIFF clip \r\n-- bytes", b"RIFF other"
    ours, ctype = multipart_upload({"model": "m", "language": "en"}, clip)
    sent = httpx.Request("POST", "http://g/", files={"file": ("c.wav", clip, "audio/wav")}, data={"model": "m"})
    file_part = b'Content-Disposition: form-data; name="file"; filename="a"\r\nContent-Type: audio/wav\r\n\r\n'
    forms = [
        (ours, ctype),
        (sent.read(), sent.headers["content-type"]),
        (_form(file_part + other, file_part + clip), CTYPE),  # two: the last
        (_form(b"content-DISPOSITION: form-data; name=file; filename=a\r\n\r\n" + clip), CTYPE),
        (b"\r\n" + _form(file_part + clip), CTYPE),  # leading newlines
        (_form(file_part + clip) + b"--XYZ\r\n" + file_part + other + b"\r\n--XYZ--", CTYPE),  # after the end
        (_form(b'Content-Disposition: form-data; name="files"; filename="a"\r\n\r\n' + clip), CTYPE),
        (_form(b"Content-Type: audio/wav\r\n\r\n" + clip), CTYPE),  # a part without a name
        (b"preamble\r\n" + _form(file_part + clip), CTYPE),
    ]
    for body, content_type in forms:
        assert _file_of(body, content_type) == asyncio.run(_starlette_file(body, content_type)), body[:80]


# -- JSON bodies and their parts ------------------------------------------------------------------------

def test_a_body_nested_deeper_than_the_recursion_limit_is_a_400():
    for raw in (b"[" * 100_000, b'{"messages":' * 100_000):
        with pytest.raises(ApiError) as e:
            loads_strict(raw)
        assert e.value.status == 400 and "nested too deeply" in str(e.value)
    with pytest.raises(ApiError) as e:
        parse_openai("chat", b'{"messages": [' + b"[" * 100_000 + b"]}", CFG)
    assert e.value.status == 400


def _image_part(i: int) -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{i}"}}


def test_the_part_walk_stops_once_more_parts_than_every_limit_are_found():
    """Parts past the limits are never read: a body of a million image parts costs what nineteen do. The
    part after them would be refused on its own (a client uuid); the walk never gets there."""
    most = CFG.max_images + CFG.max_audios + CFG.max_videos
    parts = [_image_part(i) for i in range(most + 1)] + [{**_image_part(0), "uuid": "mine"}]
    body = json.dumps({"messages": [{"role": "user", "content": parts}]}).encode()
    with pytest.raises(ApiError, match="at most 8 images"):
        parse_openai("chat", body, CFG)
    blocks = [{"type": "image", "source": {"type": "base64", "data": "x"}}] * (most + 1) + [
        {"type": "image", "source": "not an object"}]
    tool = {"type": "tool_result", "content": blocks}
    for content in (blocks, [tool]):
        body = json.dumps({"max_tokens": 1, "messages": [{"role": "user", "content": content}]}).encode()
        with pytest.raises(ApiError, match="at most 8 images"):
            parse_openai("messages", body, CFG)


def test_within_the_limits_every_part_is_still_read():
    parts = [_image_part(i) for i in range(CFG.max_images)] + [{**_image_part(0), "uuid": "mine"}]
    with pytest.raises(ApiError, match="uuid"):
        parse_openai("chat", json.dumps({"messages": [{"role": "user", "content": parts}]}).encode(), CFG)


def test_a_data_url_header_of_millions_of_semicolons_is_copied_at_most_once():
    url = "data:" + ";" * (4 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(MediaError, match="base64"):
            decode_data_url(url, 20 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * len(url)  # a split of every ';' held 8 bytes per ';'
    assert decode_data_url(data_url(b"abc", "image/png;charset=x"), 10) == b"abc"


# -- image headers --------------------------------------------------------------------------------------

def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png(*chunks: bytes) -> bytes:
    ihdr = _chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
    return (b"\x89PNG\r\n\x1a\n" + ihdr + b"".join(chunks) + _chunk(b"IDAT", zlib.compress(b"\0\0\0\0"))
            + _chunk(b"IEND", b""))


def _shapes() -> dict[str, bytes]:
    """Images whose headers hold more structures than ``MAX_READS``: a few hundred KB each."""
    marker = b"\xff\xe1\x00\x04ab"
    screen = b"GIF89a" + struct.pack("<HHBBB", 1, 1, 0, 0, 0)
    frame = b"\x2c" + struct.pack("<HHHHB", 0, 0, 1, 1, 0) + b"\x02\x02\x44\x01\x00\x3b"
    return {"PNG text chunks": _png(_chunk(b"tEXt", b"k\0v") * MAX_READS),
            "JPEG markers": b"\xff\xd8" + marker * MAX_READS + b"\xff\xd9",
            "JPEG junk bytes": b"\xff\xd8\xff\xe0\x00\x04ab" + b"\x01" * (2 * MAX_READS) + b"\xff\xd9",
            "GIF comment sub-blocks": screen + b"\x21\xfe" + b"\x01a" * MAX_READS + b"\x00" + frame,
            "GIF extensions": screen + b"\x21\xf9\x04\x00\x00\x00\x00\x00" * MAX_READS + frame}


@pytest.mark.parametrize("shape", list(_shapes()))
def test_an_image_of_more_header_structures_than_max_reads_is_refused(shape):
    data = _shapes()[shape]
    with pytest.raises(MediaError, match="reads to parse"):
        check_image(data, CFG.max_image_pixels)
    with pytest.raises(BadInput, match="reads to parse"):
        decode_image(data)


def test_a_png_with_a_second_icc_profile_is_refused_before_pil_inflates_it():
    """20 MB of 1 KB iCCP chunks, each inflating to 1 MiB, held the gateway's event loop for a minute."""
    profile = _chunk(b"iCCP", b"p\0\0" + zlib.compress(b"\0" * (1 << 20), 9))
    assert check_image(_png(profile), 100)[0] == "PNG"
    with pytest.raises(MediaError, match="more than one iCCP"):
        check_image(_png(profile * 2), 100)
    with pytest.raises(BadInput, match="more than one iCCP"):
        decode_image(_png(profile * 2))


def test_real_images_are_read_as_before():
    for fmt in ("PNG", "JPEG", "WEBP", "GIF", "BMP"):
        data = image_bytes(fmt, size=(64, 48), noise=True)
        assert check_image(data, CFG.max_image_pixels) == (fmt, 64, 48)
        assert decode_image(data).size == (64, 48)
    out = io.BytesIO()  # an ICC profile, EXIF and a comment, as cameras and editors write them
    Image.new("RGB", (32, 32)).save(out, "JPEG", icc_profile=b"\0" * 200_000, exif=b"Exif\0\0" + b"\0" * 60_000,
                                    comment=b"c" * 60_000)
    assert check_image(out.getvalue(), CFG.max_image_pixels) == ("JPEG", 32, 32)
