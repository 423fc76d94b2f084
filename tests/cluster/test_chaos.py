"""One kill of ``mooncake bench chaos`` on the smallest real cluster: SIGKILL of the prefill under
streaming load through the official openai client. No request hangs, the prefill comes back and
rejoins, requests after it are served, and no block, slot, lease or in-flight request leaks."""

import pytest

pytest.importorskip("openai")

from mooncake_lite.bench.chaos import parse_args, run  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def test_a_killed_prefill_heals_without_hangs_or_leaks():
    args = parse_args(["--model", "tiny", "--prefill", "1", "--decode", "1", "--victims", "prefill-0",
                       "--up-args", "--block-size 16 --conductor-args '--admission none' "
                                    "--prefill-args=--no-profile --decode-args=--no-profile",
                       "--concurrency", "2", "--max-tokens", "4", "--settle-s", "1", "--lead-s", "1",
                       "--window-s", "2", "--quiet-s", "5", "--hang-s", "20", "--rejoin-timeout-s", "60"])
    res = run(args)
    (kill,) = res["kills"]
    assert kill["hung"] == 0, kill
    assert kill["rejoined_s"] is not None, kill            # back, and counted by the conductor
    assert kill["service_restored_s"] is not None, kill    # a request after the kill was served
    assert kill["ok"] > 0 and kill["leaked"] == {}, kill
    assert res["up_exit_code"] == 0
