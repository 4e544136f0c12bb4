"""A rank's peak device memory for a deployment: the weights it places and what the largest request
its limits accept needs beyond them, from the measured table (`dlo.plan.memory_table`).

Owns: `RequestBounds` (the limits that bound a request's shape) and `largest_requests`,
`placed_weight_bytes` / `padded_shard_bytes` (what one streamed or resident model puts on a rank's
device, per mode: the one definition the policy uses too), `PipelineMemory.rank(mode, g)` ->
`RankMemory`, and `pipeline_memory`,
which reads a pipeline folder's facts (checkpoint headers only) into a `PipelineMemory`.
Must never: import torch, or put a number where the table has none: an unmeasured family gives
`request_bytes = None` and says why (the policy then falls back to its reserve ratio).

A rank's peak (bytes):
    weights  = sum over components of what each places (below) + the table's weights overhead of it
    request  = max over the largest accepted requests and the parts a request runs (text encoders,
               image encoder and VAE encode for image-to-video, each transformer call, the VAE
               decode: plain, or tiled above `tile_above_pixels`; with a threshold below the
               largest request, also the plain decode of the largest request at the threshold) of
               the part's fit: the allocator's reserved growth, fragmentation included; a
               transformer call adds a step cache's kept state, or with CFG pairs in rank-local mode
               the waiting lane's where larger (`PipelineFamily.step_cache_bytes`, `paired_lane_bytes`:
               per latent token and per text token)
    peak     = weights + request
The phases run one after another and free their activations; the weights and slots stay. Placed
weights per model with `S` its largest block, `N` its non-block bytes, `k` resident blocks and
`g` ranks sharing it: resident all bytes; rank-local `N + 2 S + k S`; allgather
`N + 2 g S_pad + k S` (`S_pad`: docs/contracts.md section 4). Text encoders stream (as models) in the
offloaded modes when `stream_encoders`, else sit whole; the VAE, CLIP and image encoders are whole.
With sp > 1 the transformer's activations count for the whole sequence (a bound: the table's is one rank's).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

from dlo.plan.facts import ModelFacts
from dlo.engine.layout import latent_tokens
from dlo.plan.memory_table import FamilyTable, Fit, MemoryTable, TableError, fit_linear, part_features
from dlo.plan.peak_values import AtLeast, measured_bound

SLOT_ALIGN = 256


@dataclass(frozen=True)
class RequestBounds:
    """What the deployment's limits (`dlo.plan.limits.Limits`) let one request ask for."""

    max_width: int
    max_height: int
    max_frames: int = 1
    max_n: int = 1
    max_sequence_length: int = 512


@dataclass(frozen=True)
class Shape:
    width: int
    height: int
    frames: int = 1
    batch: int = 1

    def __str__(self) -> str:
        return f"{self.width}x{self.height}" + (f"x{self.frames}" if self.frames > 1 else "") + (
            f" n={self.batch}" if self.batch > 1 else "")


@dataclass(frozen=True)
class Geometry:
    """How a family maps a request's pixels to tokens (from its `PipelineFacts`)."""

    size_multiple: int  # VAE scale x patch: one token per size_multiple^2 pixels of a frame
    temporal_factor: int  # video: latent frames = (frames - 1) / temporal_factor + 1; 0: images only
    image_input: bool = False  # image-to-video: requests are videos only, with an input image
    smallest_side: int = 0  # the smallest width and height served (`PipelineFacts.smallest_side`); 0: size_multiple


def features(part: str, shape: Shape, geometry: Geometry, sequence: int) -> dict[str, float]:
    """The feature values of `part` at `shape` (`dlo.plan.memory_table.part_features`)."""
    area = shape.batch * shape.width * shape.height
    tokens = latent_tokens(shape.width, shape.height, shape.frames, shape.batch, geometry.size_multiple,
                           geometry.temporal_factor)
    every = {"tokens": float(tokens),
             "area": float(area), "pixels": float(area * shape.frames), "sequence": float(sequence)}
    return {f: every[f] for f in part_features(part, video=geometry.temporal_factor > 0)}


