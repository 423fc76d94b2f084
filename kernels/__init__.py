"""Hot data-movement and attention kernels.

Each operation has a plain torch reference that runs everywhere (``*_ref``) and, where a GPU is
present and Triton imports, a faster version chosen at run time. Call the un-suffixed names.
"""

from mooncake_kernels.attention import packed_prefill_attention, paged_decode_attention, paged_prefill_attention
from mooncake_kernels.kv_pack import gather_tokens, pack_blocks, scatter_tokens, unpack_blocks

__all__ = ["packed_prefill_attention", "paged_decode_attention", "paged_prefill_attention", "gather_tokens", "scatter_tokens",
           "pack_blocks", "unpack_blocks"]
