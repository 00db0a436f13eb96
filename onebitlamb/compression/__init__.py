"""The codecs: how values travel between ranks, and what each costs on the wire.

Every codec implements one protocol, ``codec.Codec``: a ``name``; ``to_wire_`` (the tensor sent
for a row of float32 values) and ``from_wire`` (the values back, optionally divided as the average
divides); ``carries_error`` (error feedback: what the code leaves out is kept in a float32 error
buffer, one element per element encoded, and sent with the next call); ``block`` (the elements
encoded as a unit, to which an average aligns every tensor); ``wire_bytes(n)`` (the exact bytes of
``n`` elements, what ``CommStats`` counts) and ``bytes_per_element`` (the long-run rate the cost
model prices). The collectives (``onebitlamb.comm``) and the optimizers' exchange ask the codec
these, never its type.

- ``wire``: float32 and bfloat16, no error feedback: summed by one all-reduce.
- ``blockwise``: int8, int4 and int2 codes with a float32 step per block of 256, error feedback:
  the warm-up's quantised average.
- ``onebit`` (with ``packing``, ``native``, ``triton_codec``): the signs and one scale a row, error
  feedback: the compression stage's 1-bit all-reduce, on CPU loops or fused Triton kernels.

A codec is chosen by name through a registry (``register_codec``, ``codec_for``; ``warmup_format``
is the optimizers' ``warmup_dtype`` lookup). A new codec is one module here that defines a class
implementing ``Codec`` and registers an instance of it (imported below, so that importing the
package registers it); docs/algorithm.md, "Adding a codec", says what each member must do.
"""
from onebitlamb.compression.codec import Codec, codec_for, codec_names, register_codec, unregister_codec
from onebitlamb.compression.wire import BFLOAT16, FLOAT32, warmup_format, wire_format  # registers them first
from onebitlamb.compression.blockwise import INT2, INT4, INT8, BlockwiseCodec
from onebitlamb.compression.onebit import ONEBIT
from onebitlamb.compression.packing import FLOAT_DTYPES, pack_signs, packed_size, unpack_signs

__all__ = ["BFLOAT16", "BlockwiseCodec", "Codec", "FLOAT32", "FLOAT_DTYPES", "INT2", "INT4", "INT8", "ONEBIT",
           "codec_for", "codec_names", "pack_signs", "packed_size", "register_codec", "unpack_signs",
           "unregister_codec", "warmup_format", "wire_format"]
