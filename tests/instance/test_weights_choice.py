"""``--weights auto``: what each role holds of a GGUF's quantized weights, and why, from one rule
(``instance.config.weights_choice``) that the instance and ``mooncake up``'s memory plan share."""

from __future__ import annotations

from mooncake_lite.decode.config import Config as DecodeConfig
from mooncake_lite.instance.config import HYBRID_MEMORY_SHARE, weights_choice
from mooncake_lite.prefill.config import Config as PrefillConfig

MiB = 1 << 20


def test_auto_keeps_a_float_copy_on_a_prefill_only_where_it_fits():
    dense = 512 * MiB
    assert PrefillConfig().weights == DecodeConfig().weights == "auto"
    mode, why = weights_choice("auto", PrefillConfig.AUTO_WEIGHTS, dense, dense * HYBRID_MEMORY_SHARE)
    assert mode == "hybrid" and "512 MiB" in why and f"1/{HYBRID_MEMORY_SHARE}" in why
    mode, why = weights_choice("auto", PrefillConfig.AUTO_WEIGHTS, dense, dense * HYBRID_MEMORY_SHARE - 1)
    assert mode == "quantized" and "over" in why
    assert weights_choice("auto", DecodeConfig.AUTO_WEIGHTS, dense, 1 << 40)[0] == "quantized"


def test_an_explicit_mode_is_served_as_asked():
    for mode in ("quantized", "dequantize", "hybrid"):
        assert weights_choice(mode, PrefillConfig.AUTO_WEIGHTS, 1 << 40, 0) == (mode, f"--weights {mode}")
