"""Codecs: how a block of values travels compressed inside a collective.

One interface: `encoded_nbytes(n, dtype)` is the exact size of the encoding of n values
(every codec here is fixed-rate, so a receiver knows each message's size from the
schedule), `encode(src, dst)` writes it into a uint8 tensor, and `decode(src, dst, op)`
overwrites `dst` (op None) or combines the decoded values into it (dst = op(dst, decoded)).
The int8 and cast kernels are native (csrc/codec.cpp), release the GIL and run inside the
C++ executor too; GPU builds have them for GPU tensors (csrc/gpu/codec.cuh, the same
encodings). zfp runs through zfpy, on CPU tensors in the Python executor.

Bounds, per value x of a block (the tests hold each codec to its own):

  int8    block-wise absmax quantization (ZeRO++), one fp32 scale per 128 values:
          |decoded - x| <= absmax(its group of 128) / 254, plus the payload dtype's
          rounding when decoded into fp16/bf16. A group holding NaN or Inf decodes as NaN
          (the non-finite value stays visible). Two edges: a group whose absmax is fp32's
          largest finite value decodes it as Inf (127 x the rounded-up scale overflows),
          and in a group of subnormals (absmax below about 1e-36) the scale itself rounds,
          so the error is up to the smallest subnormal, 1.4e-45, not absmax / 254. fp32,
          fp16 and bf16 payloads; 3.9x smaller than fp32 (1.9x than 16-bit).
  bf16    a cast of fp32 payloads, round to nearest even: relative error <= 2^-8 for
          |x| < 3.3961e38, and Inf above (bf16's largest finite value rounds up there); NaN
          and Inf kept; 16-bit payloads are refused (the cast would be lossless and useless).
  fp16    a cast of fp32 payloads: relative error <= 2^-11 for |x| in [2^-14, 65504],
          absolute <= 2^-25 below; |x| >= 65520 becomes Inf (65504 < |x| < 65520 rounds to
          65504, as torch's cast does); NaN kept.
  zfp:R   ZFP's fixed-rate mode (the OSU paper's codec) through zfpy, R bits per value
          (3..32: below 3 zfp writes more than the fixed size, and zfpy corrupts its heap):
          blocks of 4 values coded together; fixed rate trades accuracy for a fixed size,
          so there is no pointwise guarantee: measured on uniform values in [-1, 1], the
          worst error is 2^-10.5 at R = 16 and 2^-2.4 at R = 8; the tests take 2^-(R - 6)
          of the largest magnitude as its unit. NaN and Inf do not survive it: zfp codes
          finite values, and a block holding one decodes as finite garbage (int8 keeps
          them visible). fp32 and fp64 payloads.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Optional

import numpy as np
import torch

from pccl.core.dtypes import OPS, dtype_code, reduce_

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class CodecError(ValueError):
    """An unknown codec name, or a payload a codec cannot take."""


def _combine(dst: torch.Tensor, values: torch.Tensor, op: Optional[str]) -> None:
    if op is None:
        dst.copy_(values)
    else:
        reduce_(dst, values, op)


class Codec(ABC):
    name: str
    dtypes: tuple[torch.dtype, ...]
    native: Optional[int] = None   # the C++ executor's code for it (csrc/codec.h), None: Python only
    per_message = False            # encode/decode at every hop (the baseline), not collective-level

    def check(self, dtype: torch.dtype) -> None:
        """Raise CodecError unless this codec takes `dtype` payloads."""
        if dtype not in self.dtypes:
            why = "integer data is never compressed lossily" if not dtype.is_floating_point else \
                f"{self.name} would not make {dtype} data smaller" if isinstance(self, Cast) and dtype.itemsize <= 2 \
                else "not supported"
            raise CodecError(f"codec {self.name!r} takes {tuple(str(d) for d in self.dtypes)} payloads, got {dtype}: "
                             f"{why}")

    @abstractmethod
    def encoded_nbytes(self, n: int, dtype: torch.dtype) -> int:
        """Exact bytes of the encoding of n values."""

    @abstractmethod
    def encode(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Encode contiguous `src` into the uint8 tensor `dst` of encoded_nbytes bytes."""

    @abstractmethod
    def decode(self, src: torch.Tensor, dst: torch.Tensor, op: Optional[str] = None) -> None:
        """Decode `src` (an encoding of dst.numel() values) into `dst`: overwrite (op None)
        or dst = op(dst, decoded) (sum, avg as sum, max, min)."""

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """What a receiver decodes of `x`: decode(encode(x))."""
        encoded = torch.empty(self.encoded_nbytes(x.numel(), x.dtype), dtype=torch.uint8, device=x.device)
        self.encode(x, encoded)
        out = torch.empty_like(x)
        self.decode(encoded, out)
        return out

    def __repr__(self) -> str:
        return f"Codec({self.name})"


