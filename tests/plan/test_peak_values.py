"""Bounds from measured peaks (`dlo.plan.peak_values`): what a shape not measured itself may be
told from shapes that were - a shape covering one that ran out of memory does not fit; one covered
by a measured shape needs no more than it did; a video and an image never bound each other."""

from __future__ import annotations

from dlo.plan.memory_model import Shape
from dlo.plan.peak_values import AtLeast, covers, measured_bound

GB = 10**9


def test_covering_is_by_frames_and_pixels_and_a_video_frame_by_its_size():
    assert covers(Shape(1920, 1920, 1, 3), Shape(1920, 1919, 1, 3))
    assert covers(Shape(1024, 1024, 1, 4), Shape(1920, 1088, 1, 2))  # images: pixels in all
    assert not covers(Shape(1920, 1919, 1, 3), Shape(1920, 1920, 1, 3))
    assert covers(Shape(832, 480, 81), Shape(832, 480, 17)) and not covers(Shape(832, 480, 17), Shape(832, 480, 81))
    assert not covers(Shape(832, 480, 81), Shape(1280, 720, 17))  # a video frame smaller: no bound
    assert not covers(Shape(1920, 1920, 81), Shape(832, 480, 1)) and not covers(Shape(832, 480, 1, 4), Shape(832, 480, 5))


def test_a_bound_is_out_of_memory_above_a_refused_shape_and_the_least_covering_need_below_measured_ones():
    measured = {("vae_decode", Shape(1920, 1920, 1, 3)): AtLeast(85 * GB),
                ("vae_decode", Shape(1920, 1920, 1, 2)): 75 * GB,
                ("vae_decode", Shape(1920, 1920, 1, 1)): 37 * GB,
                ("vae_decode", Shape(832, 480, 81)): 9 * GB,
                ("transformer", Shape(1920, 1920, 1, 1)): 2 * GB}
    refused = measured_bound("vae_decode", Shape(1920, 1920, 1, 4), measured)
    assert isinstance(refused, AtLeast) and refused == 85 * GB
    assert measured_bound("vae_decode", Shape(1024, 1024, 1, 2), measured) == 37 * GB  # the least covering
    assert measured_bound("vae_decode", Shape(1920, 1920, 1, 2), measured) == 75 * GB
    assert measured_bound("vae_decode", Shape(832, 480, 17), measured) == 9 * GB  # a video by a video
    assert measured_bound("vae_decode", Shape(1280, 720, 17), measured) is None  # a larger frame: unbounded
    assert measured_bound("transformer", Shape(1920, 1920, 1, 2), measured) is None  # another part's never



def test_a_decode_is_not_measured_where_its_transformer_call_ran_out_of_memory():
    from dlo.engine.peaks import unservable

    measured = {("transformer", Shape(1920, 1920, 129)): AtLeast(85 * GB), ("transformer", Shape(1920, 1920)): 2 * GB}
    assert unservable("vae_decode", Shape(1920, 1920, 129), measured)
    assert unservable("vae_decode_tiled", Shape(1920, 1920, 129), measured)
    assert not unservable("vae_decode", Shape(1920, 1920, 81), measured)  # its call not known not to fit
    assert not unservable("vae_decode", Shape(1920, 1920), measured)
    assert not unservable("transformer", Shape(1920, 1920, 129), measured)  # the call itself: its own bound


def test_a_covering_shape_measured_at_zero_bytes_bounds_the_prediction_to_zero():
    """A measured need of 0 bytes (nothing new reserved) is a bound like any other, not "no bound"."""
    from dlo.plan.memory_model import Geometry, PipelineMemory, RequestBounds
    from dlo.plan.memory_table import MemoryTable

    memory = PipelineMemory("wan", Geometry(16, 4), {}, {}, {}, RequestBounds(832, 480, 81), 0, MemoryTable.load(),
                            measured={("vae_decode", Shape(832, 480, 81)): 0})
    table, extrapolated = memory.predicted("vae_decode", Shape(832, 480, 41), table_only=True)
    assert table > 0 and not extrapolated  # within the table's shapes: its figure would stand unbounded
    assert memory.predicted("vae_decode", Shape(832, 480, 41)) == (0, False)