def largest_requests(bounds: RequestBounds, geometry: Geometry) -> list[Shape]:
    """The largest request of each kind the limits accept: a video (one, the most frames) and an
    image request (`max_n` images), each at the largest width and height."""
    m = geometry.size_multiple
    w, h = max(m, bounds.max_width // m * m), max(m, bounds.max_height // m * m)
    out: list[Shape] = []
    if geometry.temporal_factor:
        t = geometry.temporal_factor
        out.append(Shape(w, h, max(1, (bounds.max_frames - 1) // t * t + 1), 1))
    if not geometry.image_input:
        out.append(Shape(w, h, 1, bounds.max_n))
    return out


def padded_shard_bytes(block_bytes: int, g: int) -> int:
    """`S_pad`: ceil(block / g) rounded up to 256 bytes (docs/contracts.md section 4)."""
    shard = -(-block_bytes // g)
    return -(-shard // SLOT_ALIGN) * SLOT_ALIGN


def placed_weight_bytes(model: ModelFacts, mode: str, g: int = 1, resident_blocks: int = 0) -> int:
    """Device bytes one model's weights take on a rank: all of it resident; else its non-block
    tensors, the two slots (FP8 streaming: and the buffer a block is dequantized into) and
    `resident_blocks` blocks (counted at the largest block's size, in the compute dtype)."""
    mode = mode.replace("_", "-")
    s = model.largest_block_bytes
    if mode == "resident":
        return model.compute_bytes or model.bytes
    kept = min(resident_blocks, model.blocks) * (model.compute_block_bytes or s)
    if mode == "rank-local":
        return model.nonblock_bytes + 2 * s + model.dequant_bytes + kept
    if mode == "allgather":
        return model.nonblock_bytes + 2 * g * padded_shard_bytes(s, g) + model.dequant_bytes + kept
    raise ValueError(f"unknown mode {mode!r}")


@dataclass(frozen=True)
class RankMemory:
    """One rank's predicted device memory in one mode."""

    weights: dict[str, int]  # component -> bytes placed (overhead included)
    request_bytes: int | None  # the worst phase's reserved growth (activations, fragmentation); None: unmeasured
    worst: str = ""  # that phase and shape, e.g. "vae_decode_tiled at 1920x1920x129"
    unmeasured: str = ""  # why request_bytes is None
    extrapolated: bool = False  # the worst phase's shape lies beyond the measured shapes

    @property
    def weights_bytes(self) -> int:
        return sum(self.weights.values())

    @property
    def peak_bytes(self) -> int | None:
        return None if self.request_bytes is None else self.weights_bytes + self.request_bytes

    def describe(self) -> str:
        """One line: the weights by component and what the request needs (GB)."""
        parts = ", ".join(f"{n} {format_gb(b)}" for n, b in self.weights.items())
        need = (f"the largest accepted request {format_gb(self.request_bytes)} ({self.worst}"
                f"{', extrapolated beyond the measured shapes' if self.extrapolated else ''})"
                if self.request_bytes is not None else f"the request unmeasured ({self.unmeasured})")
        return f"weights {format_gb(self.weights_bytes)} ({parts}) + {need}"


@dataclass(frozen=True)
class PipelineMemory:
    """A pipeline's memory facts, its limits and its family's table: what `rank` predicts from."""
    family: str
    geometry: Geometry
    transformers: dict[str, ModelFacts]  # every streamed transformer (Wan2.2: two experts)
    encoders: dict[str, ModelFacts]  # the text encoders that may stream
    whole: dict[str, int]  # components always whole on the device (VAE, CLIP, image encoder)
    bounds: RequestBounds
    tile_above_pixels: int  # decoded pixels above which the VAE decodes in tiles (the engine's rule)
    table: MemoryTable = field(default_factory=MemoryTable)
    stream_encoders: bool = True
    # CFG pairs (`dlo.engine.cfg_pairs`): the waiting lane's bytes per latent token and per text token
    # (`PipelineFamily.paired_lane_bytes`), added to the transformer's need in rank-local mode; (0, 0): unpaired
    paired_lane: tuple[int, int] = (0, 0)
    # step caches (`dlo.engine.step_cache`): the largest cache's kept state per latent and text token
    # (`PipelineFamily.step_cache_bytes`), added to every transformer call; (0, 0): the family runs none
    cache_state: tuple[int, int] = (0, 0)
    # (part, shape) -> reserved growth measured on the serving device (`dlo.plan.measured`): taken
    # before the table's fit at that very shape
    measured: Mapping[tuple[str, Shape], int] = field(default_factory=dict)
    # a view for decisions that must not rest on a guess (`trusted`): a rank's request is the worst
    # phase whose figure is measured, an extrapolated one left out
    trusted_only: bool = False

    @property
    def family_table(self) -> FamilyTable | None:
        return self.table.family(self.family)

    def with_bounds(self, bounds: RequestBounds) -> "PipelineMemory":
        return dataclasses.replace(self, bounds=bounds)

    @property
    def context_bytes(self) -> int:
        """Device memory outside the allocator (measured; 0 when unmeasured)."""
        return self.table.context_bytes or 0

    def rank(self, mode: str, g: int = 1, resident_blocks: int | Mapping[str, int] = 0) -> RankMemory:
        """The rank's weights and the largest accepted request's needs in `mode` (`g` sharing ranks);
        `resident_blocks`: per transformer, or per streamed model by name."""
        mode = mode.replace("_", "-")
        streamed = mode != "resident" and self.stream_encoders
        kept = (resident_blocks if isinstance(resident_blocks, Mapping)
                else {name: resident_blocks for name in self.transformers})
        weights = {name: placed_weight_bytes(m, mode, g, kept.get(name, 0)) for name, m in self.transformers.items()}
        weights.update({name: placed_weight_bytes(m, mode, g, kept.get(name, 0)) if streamed else m.bytes
                        for name, m in self.encoders.items()})
        weights.update(self.whole)
        weights = {name: b + self.table.overhead(b) for name, b in weights.items()}
        return self._with_request(weights, paired=mode == "rank-local")

    def carried_bytes(self, shape: Shape, paired: bool) -> int:
        """What a transformer call at `shape` holds beside its own activations: the waiting CFG-pairs lane
        (`paired`: its call's carried state) or a step cache's kept state; a cached request runs
        unpaired, so the larger of the two."""
        tokens = latent_tokens(shape.width, shape.height, shape.frames, shape.batch, self.geometry.size_multiple,
                               self.geometry.temporal_factor)
        text = shape.batch * self.bounds.max_sequence_length
        lane = tokens * self.paired_lane[0] + text * self.paired_lane[1] if paired else 0
        return max(lane, tokens * self.cache_state[0] + text * self.cache_state[1])

    def _with_request(self, weights: dict[str, int], paired: bool = False) -> RankMemory:
        needs = self._part_needs(paired)
        if isinstance(needs, str):
            return RankMemory(weights, None, unmeasured=needs)
        if self.trusted_only:  # the worst phase whose figure is measured; a guess left out
            needs = [n for n in needs if not n[2]] or [(0, "", False, "")]
        need, label, extrapolated, _ = max(needs, key=lambda n: n[0])
        return RankMemory(weights, need, label, extrapolated=extrapolated)

    def trusted(self) -> "PipelineMemory":
        """This memory for decisions a guess must not make (a refusal, a smaller limit, a lossy decode)."""
        return dataclasses.replace(self, trusted_only=True)

    def phase_peaks(self, mode: str, g: int = 1, resident_blocks: int | Mapping[str, int] = 0) -> dict[str, int]:
        """The rank's predicted peak (its weights + the phase's need) per phase the largest accepted
        requests run (`transformer`, `vae_decode`, `text_encoder`, ...: each the largest over the
        shapes), in `rank`'s mode; {} where the table does not measure the family."""
        rank = self.rank(mode, g, resident_blocks)
        needs = self._part_needs(mode.replace("_", "-") == "rank-local")
        if isinstance(needs, str):
            return {}
        out: dict[str, int] = {}
        for need, _, _, part in needs:
            out[part] = max(out.get(part, 0), rank.weights_bytes + need)
        return out

    def _part_needs(self, paired: bool) -> list[tuple[int, str, bool, str]] | str:
        """(need, label, extrapolated, part) of every phase of the largest accepted requests, or why
        the table cannot say."""
        fam = self.family_table
        if fam is None:
            return f"family {self.family!r} is not in the memory table (python -m bench memory calibrates it)"
        out: list[tuple[int, str, bool, str]] = []
        for part, shape in self.phases():
            predicted = self.predicted(part, shape)
            if predicted is None:
                return f"family {self.family!r} has no measured {part}"
            need, extrapolated = predicted
            need += self.carried_bytes(shape, paired) if part == "transformer" else 0
            label = part if part.startswith(("text", "image")) else f"{part} at {shape}"
            out.append((need, label, extrapolated, part))
        assert out  # every pipeline runs a transformer and a decode
        return out

    def predicted(self, part: str, shape: Shape, *, table_only: bool = False) -> tuple[int, bool] | None:
        """(bytes, extrapolated) `part` needs at `shape`: measured on this device at that very shape, or
        bounded by shapes measured there (`measured_bound`), or between them; else the table's fit
        (extrapolated beyond its shapes); None where neither has it."""
        if not table_only and (m := self.measured.get((part, shape))) is not None:
            return m, False
        bound = None if table_only else measured_bound(part, shape, self.measured)  # `dlo.plan.peak_values`
        if isinstance(bound, AtLeast):  # it covers a shape that ran out of the device's memory
            return bound, False
        x = features(part, shape, self.geometry, self.bounds.max_sequence_length)
        device_fit = None if table_only else _device_fit(part, self.geometry, tuple(sorted(  # no out-of-memory bound
            ((s.width, s.height, s.frames, s.batch), b) for (p, s), b in self.measured.items() if p == part
            and not isinstance(b, AtLeast))))
        if device_fit is not None and not device_fit.extrapolated(x):  # between shapes measured on this device
            return _within(device_fit.predict(x), bound), False
        fam = self.family_table
        fit = fam.parts.get(part) if fam is not None else None
        if fit is None or (bound is not None and fit.extrapolated(x)):  # a measured shape covering it: its need
            return (bound, False) if bound is not None else None
        return _within(fit.predict(x), bound), fit.extrapolated(x)

    def calibration_shapes(self) -> list[tuple[str, Shape]]:
        """The decodes and transformer calls the plan weighs, to measure on the device (`dlo calibrate
        --peaks`): at each largest accepted request the transformer and the decode plain and tiled,
        and, plain, fewer images or frames of that size (where a threshold or a derived limit may fall)."""
        out: list[tuple[str, Shape]] = []
        for shape in largest_requests(self.bounds, self.geometry):
            out += [("vae_decode", shape), ("vae_decode_tiled", shape), ("transformer", shape)]
            fewer = [dataclasses.replace(shape, batch=n) for n in range(1, shape.batch)]
            t = self.geometry.temporal_factor
            fewer += [dataclasses.replace(shape, frames=frames) for frames in sorted(
                {1 + (shape.frames - 1) // 4 // t * t, 1 + (shape.frames - 1) // 2 // t * t}
                if t and shape.frames > 1 else ())]
            out += [(part, s) for s in fewer for part in ("vae_decode", "transformer")]
        return list(dict.fromkeys(out))

    def phases(self) -> Iterable[tuple[str, Shape]]:
        """(part, shape) of every phase the largest accepted requests run; where the tiling threshold
        lies below one, the largest request it leaves plain decodes plain too."""
        for shape in largest_requests(self.bounds, self.geometry):
            for name in self.encoders:
                yield name, shape
            for name in self.whole:
                if name.startswith("text_encoder"):
                    yield name, shape
            tiled = decoded_pixels(shape) > self.tile_above_pixels
            plain = self._largest_plain(shape) if tiled else None
            if self.geometry.image_input:
                yield "image_encoder", shape
                yield "vae_encode_tiled" if tiled else "vae_encode", shape
                if plain is not None:
                    yield "vae_encode", plain
            yield "transformer", shape
            yield "vae_decode_tiled" if tiled else "vae_decode", shape
            if plain is not None:
                yield "vae_decode", plain

    def _largest_plain(self, shape: Shape) -> Shape | None:
        """The largest plain decode the threshold leaves below `shape`: a video, fewer frames at its
        size (the VAE decodes frames in chunks: its size sets the peak); images, the most of their
        area the threshold allows, whatever sizes make it up (4 x 1024x1024 decode more than
        1 x 1920x1920 under a threshold of two of those), as images of `shape`'s width, one pixel row
        short of it at most (requests come in rows of the size multiple). None when not one frame or
        pixel row of it is plain."""
        area = shape.width * shape.height
        if self.geometry.temporal_factor and shape.frames > 1:
            t = self.geometry.temporal_factor
            frames = (self.tile_above_pixels // (area * shape.batch) - 1) // t * t + 1
            return Shape(shape.width, shape.height, frames, shape.batch) if frames >= 1 else None
        pixels = min(self.tile_above_pixels, area * shape.batch)
        if pixels < shape.width:
            return None
        n = -(-pixels // area)
        return Shape(shape.width, pixels // (n * shape.width), 1, n)


def _within(need: int, bound: int | None) -> int:
    """A predicted need no larger than what a measured shape covering it needed (a bound of 0 bytes too)."""
    return need if bound is None else min(need, bound)


@functools.lru_cache(maxsize=256)
def _device_fit(part: str, geometry: Geometry, points: tuple[tuple[tuple[int, int, int, int], int], ...]) -> Fit | None:
    """The least-squares line through a part's peaks measured on this device (the table's features),
    shifted up to bound every point: what a shape between them needs; None below enough points."""
    video = geometry.temporal_factor > 0
    rows = [(features(part, Shape(*s), geometry, 0), float(b)) for s, b in points]
    try:
        return fit_linear(rows, part_features(part, video=video), part)
    except TableError:  # too few points, or they do not vary every feature
        return None


def decoded_pixels(shape: Shape) -> int:
    """What the tiling threshold compares: width x height x frames x images."""
    return shape.width * shape.height * max(1, shape.frames) * shape.batch


def pipeline_memory(model_dir: Path | str, bounds: RequestBounds, *, tile_above_pixels: int,
                    stream_encoders: bool = True, table: MemoryTable | None = None,
                    stream_dtype: str = "bfloat16", cfg_pairs: bool = False) -> PipelineMemory:
    """The `PipelineMemory` of a pipeline folder (its configs and safetensors headers; torch-free),
    its transformers streamed as `stream_dtype`, with CFG pairs' waiting lane where `cfg_pairs` and
    the family pairs; `table` defaults to the committed one. A folder that is no pipeline raises
    ValueError."""
    from dlo.engine.checkpoint import cached_checkpoint, read_json_config
    from dlo.engine.blocks import describe
    from dlo.engine.families import pipeline_facts, pipeline_index

    root = Path(model_dir)
    facts = pipeline_facts(root)
    index = read_json_config(pipeline_index(root))
    streamable = facts.adapter.streamable_encoders
    transformers = {name: describe(root / name, stream_dtype) for name in facts.transformers}
    encoders = {name: describe(root / name) for name in streamable if (root / name).is_dir()}
    whole: dict[str, int] = {}
    for name, spec in index.items():
        folder = root / name
        if (name.startswith("_") or name in transformers or name in encoders or not isinstance(spec, list)
                or spec[0] is None or not any(folder.glob("*.safetensors"))):
            continue
        whole[name] = cached_checkpoint(folder).nbytes
    geometry = Geometry(facts.size_multiple, facts.temporal_factor, facts.image_input, facts.smallest_side)
    loaded = table if table is not None else MemoryTable.load()  # TableError names a broken file
    config = read_json_config(root / facts.transformers[0] / "config.json")
    lane = facts.adapter.paired_lane_bytes(config) if cfg_pairs and facts.adapter.cfg_pairs else (0, 0)
    return PipelineMemory(facts.family, geometry, transformers, encoders, whole, bounds, tile_above_pixels,
                          loaded, stream_encoders, lane, cache_state=facts.adapter.step_cache_bytes(config))


def format_gb(n: int | float | None) -> str:
    """Bytes as the policy's messages write them: `25.8 GB` (10^9; MB below 0.1 GB), `?` when unknown."""
    if n is None:
        return "?"
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
