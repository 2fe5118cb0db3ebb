"""Helpers for the cuDNN parity tests: the parsed headers and a C probe compiled against them."""
