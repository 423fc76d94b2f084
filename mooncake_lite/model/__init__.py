"""The LLaMA-family model runner: model definition, paged KV cache, sampling, tokenizers.

The model knows nothing about networking; prefill/decode roles drive it layer by layer.
"""
