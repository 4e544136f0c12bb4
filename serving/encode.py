"""Encoders of a request's output: float frames in [0, 1] to PNG or H.264 MP4 bytes.

Owns: `encode_png`, `encode_mp4` (with a muxed AAC sound track where the family makes one) and
`encode` (a family adapter's `Decoded` to the bytes and media type a response carries).
Deterministic: a fixed thread count and bit-exact flags, so equal frames and samples give equal
bytes on every host.
Must never: import torch, or depend on the host's core count.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from dlo.engine.families.pipelines import Decoded


def _to_uint8(x: Any) -> Any:
    import numpy as np

    return (np.clip(np.asarray(x, dtype=np.float32), 0.0, 1.0) * 255.0).round().astype(np.uint8)


def encode_png(frame: Any) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(_to_uint8(frame)).save(buf, format="PNG")
    return buf.getvalue()


# x264 settings of every MP4: a fixed thread count (x264's output depends on the thread count, never
# on the host's cores or SIMD, so bytes stay equal across ranks, pods and machines) and the veryfast
# preset. On the random-weight frames of the full-size benchmark (17 x 832 x 480, noise-like) one
# thread of the default preset took 2.5 s on a 2-core machine; 4 threads of veryfast take 0.4 s.
MP4_OUTPUT_PARAMS = ("-threads", "4", "-preset", "veryfast", "-bitexact")


def encode_mp4(frames: Any, fps: int, audio: Any = None, sample_rate: int = 0) -> bytes:
    """H.264 MP4 through imageio-ffmpeg (`MP4_OUTPUT_PARAMS`); with `audio` (float samples in
    [-1, 1], (channels, samples) at `sample_rate`) an AAC track muxed in (`MP4_AUDIO_PARAMS`)."""
    import imageio_ffmpeg
    import numpy as np

    arr = _to_uint8(frames)
    h, w = arr.shape[1:3]
    folder = tempfile.mkdtemp(prefix="dlo-mp4-")
    path = os.path.join(folder, "out.mp4")
    try:
        extra: dict[str, Any] = {}
        params = list(MP4_OUTPUT_PARAMS)
        if audio is not None:
            extra = {"audio_path": _write_wav(os.path.join(folder, "audio.wav"), audio, sample_rate),
                     "audio_codec": "aac"}
            params += MP4_AUDIO_PARAMS
        writer = imageio_ffmpeg.write_frames(
            path, (w, h), fps=fps, codec="libx264", pix_fmt_out="yuv420p", macro_block_size=1,
            ffmpeg_log_level="error", output_params=params, **extra,
        )
        writer.send(None)
        for frame in arr:
            writer.send(np.ascontiguousarray(frame))
        writer.close()
        return Path(path).read_bytes()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# The sound track: AAC (ffmpeg's own encoder, deterministic under `-bitexact`), cut to the video's
# length (the pipelines make a few samples more or less than frames / fps).
MP4_AUDIO_PARAMS = ["-shortest"]


def _write_wav(path: str, audio: Any, sample_rate: int) -> str:
    """16-bit PCM WAV of float samples (channels, samples), clipped to [-1, 1]."""
    import wave

    import numpy as np

    samples = np.asarray(audio, dtype=np.float32)
    if samples.ndim == 1:
        samples = samples[None]
    if sample_rate <= 0:
        raise ValueError(f"a sound track needs its sample rate, got {sample_rate}")
    pcm = (np.clip(samples, -1.0, 1.0).T * 32767.0).round().astype("<i2")
    with wave.open(path, "wb") as f:
        f.setnchannels(samples.shape[0])
        f.setsampwidth(2)
        f.setframerate(sample_rate)
        f.writeframes(pcm.tobytes())
    return path


def encode(decoded: Decoded, fps: int) -> tuple[list[bytes], str]:
    """(outputs, media type): one MP4 for a video (with its sound track when it has one), one PNG per image."""
    if decoded.video is not None:
        return [encode_mp4(decoded.video, fps, decoded.audio, decoded.sample_rate)], "video/mp4"
    return [encode_png(img) for img in decoded.images], "image/png"
