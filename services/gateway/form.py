"""A ``multipart/form-data`` body's ``file`` part, found as vLLM's app finds it, in one bounded pass.

vLLM's speech-to-text routes read a form with Starlette's ``Request.form()`` (python-multipart 0.0.x
underneath), which refuses a form it cannot take: a boundary over ``MAX_BOUNDARY`` bytes, a part with
more than ``MAX_HEADER_LINES`` header lines or a line over ``MAX_HEADER_LINE`` bytes, a part without a
Content-Disposition ``name``, more than ``MAX_PARTS`` parts (Starlette's ``max_files`` plus
``max_fields``). This reader stops at the first of those (``None``: the form is vLLM's to refuse), so
what it scans of a part's headers is bounded whatever the client sent, and every byte of the body is
looked at a bounded number of times (``bytes.find`` for the delimiters; a split of at most
``MAX_HEAD`` bytes per part for its headers): the work grows linearly with the body, never with the
square of a header's length.

It agrees with vLLM's reading for the forms clients send (a browser's, ``httpx``'s, ``curl -F``'s,
``request.multipart_upload``'s); for a contrived one (a quoted ``;`` in a parameter) it may differ.
Only routing reads it (``request.upload_key``): a reading that differs from the encoder's costs an
encode elsewhere, never a wrong answer. No state; the caller owns ``body`` (spans index into it).
"""

from __future__ import annotations

MAX_BOUNDARY = 256
"""The longest boundary python-multipart takes (``MAX_BOUNDARY_LENGTH``)."""
MAX_HEADER_LINES = 8
"""The most header lines it takes in one part (``DEFAULT_MAX_HEADER_COUNT``)."""
MAX_HEADER_LINE = 4096 + 128
"""The longest header line it takes, name, colon and value (``DEFAULT_MAX_HEADER_SIZE``)."""
MAX_HEAD = MAX_HEADER_LINES * (MAX_HEADER_LINE + 2)
"""The most bytes of one part's header lines, each with its CRLF, that this reader looks at."""
MAX_PARTS = 2000
"""The most parts Starlette's form takes (1000 files and 1000 fields)."""

_TOKEN = (b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789!#$%&'*+-.^_`|~")


def boundary(content_type: str) -> bytes | None:
    """The boundary of a ``multipart/form-data`` Content-Type, or None (another type, none given, or one
    longer than python-multipart takes). The caller bounds ``content_type`` (``request.MAX_CONTENT_TYPE``)."""
    kind, *params = content_type.split(";")
    if kind.strip(" \t").lower() != "multipart/form-data":
        return None
    found = _param(params, "boundary")
    if found is None or not 0 < len(found) <= MAX_BOUNDARY:
        return None
    return found.encode("latin-1")


def file_span(body: bytes, content_type: str) -> tuple[int, int] | None:
    """Where the form's ``file`` part's content is in ``body`` (the last such part, as FastAPI takes a
    non-list field), or None: no file part, or a form vLLM's app would refuse (the module docstring)."""
    mark = boundary(content_type)
    if mark is None:
        return None
    delim = b"\r\n--" + mark
    pos = body.find(b"-") if body[:1] in (b"\r", b"\n") else 0  # python-multipart skips leading newlines
    if pos < 0 or not body.startswith(delim[2:], pos):
        return None
    pos += len(delim) - 2
    found = None
    for count in range(MAX_PARTS + 1):
        if body.startswith(b"--", pos):  # the closing delimiter: what follows is not read
            return found
        if count == MAX_PARTS:
            return None
        # pos is at the CRLF that ends the delimiter line; a blank line ends the part's headers.
        head_end = body.find(b"\r\n\r\n", pos, pos + MAX_HEAD + 4)
        if not body.startswith(b"\r\n", pos) or head_end < 0:
            return None
        name = part_name(body[pos + 2:head_end])
        if name is None:
            return None
        end = body.find(delim, head_end + 4)
        if end < 0:
            return None
        if name == "file":
            found = (head_end + 4, end)
        pos = end + len(delim)
    return None  # not reached


def part_name(head: bytes) -> str | None:
    """The ``name`` of a part's Content-Disposition (the last such header), from the part's header lines
    (at most ``MAX_HEAD`` bytes), or None where python-multipart or Starlette would refuse the part."""
    lines = head.split(b"\r\n") if head else []
    if not lines or len(lines) > MAX_HEADER_LINES:
        return None
    disposition = None
    for line in lines:
        field, colon, value = line.partition(b":")
        if len(line) > MAX_HEADER_LINE or not colon or not field or field.translate(None, _TOKEN):
            return None
        if field.lower() == b"content-disposition":
            disposition = value.lstrip(b" ").decode("latin-1")
    if disposition is None:
        return None
    return _param(disposition.split(";")[1:], "name")


def _param(params: list[str], key: str) -> str | None:
    """The value of ``key`` among a header's ``;``-separated parameters (the last one; quotes and their
    escapes removed), as python-multipart's ``parse_options_header`` reads them."""
    found = None
    for param in params:
        name, eq, value = param.partition("=")
        if eq and name.strip(" \t").lower() == key:
            value = value.strip(" \t")
            if len(value) >= 2 and value[0] == value[-1] == '"':
                value = value[1:-1].replace("\\\\", "\\").replace('\\"', '"')
            found = value
    return found
