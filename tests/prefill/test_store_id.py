"""Which store id a prefill registers: the one its store gives itself, else --store as given."""

import pytest

from mooncake_lite.prefill.app import store_id
from mooncake_lite.prefill.config import Config


class Store:
    def __init__(self, answer):
        self.answer = answer

    async def store_id(self):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


@pytest.mark.parametrize("answer, expected", [
    ("10.0.0.7:8101", "10.0.0.7:8101"),                       # the store's own name wins
    (None, "127.0.0.1:8101"),                                 # an older store says nothing
    (ConnectionRefusedError("no store yet"), "127.0.0.1:8101"),
])
async def test_store_id(answer, expected):
    cfg = Config(model="tiny", store="127.0.0.1:8101")
    assert await store_id(cfg, Store(answer)) == expected


async def test_without_a_store_process_there_is_nothing_to_ask():
    assert await store_id(Config(model="tiny"), object()) is None
