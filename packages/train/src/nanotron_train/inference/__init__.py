"""Decoding a checkpoint's model: sampling, the KV-cache loop, pipelined steps."""
