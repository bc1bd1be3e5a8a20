"""kvtier: a per-node tiered KV-cache storage daemon for LLM inference."""

__version__ = "0.1.0"