class NativeCodec(Codec):
    """A codec whose kernels are native (csrc/codec.cpp, GIL released), shared by the C++
    executor and the Python executors; on GPU tensors, the GPU build's kernels
    (csrc/gpu/codec.cuh, the same encodings) on the current stream."""

    def __init__(self) -> None:
        from pccl import _native

        self._native = _native

    def encoded_nbytes(self, n: int, dtype: torch.dtype) -> int:
        return self._native.encoded_bytes(self.native, n)

    def _stream(self, t: torch.Tensor) -> Optional[int]:
        """The current stream of a GPU tensor's device; None for host memory."""
        if t.device.type == "cpu":
            return None
        if self._native.gpu_platform is None:
            raise CodecError(f"codec {self.name} on {t.device} tensors needs pccl's GPU build (make GPU=cuda or "
                             f"GPU=hip)")
        return torch.cuda.current_stream(t.device).cuda_stream

    def _checked(self, values: torch.Tensor, encoding: torch.Tensor) -> None:
        """The kernels take raw pointers: values and their encoding must be contiguous, on
        one device, the encoding uint8 of exactly encoded_nbytes (else memory past them
        would be read or written)."""
        self.check(values.dtype)
        size = self.encoded_nbytes(values.numel(), values.dtype)
        if values.device != encoding.device:
            raise CodecError(f"codec {self.name}: values on {values.device} and their encoding on "
                             f"{encoding.device}: both must be on one device")
        if not (values.is_contiguous() and encoding.is_contiguous()) or encoding.dtype != torch.uint8 \
                or encoding.numel() != size:
            raise CodecError(f"codec {self.name}: {values.numel()} {values.dtype} values take a contiguous uint8 "
                             f"encoding of {size} bytes, got {encoding.dtype} of {encoding.numel()}"
                             f"{'' if encoding.is_contiguous() and values.is_contiguous() else ', not contiguous'}")

    def encode(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self._checked(src, dst)
        stream = self._stream(src)
        if stream is None:
            self._native.encode(self.native, dst.data_ptr(), src.data_ptr(), src.numel(), dtype_code(src.dtype))
        else:
            with torch.cuda.device(src.device):   # the kernel launches on the current device
                self._native.gpu_encode(self.native, dst.data_ptr(), src.data_ptr(), src.numel(),
                                        dtype_code(src.dtype), stream)

    def decode(self, src: torch.Tensor, dst: torch.Tensor, op: Optional[str] = None) -> None:
        self._checked(dst, src)
        args = (self.native, dst.data_ptr(), src.data_ptr(), dst.numel(), dtype_code(dst.dtype),
                -1 if op is None else OPS[op])
        stream = self._stream(dst)
        if stream is None:
            self._native.decode(*args)
        else:
            with torch.cuda.device(dst.device):
                self._native.gpu_decode(*args, stream)


class Int8(NativeCodec):
    name = "int8"
    dtypes = FLOATS
    native = 0

    def __init__(self) -> None:
        super().__init__()
        self.group = self._native.int8_group


class Cast(NativeCodec):
    """fp32 payloads carried as a 16-bit float type."""

    dtypes = (torch.float32,)

    def __init__(self, name: str):
        super().__init__()
        self.name, self.native = name, {"bf16": 1, "fp16": 2}[name]


MIN_ZFP_RATE = 3   # bits per value: zfp's fixed rate spends at least 12 bits on a block of 4


class Zfp(Codec):
    """ZFP fixed-rate mode: one-dimensional blocks of 4 values, each coded in 4 * rate bits;
    the stream is whole 64-bit words (zfpy, no header)."""

    dtypes = (torch.float32, torch.float64)

    def __init__(self, rate: int):
        if not (isinstance(rate, int) and MIN_ZFP_RATE <= rate <= 32):
            raise CodecError(f"zfp rate must be an integer number of bits per value in {MIN_ZFP_RATE}..32, got "
                             f"{rate!r} (below {MIN_ZFP_RATE} zfp writes more than its fixed size)")
        try:
            import zfpy
        except ImportError as e:
            raise CodecError(f"codec zfp:{rate} needs the zfpy package (pip install zfpy): {e}") from None
        self._zfpy, self.rate, self.name = zfpy, rate, f"zfp:{rate}"

    def encoded_nbytes(self, n: int, dtype: torch.dtype) -> int:
        return 8 * math.ceil(math.ceil(n / 4) * 4 * self.rate / 64)

    def encode(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        if not src.numel():   # zfpy faults on no values (a bus error)
            return
        stream = self._zfpy.compress_numpy(src.numpy(), rate=self.rate, write_header=False)
        if len(stream) != dst.numel():
            raise RuntimeError(f"zfp:{self.rate} wrote {len(stream)} bytes for {src.numel()} values, expected "
                               f"{dst.numel()}")
        dst.numpy()[:] = np.frombuffer(stream, dtype=np.uint8)

    def decode(self, src: torch.Tensor, dst: torch.Tensor, op: Optional[str] = None) -> None:
        if not dst.numel():
            return
        ztype = self._zfpy.dtype_to_ztype(np.dtype(str(dst.dtype).removeprefix("torch.")))
        values = self._zfpy._decompress(src.numpy().tobytes(), ztype, [dst.numel()], rate=self.rate)
        _combine(dst, torch.from_numpy(values), op)


class PerMessage(Codec):
    """A codec applied per point-to-point message (every send encodes, every receive
    decodes: pccl.ir.compressed's per_message plan), the baseline collective-level
    compression is measured against: "p2p:int8"."""

    per_message = True

    def __init__(self, inner: Codec):
        self.inner, self.name, self.dtypes, self.native = inner, f"p2p:{inner.name}", inner.dtypes, inner.native

    def encoded_nbytes(self, n: int, dtype: torch.dtype) -> int:
        return self.inner.encoded_nbytes(n, dtype)

    def encode(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.inner.encode(src, dst)

    def decode(self, src: torch.Tensor, dst: torch.Tensor, op: Optional[str] = None) -> None:
        self.inner.decode(src, dst, op)


def codec(name) -> Optional[Codec]:
    """The codec a name stands for: "int8", "bf16", "fp16", "zfp:RATE", and "p2p:" before
    any of them for the per-message baseline; None or "none": no compression. A Codec
    passes through."""
    if name is None or isinstance(name, Codec):
        return name
    if not isinstance(name, str):
        raise CodecError(f"compression must be a codec name such as 'int8', 'bf16', 'fp16' or 'zfp:8', got {name!r}")
    key = name.strip().lower()
    if key in ("", "none"):
        return None
    if key.startswith("p2p:"):
        inner = codec(key[4:])
        if inner is None or isinstance(inner, PerMessage):
            raise CodecError(f"p2p: takes a codec, e.g. 'p2p:int8', got {name!r}")
        return PerMessage(inner)
    if key == "int8":
        return Int8()
    if key in ("bf16", "fp16"):
        return Cast(key)
    if key.startswith("zfp:"):
        try:
            rate = int(key[4:])
        except ValueError:
            raise CodecError(f"zfp needs a rate, bits per value: 'zfp:8' or 'zfp:16', got {name!r}") from None
        return Zfp(rate)
    raise CodecError(f"unknown codec {name!r}; expected none, int8, bf16, fp16 or zfp:RATE (e.g. zfp:8)")


LEVELS = ("flat", "intra", "inter")


def per_level(compression) -> dict:
    """{level: codec} of a collective's `compression` argument: one codec (or name) is the
    flat schedule's and, in a two-level plan, the inter-node level's only (where the slow
    link is); a dict names the plan levels ({"intra": ..., "inter": ...}). Levels without
    compression are left out."""
    levels = dict(compression) if isinstance(compression, dict) else {"flat": compression, "inter": compression}
    unknown = set(levels) - set(LEVELS)
    if unknown:
        raise ValueError(f"compression per level takes the keys 'intra' and 'inter', got {sorted(unknown)}")
    codecs = {level: codec(name) for level, name in levels.items()}
    return {level: c for level, c in codecs.items() if c is not None}
