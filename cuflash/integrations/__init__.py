"""Integrations of cuflash into other libraries; each submodule imports its library, this package nothing.

    cuflash.integrations.transformers   Hugging Face transformers: attn_implementation="cuattn"
"""
