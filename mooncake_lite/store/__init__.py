"""The store role: KV block pool (DRAM slab + SSD tier) served over the binary transfer protocol."""
