"""Fewer bytes on the wire: compressed gradient all-reduce for the 1-bit optimizers (signs plus a
scale per chunk, with error feedback) and the ZeRO++ quantizers (int8 weights, int4 gradients)."""

from trident.compression.error_feedback import ErrorFeedback  # noqa: E402
from trident.compression.onebit import CompressedAllReduce, pack_signs, unpack_signs  # noqa: E402
