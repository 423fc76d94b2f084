"""`mooncake bench conductor` runs end to end on a tiny cluster and prints one JSON object.
(Speed itself is the bench's business, never asserted here.)"""

import orjson
import pytest

from mooncake_lite.bench.conductor import cli as conductor


def test_json_has_every_figure(capsys):
    assert conductor.main(["--json", "--num-blocks", "2000", "--iterations", "50"]) == 0
    figures = orjson.loads(capsys.readouterr().out)
    assert figures["decision.indexed_blocks"] >= 2000
    assert figures["decision.num_prefill"] == figures["decision.num_decode"] == 16
    for adm in ("early", "predictive"):
        for snap in ("conductor", "warm", "fresh"):
            for clock in ("", "cpu_"):
                k = f"decision.{adm}_{snap}_{clock}"
                assert figures[k + "median_us"] > 0
                assert figures[k + "p99_us"] >= figures[k + "median_us"]
                assert figures[k + "median_vs_target"] > 0


def test_human_output_and_unknown_part(capsys):
    assert conductor.main(["--num-blocks", "500", "--iterations", "20", "--num-prefill", "2",
                           "--num-decode", "2"]) == 0
    assert "median" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        conductor.main(["--parts", "nope"])
    for bad in ("0", "nan", "-1"):              # refused before the cluster is built
        with pytest.raises(SystemExit):
            conductor.main(["--uniform-decode", bad])
        assert "must be a positive number of seconds" in capsys.readouterr().err
