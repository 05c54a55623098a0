"""Media sources for the gateway (images and audio): data: URLs decoded, http(s) URLs fetched once,
with limits.

The gateway is the only component that reads media from the outside (encoders and LMs are handed
bytes). ``load_images`` turns the sources of one request into checked media bytes; ``MediaFetcher``
fetches http(s) URLs. Rules for a fetch, each refusal a ``MediaError`` that says what and why (the
same for audio and video, with ``audio/*`` / ``video/*``, ``--max-audio-bytes`` / ``--max-video-bytes``
and ``AUDIO_FORMATS`` / ``VIDEO_FORMATS``):

- scheme http or https only;
- SSRF guard, before any connection: an IP-literal host is checked directly; a host name is resolved
  by ``GuardResolver``, which drops every address that is not globally routable (loopback, private,
  link-local, multicast, reserved, unspecified, IPv4-mapped forms of those) unless it lies in
  ``--fetch-allow-networks``. aiohttp then connects only to the addresses that resolver returned, so
  a DNS answer cannot change between the check and the connection;
- redirects followed by hand, at most ``--fetch-max-redirects``, each new URL checked again;
- ``--fetch-timeout-s`` for the whole fetch (connect, redirects and body together);
- a 2xx status, an ``image/*`` Content-Type, and at most ``--max-image-bytes``: a larger
  Content-Length is refused before reading, a body is read in chunks and abandoned once over;
- whatever the source (data: URL, fetched, raw gRPC bytes), an image must be one of
  ``services.common.media_checks.IMAGE_FORMATS`` (the one list, shared with ``check_image``), sniffed from
  its first bytes (``sniff_image_format``; a declared media type proves nothing, and a data: URL's is
  not read, as vLLM does not read it), and its header must
  parse as that format within ``--max-image-pixels``; an audio clip one of ``AUDIO_FORMATS`` whose
  header says at most ``--max-audio-seconds`` (``check_audio``); a video one of ``VIDEO_FORMATS`` by
  its signature (its container is parsed by the encoder that decodes it, never in the gateway);
- no proxies from the environment, no cookies kept, no content decoding (``Accept-Encoding:
  identity``), so the byte limit is the limit on what the gateway holds.

Sharing the connection pool: every request's fetches share one pool of ``FETCH_CONNECTIONS``, of which one
origin holds at most ``FETCH_CONNECTIONS_PER_HOST`` and one request at most ``FETCHES_PER_REQUEST`` at once,
so an origin that answers slowly (or never, until ``--fetch-timeout-s``) delays the requests that point at
it, not the others.

Owner: the gateway's ``server.serve`` creates one ``MediaFetcher`` and closes it at shutdown;
``OpenAIRoutes`` and ``GatewayServicer`` use it through ``load_images``.
"""

from __future__ import annotations

import asyncio
import binascii
import ipaddress
import logging
import re
import socket
from typing import TYPE_CHECKING

import aiohttp
import pybase64
from aiohttp.abc import AbstractResolver
from yarl import URL

from services.common.errors import MediaError
from services.common.media import off_loop
from services.common.media_checks import IMAGE_FORMATS, check_audio, check_image, sniffed_format
from services.gateway.config import GatewayConfig

if TYPE_CHECKING:
    from aiohttp.abc import ResolveResult  # aiohttp >= 3.10; a plain dict before

logger = logging.getLogger(__name__)

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_REDIRECTS = (301, 302, 303, 307, 308)
_GUARD_HINT = "refused (SSRF guard; see --fetch-allow-networks)"
_NUMERIC_HOST = re.compile(r"[0-9.]+|0x[0-9a-f.x]*", re.IGNORECASE)  # 127.1, 2130706433, 0x7f.1

