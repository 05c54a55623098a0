"""The LM process's vLLM media connector: data: URLs only, loaded under the LM's media limits.

vLLM's chat parser hands every media URL of a request to the media connector its
``VLLM_MEDIA_CONNECTOR`` names (``MEDIA_CONNECTOR_REGISTRY``). The LM selects this one
(``install``, called by the LM service before its engine starts): it never downloads (http(s)
and file URLs are refused, whatever ``--allowed-media-domains`` says: an empty list there allows
every domain, and vLLM follows redirects), and it loads a data: URL through the call's
``RequestMedia`` (header checks, decode budget, interruptible decode, the content hash recorded
for ``check_items``). Importing this module imports vLLM: only the LM service does, after its
process environment is set.
"""

from __future__ import annotations

import base64
import binascii
import os
from typing import Any

import vllm.envs as envs
from vllm.multimodal.media.audio import AudioMediaIO
from vllm.multimodal.media.connector import MEDIA_CONNECTOR_REGISTRY, MediaConnector
from vllm.multimodal.media.image import ImageMediaIO
from vllm.multimodal.media.video import VideoMediaIO

from services.common.errors import BadInput
from services.common.vllm_media import frames_sampled_by
from services.lm.context import CURRENT

NAME = "epd-gateway-only"
ENV = "VLLM_MEDIA_CONNECTOR"


def _modality(media_io: Any) -> str:
    for cls, modality in ((ImageMediaIO, "image"), (AudioMediaIO, "audio"), (VideoMediaIO, "video")):
        if isinstance(media_io, cls):
            return modality
    raise BadInput(f"the LM does not load {type(media_io).__name__} media")


def data_url_bytes(url: str, modality: str) -> bytes:
    """The bytes of a ``data:<modality>/...;base64,`` URL (strict base64), or BadInput. The gateway
    sends exactly this form; anything else is not from the gateway."""
    if not isinstance(url, str) or url[:5].lower() != "data:":
        scheme = url.partition(":")[0][:16] if isinstance(url, str) else type(url).__name__
        raise BadInput(f"the LM does not download media ({scheme!r} URL refused): it takes {modality} items only "
                       "as data: URLs from the gateway, which fetches URLs under its own rules")
    spec, sep, payload = url[5:].partition(",")
    media_type, _, encoding = spec.rpartition(";")
    media_type = media_type.partition(";")[0].strip().lower()
    if not sep or encoding != "base64" or not media_type.startswith(f"{modality}/") or media_type == "video/jpeg":
        raise BadInput(f"{modality} data: URL must be data:{modality}/<type>;base64,<data> (got {spec[:40]!r})")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise BadInput(f"{modality} data: URL is not valid base64") from None


@MEDIA_CONNECTOR_REGISTRY.register(NAME)
class GatewayOnlyMediaConnector(MediaConnector):
    """vLLM's ``MediaConnector`` with one source: the call's data: URLs (see the module docstring).
    vLLM makes one per parsed request; it keeps no state of its own."""

    def load_from_url(self, url: str, media_io: Any, *, fetch_timeout: int | None = None) -> Any:
        raise BadInput("the LM loads media only on its async front end")  # the sync parser is never used here

    async def load_from_url_async(self, url: str, media_io: Any, *, fetch_timeout: int | None = None) -> Any:
        modality = _modality(media_io)
        data = data_url_bytes(url, modality)
        ctx = CURRENT.get()
        if ctx is None or ctx.media is None:
            raise BadInput(f"{modality} data outside a Generate call is not loaded here")
        laid_out = ctx.media.encoded_elsewhere(modality, data, ctx)
        if laid_out is not None:  # an encoder has it: not decoded here
            return laid_out
        sampled = frames_sampled_by(media_io) if modality == "video" else None
        return await ctx.media.load(modality, data, media_io.load_bytes, sampled)

    def _refuse_embeds(self, *args: Any, **kwargs: Any) -> Any:
        raise BadInput("pre-computed embeddings are not taken by this LM")

    fetch_image_embedding = fetch_audio_embedding = fetch_video_embedding = _refuse_embeds

    async def fetch_image_embedding_async(self, *args: Any, **kwargs: Any) -> Any:
        return self._refuse_embeds()

    async def fetch_audio_embedding_async(self, *args: Any, **kwargs: Any) -> Any:
        return self._refuse_embeds()

    async def fetch_video_embedding_async(self, *args: Any, **kwargs: Any) -> Any:
        return self._refuse_embeds()


def install() -> None:
    """Selects this connector for the process (``VLLM_MEDIA_CONNECTOR``; an operator's other value is
    overridden: the LM must not download) and checks vLLM reads it back. Called by the LM service
    before its engine starts."""

    os.environ[ENV] = NAME
    if envs.VLLM_MEDIA_CONNECTOR != NAME or MEDIA_CONNECTOR_REGISTRY.load(NAME).__class__ is not \
            GatewayOnlyMediaConnector:
        raise RuntimeError(f"vLLM does not select the {NAME} media connector ({ENV} reads "
                           f"{envs.VLLM_MEDIA_CONNECTOR!r}); the LM refuses to start rather than download media")
