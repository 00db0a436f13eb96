"""Compression kernels: signs packed to bits and back."""
from onebitlamb.compression.packing import FLOAT_DTYPES, pack_signs, packed_size, unpack_signs

__all__ = ["FLOAT_DTYPES", "pack_signs", "packed_size", "unpack_signs"]
