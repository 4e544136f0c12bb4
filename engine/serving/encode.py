"""Encoders of a request's output: float frames in [0, 1] to PNG or H.264 MP4 bytes.

Owns: `encode_png`, `encode_mp4` and `encode` (a family adapter's `Decoded` to the bytes and media
type a response carries). Deterministic: one encoder thread and bit-exact flags, so equal frames
give equal bytes on every host.
Must never: import torch, or depend on the host's core count.
"""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path
from typing import Any

from dlo.engine.families.base import Decoded


def _to_uint8(x: Any) -> Any:
    import numpy as np

    return (np.clip(np.asarray(x, dtype=np.float32), 0.0, 1.0) * 255.0).round().astype(np.uint8)


def encode_png(frame: Any) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(_to_uint8(frame)).save(buf, format="PNG")
    return buf.getvalue()


def encode_mp4(frames: Any, fps: int) -> bytes:
    """H.264 MP4 through imageio-ffmpeg; one encoder thread so the bytes never depend on the host."""
    import imageio_ffmpeg
    import numpy as np

    arr = _to_uint8(frames)
    h, w = arr.shape[1:3]
    fd, path = tempfile.mkstemp(suffix=".mp4")
    os.close(fd)
    try:
        writer = imageio_ffmpeg.write_frames(
            path, (w, h), fps=fps, codec="libx264", pix_fmt_out="yuv420p", macro_block_size=1,
            ffmpeg_log_level="error", output_params=["-threads", "1", "-bitexact"],
        )
        writer.send(None)
        for frame in arr:
            writer.send(np.ascontiguousarray(frame))
        writer.close()
        return Path(path).read_bytes()
    finally:
        os.unlink(path)


def encode(decoded: Decoded, fps: int) -> tuple[list[bytes], str]:
    """(outputs, media type): one MP4 for a video, one PNG per image."""
    if decoded.video is not None:
        return [encode_mp4(decoded.video, fps)], "video/mp4"
    return [encode_png(img) for img in decoded.images], "image/png"
