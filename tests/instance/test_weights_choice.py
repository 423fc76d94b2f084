"""``--weights auto``: what each role holds of a GGUF's quantized weights, and why, from one rule
(``instance.config.weights_choice``) that the instance and ``mooncake up``'s memory plan share."""

from __future__ import annotations

import logging

from mooncake_lite.decode.config import Config as DecodeConfig
from mooncake_lite.instance.config import HYBRID_MEMORY_SHARE, weights_choice
from mooncake_lite.instance.runner import served_weights
from mooncake_lite.prefill.config import Config as PrefillConfig
from tests.real_model import needs_smollm

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


@needs_smollm
def test_where_blocks_cannot_compute_the_instance_says_it_serves_the_dequantized_values(caplog):
    """bfloat16 (or a GPU): the loader dequantizes whatever ``--weights`` says, so the log says so
    rather than promising a float copy beside blocks that are not kept."""
    caplog.set_level(logging.INFO, "mooncake_lite.instance.runner")
    assert served_weights(PrefillConfig(dtype="bfloat16")) == "dequantize"
    assert "weights dequantize (a GGUF's blocks compute only on a CPU in float32" in caplog.text
    from mooncake_kernels.quant_build import library
    assert served_weights(DecodeConfig(dtype="float32")) == ("quantized" if library() is not None else "dequantize")
