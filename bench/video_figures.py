"""The figures of one video run that the published system reports: videos per hour, generated frames
per second and watt-hours per video.

Owns: `video_figures` (from a run's wall seconds, frames and videos, and the joules NVML counted
per GPU over that wall time, `dlo.engine.energy.EnergyMeter`); `None` where the device has no
energy counter, never 0.
Must never: estimate energy from power limits or utilisation (a figure is measured or absent).
"""

from __future__ import annotations


def video_figures(seconds: float, frames: int, videos: int = 1, joules_per_gpu: list[float] | None = None) -> dict:
    """{videos_per_hour, generated_frames_per_second, energy_joules_per_gpu, wh_per_video}."""
    if seconds <= 0:
        raise ValueError(f"a run takes time: {seconds} s")
    joules = sum(joules_per_gpu) if joules_per_gpu is not None else None
    return {
        "videos_per_hour": round(3600.0 * videos / seconds, 3),
        "generated_frames_per_second": round(frames * videos / seconds, 3),
        "energy_joules_per_gpu": [round(j, 1) for j in joules_per_gpu] if joules_per_gpu is not None else None,
        "wh_per_video": round(joules / 3600.0 / videos, 4) if joules is not None else None,
    }
