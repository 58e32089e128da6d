"""The public path of deft's 8-bit comm hook (README: "also usable with torch DDP"); it lives in
:mod:`deft.runtime.codecs.int8`."""

from deft.runtime.codecs.int8 import BLOCK, LEVELS, Int8State, block_maxima, decode, encode, int8_compress_hook

__all__ = ["BLOCK", "LEVELS", "Int8State", "block_maxima", "decode", "encode", "int8_compress_hook"]
