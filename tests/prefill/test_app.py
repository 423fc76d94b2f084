"""The prefill HTTP API in process: bad input is a 400 with a reason, an unreachable decode a 502."""

import pytest

from mooncake_lite.model.weights import build_model
from mooncake_lite.prefill.app import make_app
from tests.pd.harness import cluster

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("body, status, fragment", [
    (b"{", 400, "invalid JSON"),
    (b'{"request_id": "r"}', 400, "missing field"),
    (b'{"request_id": "r", "transfer_id": "t", "token_ids": [1, 2], "decode_data": "x", "sampling": {}}',
     400, "decode_data"),
    (b'{"request_id": "r", "transfer_id": "t", "token_ids": [1, 99999], "decode_data": "127.0.0.1:1", '
     b'"sampling": {}}', 400, "token ids"),
    (b'{"request_id": "r", "transfer_id": "t", "token_ids": [1, 2], "decode_data": "127.0.0.1:1", '
     b'"sampling": {}}', 502, "lost a peer during the prefill (KV to decode 127.0.0.1:1): "),
])
async def test_prefill_api_errors(aiohttp_client, body, status, fragment):
    async with cluster(build_model("tiny"), block_size=8) as c:
        client = await aiohttp_client(make_app(c.prefill))
        resp = await client.post("/v1/prefill", data=body)
        assert resp.status == status and fragment in (await resp.json())["error"]
        assert (await (await client.get("/v1/load")).json())["num_queued"] == 0
        assert (await (await client.post("/v1/abort", json={"request_id": "r"})).json()) == {"aborted": False}