FETCH_CONNECTIONS = 64
"""Connections the gateway's fetcher has open at once, over every origin and request (aiohttp's ``limit``).
A fetch past it waits for one to free up, inside its --fetch-timeout-s."""
FETCH_CONNECTIONS_PER_HOST = 8
"""Connections to one origin (host, port, scheme) at once, over every request (aiohttp's
``limit_per_host``): an origin that holds its connections open keeps at most these out of the pool, and
the fetches from it beyond them wait (inside their --fetch-timeout-s) while other origins are served."""
FETCHES_PER_REQUEST = 4
"""URLs of one request fetched at once (``load_images``); the others wait for a turn, and each one's
--fetch-timeout-s starts when it gets one (the request as a whole is bounded by --request-timeout-s). One
request's media URLs never hold more than this many connections, whatever origins they point at."""


def sniff_image_format(data: bytes) -> str | None:
    """The format of ``IMAGE_FORMATS`` (PIL names; JPEG includes MPO) that ``data``'s signature (its
    first bytes) names, or None."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if data[:2] == b"BM" and len(data) >= 26:  # file header (14) + the smallest info header's size fields
        return "BMP"
    return None


def check_format(data: bytes, max_pixels: int) -> str:
    """Refuses (MediaError, 400) an image whose signature is not one of ``IMAGE_FORMATS`` or whose
    header does not parse as that format, and one over ``max_pixels`` (``check_image``). Returns the
    format. Called by ``_load_one`` for every image, before any service sees it."""
    sniffed = sniff_image_format(data)
    if sniffed is None:
        head = data[:12].hex(" ") or "none"
        raise MediaError(f"image is not a recognised image of an accepted format (first bytes: {head}); "
                         f"accepted: {', '.join(IMAGE_FORMATS)}")
    parsed, _, _ = check_image(data, max_pixels)
    if {"MPO": "JPEG"}.get(parsed, parsed) != sniffed:
        raise MediaError(f"image starts like {sniffed} but its header parses as {parsed}; refused")
    return sniffed


def _short(url: str, n: int = 100) -> str:
    return url if len(url) <= n else url[:n] + "..."


# IPv6 ranges refused whatever Python's tables (which change between versions) say about them.
_V6_REFUSED = ((ipaddress.IPv6Network("fec0::/10"), "site-local"),  # deprecated, still routed on some LANs
               (ipaddress.IPv6Network("fc00::/7"), "private"),  # unique-local
               (ipaddress.IPv6Network("2001::/32"), "Teredo"),  # tunnels to an address the gateway cannot judge
               (ipaddress.IPv6Network("64:ff9b:1::/48"), "local-use NAT64"),
               (ipaddress.IPv6Network("3fff::/20"), "documentation"))
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # well-known prefix: judged by the IPv4 address inside
_V4_COMPAT = ipaddress.IPv6Network("::/96")  # deprecated IPv4-compatible form (::a.b.c.d), and :: and ::1


def non_public_reason(ip: IPAddress) -> str | None:
    """Why ``ip`` is not a globally routable unicast address ("loopback", "private", "site-local", ...),
    or None. IPv6 forms that embed an IPv4 address (IPv4-mapped, 6to4, NAT64 64:ff9b::/96) are judged
    by that address; the deprecated IPv4-compatible form, Teredo, site-local and unique-local are refused."""
    if isinstance(ip, ipaddress.IPv6Address):
        ip = ipaddress.IPv6Address(int(ip))  # without a %zone
        inner = ip.ipv4_mapped or ip.sixtofour
        if inner is None and ip in _NAT64:
            inner = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if inner is not None:
            return non_public_reason(inner)
        if ip in _V4_COMPAT and int(ip) > 1:
            return "IPv4-compatible"
        for net, reason in _V6_REFUSED:
            if ip in net:
                return reason
    for attr, reason in (("is_unspecified", "unspecified"), ("is_loopback", "loopback"),
                         ("is_link_local", "link-local"), ("is_site_local", "site-local"),
                         ("is_multicast", "multicast"), ("is_private", "private"), ("is_reserved", "reserved")):
        if getattr(ip, attr, False):
            return reason
    return None if ip.is_global else "non-global"


def address_refusal(ip: IPAddress, allowed: list[Network]) -> str | None:
    """None when the gateway may connect to ``ip``; otherwise the reason it may not."""
    candidates = [ip]
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        candidates.append(ip.ipv4_mapped)
    if any(c in net for c in candidates for net in allowed if c.version == net.version):
        return None
    return non_public_reason(ip)


def check_url(url: str | URL, allowed: list[Network], modality: str = "image") -> URL:
    """Validates one hop's URL without touching the network: http(s) scheme, a host, and, for an IP
    literal, an address that passes ``address_refusal`` (aiohttp never asks the resolver about
    literals). Host names are checked later, when ``GuardResolver`` resolves them. Returns the URL."""
    text = str(url)
    try:
        u = url if isinstance(url, URL) else URL(url)
    except (ValueError, TypeError) as e:
        raise MediaError(f"{modality} URL {_short(text)!r} is not a valid URL ({e})") from None
    if u.scheme not in ("http", "https"):
        raise MediaError(f"{modality} URL scheme {u.scheme or 'none'!r} is not allowed in {_short(text)!r}; "
                         "use http(s) or a data: URL")
    host = (u.host or "").rstrip(".")
    if not host:
        raise MediaError(f"{modality} URL {_short(text)!r} has no host")
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        if _NUMERIC_HOST.fullmatch(host):
            raise MediaError(f"{modality} URL host {host} is not a canonical IP address; refused") from None
        return u
    reason = address_refusal(ip, allowed)
    if reason:
        raise MediaError(f"{modality} URL host {host} is a {reason} address; {_GUARD_HINT}")
    return u


class HostRefused(OSError):
    """Raised by GuardResolver; aiohttp wraps it in ClientConnectorError, MediaFetcher unwraps it."""


class GuardResolver(AbstractResolver):
    """aiohttp resolver that keeps only addresses ``address_refusal`` accepts; when none remain it
    raises HostRefused naming the host and every refused address. Created by MediaFetcher inside the
    event loop (the wrapped ThreadedResolver binds to it)."""

    def __init__(self, allowed: list[Network]) -> None:
        self.allowed = allowed
        self._inner = aiohttp.ThreadedResolver()

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        kept, refused = [], []
        for r in results:
            reason = address_refusal(ipaddress.ip_address(r["host"].split("%")[0]), self.allowed)
            if reason:
                refused.append(f"{r['host']} is {reason}")
            else:
                kept.append(r)
        if refused:
            logger.info("image URL host %s: dropped non-public addresses: %s", host, ", ".join(refused))
        if not kept:
            raise HostRefused(f"image URL host {host} resolves only to non-public addresses "
                              f"({', '.join(refused) or 'none'}); {_GUARD_HINT}")
        return kept

    async def close(self) -> None:
        await self._inner.close()


class MediaFetcher:
    """Fetches http(s) image URLs under the rules in the module docstring. One aiohttp session,
    created on first use; ``close()`` (server shutdown) releases it. Safe to share across requests: its
    pool holds ``FETCH_CONNECTIONS``, at most ``FETCH_CONNECTIONS_PER_HOST`` of them to one origin."""

    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.allowed = cfg.allowed_networks
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(resolver=GuardResolver(self.allowed), limit=FETCH_CONNECTIONS,
                                             limit_per_host=FETCH_CONNECTIONS_PER_HOST)
            self._session = aiohttp.ClientSession(
                connector=connector, trust_env=False, cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False,  # the one deadline is fetch()'s, over every hop and the body
                headers={"User-Agent": "epd-serve-gateway", "Accept": "image/*", "Accept-Encoding": "identity"})
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def fetch(self, url: str, modality: str = "image") -> bytes:
        """The body of ``url`` (after redirects), or MediaError. Called by ``load_images``.
        ``modality``: "image" or "audio" (the Content-Type and the byte limit it must meet)."""
        try:
            # One deadline over every hop and the body. wait_for rather than
            # asyncio.timeout: the project supports Python 3.10.
            return await asyncio.wait_for(self._fetch(url, modality), self.cfg.fetch_timeout_s)
        except asyncio.TimeoutError:
            raise MediaError(f"{modality} URL {_short(url)} was not fetched within {self.cfg.fetch_timeout_s:g} s "
                             "(--fetch-timeout-s); refused") from None

    async def _fetch(self, url: str, modality: str) -> bytes:
        current = check_url(url, self.allowed, modality)
        session = self._get_session()
        for _ in range(self.cfg.fetch_max_redirects + 1):
            try:
                async with session.get(current, allow_redirects=False,
                                       headers={"Accept": f"{modality}/*"}) as resp:
                    if resp.status in _REDIRECTS:
                        current = self._next_hop(resp, url, modality)
                        continue
                    self._check_response(resp, url, modality)
                    return await self._read(resp, url, modality)
            except aiohttp.ClientConnectorError as e:
                if isinstance(e.os_error, HostRefused):
                    raise MediaError(str(e.os_error)) from None
                raise MediaError(f"{modality} URL {_short(url)} could not be fetched: {e}") from None
            except aiohttp.ClientError as e:
                raise MediaError(f"{modality} URL {_short(url)} could not be fetched: {e!r}") from None
        raise MediaError(f"{modality} URL {_short(url)} redirected more than {self.cfg.fetch_max_redirects} times "
                         "(--fetch-max-redirects); refused")

    def _next_hop(self, resp: aiohttp.ClientResponse, url: str, modality: str = "image") -> URL:
        location = resp.headers.get("Location")
        if not location:
            raise MediaError(f"{modality} URL {_short(url)} answered HTTP {resp.status} without a Location")
        try:
            target = resp.url.join(URL(location))
        except ValueError as e:
            raise MediaError(f"{modality} URL {_short(url)} redirected to an invalid URL ({e})") from None
        logger.debug("%s URL %s redirects to %s", modality, _short(url), target)
        return check_url(target, self.allowed, modality)

    def _check_response(self, resp: aiohttp.ClientResponse, url: str, modality: str = "image") -> None:
        if not 200 <= resp.status < 300:
            raise MediaError(f"{modality} URL {_short(url)} answered HTTP {resp.status} {resp.reason or ''}".rstrip())
        if not resp.content_type.startswith(f"{modality}/"):
            raise MediaError(f"{modality} URL {_short(url)} has Content-Type {resp.content_type!r}, expected "
                             f"{modality}/*")
        limit = max_bytes(self.cfg, modality)
        if resp.content_length is not None and resp.content_length > limit:
            raise MediaError(f"{modality} URL {_short(url)} is {resp.content_length} bytes, more than the {limit} "
                             f"allowed (--max-{modality}-bytes); refused before reading", status=413)

    async def _read(self, resp: aiohttp.ClientResponse, url: str, modality: str = "image") -> bytes:
        limit, buf = max_bytes(self.cfg, modality), bytearray()
        async for chunk in resp.content.iter_chunked(64 << 10):
            buf += chunk
            if len(buf) > limit:
                raise MediaError(f"{modality} URL {_short(url)} sent more than the {limit} bytes allowed "
                                 f"(--max-{modality}-bytes); refused", status=413)
        return bytes(buf)


def max_bytes(cfg: GatewayConfig, modality: str) -> int:
    """The largest encoded item of ``modality`` the gateway accepts (--max-image-bytes, --max-audio-bytes,
    --max-video-bytes)."""
    return {"audio": cfg.max_audio_bytes, "video": cfg.max_video_bytes}.get(modality, cfg.max_image_bytes)


def decode_data_url(url: str, max_bytes: int, modality: str = "image") -> bytes:
    """The bytes of a ``data:[<type>];base64,`` URL, or MediaError (413 when over ``max_bytes``).

    Decoded as vLLM decodes it (``pybase64.b64decode(..., validate=True)``: the same refusals, in tens of
    ms for a limit-size image); ``_load`` runs it on a thread for a large item (``off_loop``).
    An image's or an audio clip's declared media type is not read, as vLLM does not read it
    (``vllm/multimodal/media``: ``ImageMediaIO.load_base64`` and ``AudioMediaIO.load_base64`` decode
    the bytes whatever the type; an Anthropic image's ``media_type`` becomes this type): the bytes'
    format is sniffed after. A video's must be ``video/*`` (vLLM reads ``video/jpeg`` as frames)."""
    header, _, payload = url.partition(",")
    semi = header.find(";", 5)  # not a split: a header of a million ';' would be a list of a million strings
    mime = header[5:semi if semi >= 0 else len(header)].strip().lower()
    if modality == "video" and not mime.startswith("video/"):
        raise MediaError(f"data URL has media type {mime or 'none'!r}, expected {modality}/*")
    if ";base64" not in header:
        raise MediaError(f"{modality} data URLs must be base64-encoded")
    if len(payload) * 3 // 4 - (len(payload) - len(payload.rstrip("="))) > max_bytes:  # padding is no data
        raise MediaError(f"{modality} larger than {max_bytes} bytes (--max-{modality}-bytes)", status=413)
    try:
        return pybase64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(f"{modality} data URL is not valid base64") from None


async def _load_one(source: str | bytes, cfg: GatewayConfig, fetcher: MediaFetcher | None,
                    modality: str, turns: asyncio.Semaphore) -> bytes:
    try:
        return await _load(source, cfg, fetcher, modality, turns)
    except MediaError as e:
        e.modality = modality
        raise


async def _load(source: str | bytes, cfg: GatewayConfig, fetcher: MediaFetcher | None, modality: str,
                turns: asyncio.Semaphore) -> bytes:
    """One source's checked bytes. ``turns``: the request's share of the fetcher (``FETCHES_PER_REQUEST``),
    held for the fetch only, not for the checks after it."""
    limit = max_bytes(cfg, modality)
    if isinstance(source, bytes):
        data = source
    elif source.startswith("data:"):
        data = await off_loop(len(source), decode_data_url, source, limit, modality)
    elif source[:8].lower().startswith(("http://", "https://")):
        if fetcher is None:
            raise MediaError(f"http(s) {modality} URLs cannot be fetched: this gateway has no media fetcher")
        async with turns:
            data = await fetcher.fetch(source, modality)
    else:
        check_url(source, [], modality)  # raises the scheme (or URL) error
        raise MediaError(f"unsupported {modality} URL {_short(source)!r}")
    if len(data) > limit:
        raise MediaError(f"{modality} larger than {limit} bytes (--max-{modality}-bytes)", status=413)
    if modality == "audio":
        await asyncio.to_thread(check_audio, data, cfg.max_audio_seconds)  # libsndfile reads the header
    elif modality == "video":
        # The container is parsed (FFmpeg, through OpenCV) by the encoder that decodes it, not here: a
        # parser fault in the gateway's process would take every request with it.
        sniffed_format(data, "video")
    else:  # off the loop, as audio: PIL walks the header in Python (bounded by media_checks.MAX_READS)
        await asyncio.to_thread(check_format, data, cfg.max_image_pixels)
    return data


async def load_images(sources: list[str | bytes], cfg: GatewayConfig, fetcher: MediaFetcher | None,
                      modalities: list[str] | None = None) -> list[bytes]:
    """Checked media bytes for ``sources`` (data: or http(s) URLs, or raw bytes from the gRPC API), in
    order; ``modalities``: each source's ("image" when not given). Called once per request. URLs are
    fetched concurrently, at most ``FETCHES_PER_REQUEST`` at once. The first MediaError cancels the other
    fetches and is raised."""
    modalities = modalities or ["image"] * len(sources)
    turns = asyncio.Semaphore(FETCHES_PER_REQUEST)  # this request's share of the fetcher's pool
    tasks = [asyncio.ensure_future(_load_one(s, cfg, fetcher, m, turns)) for s, m in zip(sources, modalities)]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        # Wait for the cancelled fetches to close their connections, and collect every other
        # error so none is logged as "never retrieved".
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
