"""DCP's stream extension for our ``resilient.bgzstd/1`` coding (:mod:`.codec`), apart from the codec so that the
codec, and ``resilient ckpt ls`` through it, import without torch.

``dcp.load`` reads a step whose items are coded so when given :func:`extension_registry`
(``FileSystemReader(path, _extension_registry=extension_registry())``); for writing,
``FileSystemWriter(..., _extensions=[ByteGroupZstd(4)])``.
"""

from __future__ import annotations

import io
from typing import IO, Any

from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension

from resilient.checkpoint.format.codec import decode, encode


class _EncodeOnClose(io.RawIOBase):
    def __init__(self, output: IO[bytes], elem_size: int):
        super().__init__()
        self._out, self._es, self._buf = output, elem_size, bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        self._buf += mv
        return len(mv)

    def close(self) -> None:
        if not self.closed:
            self._out.write(encode(self._buf, self._es))
            self._buf = bytearray()
        super().close()


class ByteGroupZstd(StreamTransformExtension):
    """DCP stream extension ``resilient.bgzstd/1``. For writing (``FileSystemWriter(...,
    _extensions=[ByteGroupZstd(4)])``) the element size is the writer's; the stream records it, so
    reading needs nothing but :func:`extension_registry`."""

    def __init__(self, elem_size: int = 4):
        super().__init__()
        self.elem_size = elem_size

    @staticmethod
    def registry_name() -> str:
        return "resilient.bgzstd"

    @staticmethod
    def from_descriptor(version: str) -> "ByteGroupZstd":
        if str(version).partition(".")[0] != "1":
            raise ValueError(f"resilient.bgzstd: unknown version {version!r}; upgrade resilient")
        return ByteGroupZstd()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        return _EncodeOnClose(output, self.elem_size)  # type: ignore[return-value]

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return io.BytesIO(decode(input.read()))


def extension_registry() -> ExtensionRegistry:
    """DCP's registry (``stream.zstd``) plus ``resilient.bgzstd``: pass it to a reader as
    ``_extension_registry``."""
    reg = ExtensionRegistry()
    reg.register(ByteGroupZstd)
    return reg
