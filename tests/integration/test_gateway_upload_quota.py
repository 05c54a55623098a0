"""A speech upload against its tenant's ``images_per_minute``, through the gateway's Orchestrator and fake
encoder and LM gRPC servers (in-process grpc.aio on loopback): admission charges the upload one item, and
the windows its encoder cut are charged once their metadata has come (``Ticket.count_items``)."""

from __future__ import annotations

import json

import pytest

from epd.encoder.v1 import encoder_pb2
from epd.lm.v1 import lm_pb2
from epd.transfer.v1 import transfer_pb2
from services.gateway.admission import AdmissionRefused
from services.gateway.tenants import Tenant
from services.gateway.values import Media, Timings
from tests.integration.gateway_fakes import FakeEncoder
from tests.integration.test_gateway_failover import Cluster, run_cluster, tokens

pytestmark = pytest.mark.integration

WINDOWS = 3


class WindowEncoder(FakeEncoder):
    """An encoder of a speech model (``speech_windows``): it cuts each upload into ``WINDOWS`` windows, one
    metadata event and one encoded event per window, as the real encoder answers."""

    async def Encode(self, request, context):
        self.requests.append(request)
        windows = [(i, w) for i in range(len(request.items)) for w in range(WINDOWS)]
        for i, w in windows:
            src = transfer_pb2.ItemSource(num_embeds=16, embed_width=64, dtype=transfer_pb2.BFLOAT16,
                                          transfer_endpoint=self.endpoint, encoder_id=self.name,
                                          claim=f"{request.request_id}-{i}-{w}")
            yield encoder_pb2.EncodeEvent(metadata=encoder_pb2.ItemMetadata(
                identifier=f"window-{i}-{w}", index=i, modality="audio", window=w, windows=WINDOWS, source=src))
        for i, w in windows:
            yield encoder_pb2.EncodeEvent(encoded=encoder_pb2.ItemEncoded(identifier=f"window-{i}-{w}", index=i))

    async def GetInfo(self, request, context):
        return encoder_pb2.EncoderInfo(encoder_id=self.name, transfer_endpoint=self.endpoint,
                                       protocol=self.protocol, speech_windows=True)


def upload(rid: str) -> tuple[lm_pb2.GenerateRequest, list[Media]]:
    """An upload as the gateway hands it to the orchestrator: one audio item (its routing key), the body as
    the client sent it. The fake LM answers any body as a chat, so its OpenAI body is one."""
    req = lm_pb2.GenerateRequest(request_id=rid, items=[lm_pb2.MMItem(modality="audio", identifier="upload-key")])
    req.openai.api = "chat"
    req.openai.body = json.dumps({"messages": [{"role": "user", "content": "transcribe"}], "max_tokens": 3}).encode()
    return req, [Media(b"--form--", "upload-key", "audio", content_type="multipart/form-data; boundary=form")]


def test_an_upload_consumes_its_tenants_media_quota_one_item_per_window_its_encoder_cut():
    async def body(c: Cluster):
        c.encoders = [WindowEncoder("enc-A", c.world)]
        orch = await c.start()
        rate = {"a": Tenant("a", images_per_minute=4)}
        orch.admission.quota = lambda name: rate.get(name) or Tenant(name)
        ticket = await orch.admission.admit(True, "a", items=1)  # the upload, one item when it arrives
        req, media = upload("r-upload")
        out = [r async for r in orch.generate(req, media, Timings(), ticket=ticket)]
        ticket.release()
        assert tokens(out) == [1, 2, 3]
        (lm_req,) = c.lm_requests()
        assert [i.identifier for i in lm_req.items] == [f"window-0-{w}" for w in range(WINDOWS)]
        # Three of the minute's four items are spent: one image is admitted, a second is not.
        (await orch.admission.admit(False, "a", items=1)).release()
        with pytest.raises(AdmissionRefused) as e:
            await orch.admission.admit(False, "a", items=1)
        assert e.value.status == 429 and "images_per_minute" in e.value.message

    run_cluster(body, n_encoders=1, n_lms=1)
