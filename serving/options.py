"""The options of `dlo serve`, and the one configuration they build.

Owns: `add_arguments` (every flag, in groups, with the help a newcomer reads) and `serve_config` (the
flags -> one frozen `ServeConfig`: the argparse Namespace stops here).
Must never: read the environment itself (the caller passes it: `dlo.engine.settings.from_environment`
is the one reader) or start anything.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dlo.cli.logs import add_log_format_argument
from dlo.cli.args import (byte_size, dns_label, existing_dir, existing_file, existing_path, non_negative_int,
                          non_negative_seconds, port, positive_int, positive_seconds, rank_count)
from dlo.delivery.uri import model_argument
from dlo.plan.facts import MODES_OR_AUTO
from dlo.plan.resident import VAE_TILINGS
from dlo.engine.families.pipelines import WARMUP_STEPS
from dlo.engine.cache_presets import PRESETS, CacheSpec, CacheSpecError, cache_spec
from dlo.engine.settings import (
    LORA_APPLIES,
    LORA_MERGE_ABOVE_TOKENS,
    LORA_MERGE_KERNELS,
    MAX_GATHER_CTAS,
    STREAM_DTYPES,
    TRANSFERS,
    ULYSSES_EXCHANGES,
    EngineSettings,
    LoraSettings,
)
from dlo.serving.config import ApiConfig, LayoutConfig, MemoryConfig, RequestLimits, ServeConfig, TuningConfig


def _resident_blocks(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a whole number >= 0, got {value!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a whole number >= 0, got {value!r}")
    return n


def _merge_cache(value: str) -> int | str:
    """`--lora-merge-cache`: 'auto', 0 (none) or a byte count."""
    if value.strip() in ("auto", "0"):
        return "auto" if value.strip() == "auto" else 0
    try:
        return byte_size(value)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"expected 'auto', 0 or {e}") from None


def _cache(text: str) -> CacheSpec | None:
    """`--cache`: a step cache preset's name, or {"preset": NAME, ...} as JSON (`dlo.engine.cache_presets`)."""
    try:
        return cache_spec(text, "")
    except CacheSpecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _network(text: str) -> object:
    import ipaddress

    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a network such as 10.0.0.0/8 or an address") from None


def _cta_cap(text: str) -> int:
    n = positive_int(text)
    if n > MAX_GATHER_CTAS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_GATHER_CTAS} (got {n})")
    return n


def _unset(text: str) -> str:
    """Help for a flag whose default (None, False, []) only means "not given": `text` says what that
    does. The `%(default).0s` added formats to nothing; since the help names `%(default)`,
    `argparse.ArgumentDefaultsHelpFormatter` (what `dlo serve` uses) appends no "(default: None)"."""
    return text + "%(default).0s"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every `dlo serve` option, in `--help`'s groups, in this order (docs/serving.md, "Options", the same);
    every flag is in exactly one (tests/engine/test_serve_help.py)."""
    for title, description, add in (
        ("model and API", "what is served, where, to whom, and the HTTP server's queue, timeouts and video jobs",
         _add_api_arguments),
        ("limits", "what a request may ask for (beyond them: 400)", _add_limits_arguments),
        ("device and memory", "the device, what a rank keeps on it and where the weights' bytes come from",
         _add_device_arguments),
        ("parallelism", "the ranks (dp x sp of them on this node) and the offload mode", _add_parallel_arguments),
        ("LoRA", 'adapters chosen per request (docs/serving.md, "LoRA adapters")', _add_lora_arguments),
        ("start-up", "loading and the warm-up before /ready turns 200", _add_startup_arguments),
        ("tuning: measured defaults, change only to benchmark",
         "the served bytes do not depend on these. Unset, a flag takes the DLO_* variable it names "
         "(dlo.engine.settings.ENVIRONMENT), else its measured default; given, it wins over the variable",
         _add_tuning_arguments),
    ):
        add(parser.add_argument_group(title, description))
    parser.epilog = (
        "Example: `dlo make-tiny-model /tmp/tiny --family wan` then `dlo serve /tmp/tiny --dp 2 --mode allgather "
        "--device cpu --small-limits`. API: POST /v1/images/generations, POST|GET /v1/videos, "
        "GET|DELETE /v1/videos/ID, GET /v1/models, "
        "/health, /ready, /metrics; see docs/serving.md."
    )


def _add_api_arguments(group: argparse._ArgumentGroup) -> None:
    """The model, HTTP, the queue, the watchdog, the drain, the connections, the log and the video jobs."""
    group.add_argument("model_dir", type=model_argument,
                       help="diffusers pipeline folder (model_index.json, transformer/, vae/, ...), or a model URI "
                            "(s3://bucket/prefix, hf://org/name[@revision]) fetched first as `dlo fetch` does, into "
                            "$XDG_CACHE_HOME/dlo/models (a revision in the Hugging Face cache is served from it)")
    group.add_argument("--served-model-name", default=None, help=_unset("model id in the API; unset: the folder name"))
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in a pod)")
    group.add_argument("--port", type=port, default=8000, help="TCP port (0: any free port)")
    group.add_argument("--api-key-file", type=existing_file, default=None,
                       help=_unset("file holding the API key clients must send as 'Authorization: Bearer KEY' "
                                   "(UTF-8 text of printable ASCII characters, surrounding white space ignored); "
                                   "unset: DLO_API_KEY if set, else no key. Keys are never taken from the command "
                                   "line. With a key, /v1/*, /docs, /redoc and /openapi.json need it; /health, "
                                   "/ready and /metrics never do"))
    group.add_argument("--api-keys", type=existing_path, default=None, metavar="PATH",
                       help=_unset("named keys, one tenant each: a folder of files named by the key's name (a mounted "
                                   "Secret) or a file of 'name: key' lines (docs/serving.md, \"Tenants\")"))
    group.add_argument("--admin-key", dest="admin_keys", type=dns_label, action="append", default=[], metavar="NAME",
                       help=_unset("a name of --api-keys whose requests see, fetch and delete every tenant's video "
                                   "jobs (repeatable)"))
    group.add_argument("--max-queue", type=positive_int, default=64, help="requests waiting for a wave before 429")
    group.add_argument("--max-queue-per-tenant", type=positive_int, default=None, metavar="N",
                       help=_unset("requests one tenant (without --api-keys: one client address) may have waiting "
                                   "or running; beyond: 429 tenant_queue_full; unset: --max-queue alone"))
    group.add_argument("--wave-window-ms", type=non_negative_seconds, default=5.0,
                       help="how long the oldest request waits for compatible company before a partial wave starts")
    group.add_argument("--progress-timeout", type=positive_seconds, default=300.0,
                       help="seconds a rank may go without progress (a transformer block, a step) inside a wave "
                            "before the wave fails with 503 and the server exits; a wave that progresses never "
                            "times out")
    group.add_argument("--shutdown-grace", type=float, default=25.0,
                       help="seconds the waves and queue already accepted may run after SIGTERM (below "
                            "Kubernetes' usual 30 s; the operator sets terminationGracePeriodSeconds = grace + 5): "
                            "/ready turns 503 at once, new requests get 503 with Retry-After, what is unfinished "
                            "at the end gets 503, then the server exits 0")
    group.add_argument("--max-connections", type=int, default=None,
                       help=_unset("open HTTP connections at most; beyond it a new connection gets 503 "
                                   "too_many_connections and is closed at once; unset: what the descriptor limit "
                                   "allows after a reserve of 256, at most 1024"))
    group.add_argument("--idle-timeout", type=float, default=10.0,
                       help="seconds a connection may stay open without sending a complete request head (after "
                            "it opens, or after its previous response); then it is closed. A request being "
                            "served is never cut by it")
    group.add_argument("--body-timeout", type=positive_seconds, default=10.0,
                       help="seconds a request body may take, plus 1 s per --min-body-rate bytes received; a body "
                            "slower than that gets 408 request_timeout and the connection is closed")
    group.add_argument("--min-body-rate", type=positive_int, default=4096, metavar="BYTES_PER_S",
                       help="the body rate (bytes per second) that keeps extending --body-timeout")
    group.add_argument("--probe-cidr", type=_network, action="append", default=[], metavar="CIDR",
                       help=_unset("a network whose clients (the kubelet's node address, Prometheus) keep a reserve "
                                   "of connections beyond --max-connections for GET/HEAD /health, /ready and "
                                   "/metrics (repeatable; unset: loopback only, which always does)"))
    group.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                       help="the least severe log records the server and its ranks write")
    add_log_format_argument(group)
    # -- video jobs (dlo.serving.videos) --
    group.add_argument("--video-dir", type=Path, default=None,
                       help=_unset("folder keeping finished videos and job records across restarts (an emptyDir "
                                   "in a pod); unset: dlo-<uid>/videos-PORT under the system temp dir, made with mode 0700 "
                                   "and refused when another user owns it"))
    group.add_argument("--video-ttl", type=float, default=3600.0,
                       help="seconds a finished video job and its MP4 are kept (expires_at = finish + TTL)")
    group.add_argument("--max-video-jobs-per-tenant", type=positive_int, default=64, metavar="N",
                       help="video jobs one tenant (without --api-keys: one address) may hold (256 in all)")


def _add_limits_arguments(group: argparse._ArgumentGroup) -> None:
    """The request limits."""
    group.add_argument("--limits", type=Path, default=None,
                       help=_unset("JSON or YAML file of request limits (max_width, max_height, max_steps, max_n, "
                                   "max_frames, max_prompt_chars, max_sequence_length, video_fps, ...); unset: the "
                                   "built-in limits (dlo.plan.limits)"))
    group.add_argument("--small-limits", action="store_true",
                       help=_unset("the small test profile (size <= 128, steps <= 4) instead of the built-in limits"))
    group.add_argument("--max-steps", type=positive_int, default=None,
                       help=_unset("override the limits' max_steps"))
    group.add_argument("--max-size", type=positive_int, default=None,
                       help=_unset("override the limits' max_width and max_height: a multiple of the model's "
                                   "size multiple (16 for Wan, Flux, Qwen-Image), else exit 2"))
    group.add_argument("--cache", type=_cache, default=None, metavar="PRESET|JSON",
                       help=_unset(f"the step cache of a request that names none ({', '.join(PRESETS)}, or "
                                   '{"preset": NAME, PARAMETER: VALUE, ...}; a request\'s "cache" overrides it, '
                                   '"none" asks for none; docs/serving.md, "Step caches"); unset: none'))


def _add_device_arguments(group: argparse._ArgumentGroup) -> None:
    """The device, how much memory a rank may use, where the weights live and what else runs on the device."""
    group.add_argument("--device", choices=("auto", "cuda", "npu", "cpu"), default="auto",
                       help="auto: cuda, else npu, else cpu")
    group.add_argument("--max-device-memory", type=byte_size, default=0, metavar="BYTES",
                       help="the device budget of each rank, BYTES (an integer or 24GiB, 24GB): the allocator is "
                            "capped at it (torch.cuda.set_per_process_memory_fraction of the device's total: a "
                            "smaller device on a larger one) and --mode auto plans with it; a mode whose weights "
                            "and largest accepted request (the limits) do not fit it exits 2 before loading, "
                            "naming the smallest budget or the largest --max-size that would; an error on cpu or "
                            "above the device's memory; 0: the device's memory")
    group.add_argument("--resident-blocks", type=_resident_blocks, default=None,
                       help=_unset("blocks of each streamed model kept on the device instead of streamed, spread "
                                   "evenly through the order; unset: auto on cuda and npu, 0 on cpu. auto: as many "
                                   "as the device budget leaves after the weights and the largest request the "
                                   "limits accept (from the measured memory table) plus a 10%% margin, the "
                                   "transformers first; decided at start and logged with its arithmetic (allgather "
                                   "ranks agree on the smallest)"))
    group.add_argument("--stream-dtype", choices=STREAM_DTYPES, default="bfloat16",
                       help="how the transformers' streamed blocks are held on the host and copied: bfloat16 (as the "
                            "folder stores them) or fp8 (each linear weight float8 e4m3 with a float32 scale per "
                            "output row, dequantized into bfloat16 on the device after the copy: half the bytes over "
                            "H2D and AllGather, compute stays bfloat16; norms, biases and small tensors stay "
                            "bfloat16). fp8 reads a `dlo quantize` folder from the page cache (no extra host "
                            "memory), or converts a bfloat16 folder at load into each rank's pinned arena (half "
                            "the streamed blocks' bytes, 1/dp each in allgather). Outputs differ from bfloat16; "
                            "they are identical across modes and dp")
    group.add_argument("--stream-text-encoders", action=argparse.BooleanOptionalAction, default=True,
                       help="in the offloaded modes, the large text encoder (Wan's UMT5-XXL, Flux's T5-XXL, "
                            "Qwen-Image's Qwen2.5-VL) streams through the engine block by block in the same mode as "
                            "the transformer instead of sitting whole on every rank's device (idle ranks gather it "
                            "as often); CLIP, image encoders and the VAE stay whole; in resident mode it loads whole "
                            "through the engine (its copies read the registered page cache); --no-stream-text-encoders "
                            "keeps it whole through diffusers (streamed, Wan2.1-14B loads faster at no request "
                            "time; docs/engine.md)")
    group.add_argument("--weights", choices=("auto", "arena", "registered"), default="auto",
                       help="host source of block bytes: registered (the page cache itself, read in place; DMA-"
                            "registered on cuda), arena (one pinned copy of this rank's shards), auto (registered "
                            "where the platform allows it, else the arena; on cpu the arena)")
    group.add_argument("--cpu-threads", type=positive_int, default=1,
                       help="intra-op threads per rank on cpu (fixed so results do not depend on dp)")
    group.add_argument("--safety-checker", action=argparse.BooleanOptionalAction, default=False,
                       help="run the pipeline's own safety checker where it has one (Cosmos3: NVIDIA's "
                            "cosmos_guardrail on the prompt and the video; its package and models must be in the "
                            "image; docs/serving.md)")
    group.add_argument("--cfg-pairs", action=argparse.BooleanOptionalAction, default=EngineSettings.cfg_pairs,
                       help="a step's cond and uncond transformer calls walk the streamed blocks together: each "
                            "block is gathered (and a per-request LoRA merged) once a step instead of twice, the "
                            "same bytes out; rank-local mode, sp 1, families whose pipeline calls cond then uncond "
                            "with the same inputs (Wan2.1, Wan2.2, Qwen-Image); elsewhere unpaired, logged at "
                            "start. Costs the waiting call's state (~22 KB a latent token for Wan2.1-14B) and, with "
                            "a merged LoRA, a block's merges (docs/serving.md)")
    group.add_argument("--vae-tiling", choices=VAE_TILINGS, default="auto",
                       help="auto: every decode plain (the bytes of plain diffusers) unless the plain decode of the "
                            "largest accepted request does not fit the device budget by a measured peak, then tiled "
                            "above the size that needs it; always: every decode tiled (faster under a tight budget, "
                            "not the same bytes); never: as auto, and a request auto would tile gets a 400 naming "
                            "its size. A tiled response says so (header X-DLO-VAE-Tiled, a video job's vae_tiled)")
    group.add_argument("--peaks-deadline", type=non_negative_seconds, default=300.0, metavar="SECONDS",
                       help="on cuda, the first start on a device, model and library versions measures the decodes "
                            "the plan weighs (cached beside the model, or in ~/.cache/dlo/peaks; `dlo calibrate "
                            "--peaks` does it ahead); this bounds that measuring (0: never, the table's figures)")


def _add_parallel_arguments(group: argparse._ArgumentGroup) -> None:
    """The ranks and the mode."""
    group.add_argument("--dp", type=rank_count, default=None,
                       help=_unset("ranks (one request each per wave); unset: the device count / --sp (1 on cpu)"))
    group.add_argument("--sp", type=int, default=1,
                       help="sequence-parallel ranks per request: the node runs dp x sp ranks, each request on sp "
                            "of them (one long video faster); on accelerators dp x sp must equal the device count")
    group.add_argument("--sp-kind", choices=("ulysses", "ring"), default="ulysses",
                       help="sequence parallelism of diffusers' context parallelism: ulysses (all-to-all over "
                            "heads; heads must be a multiple of sp) or ring (cuda only)")
    group.add_argument("--mode", choices=MODES_OR_AUTO, default="auto",
                       help="allgather: each rank keeps 1/dp of every block and gathers the rest; rank-local: every "
                            "rank streams whole blocks from its own host copy; resident: no offload; auto: the "
                            "node policy decides (dlo.plan.policy), logged at start")
    group.add_argument("--profile", type=Path, default=None,
                       help=_unset("for --mode auto: a `dlo calibrate` fragment or a NodeProfile JSON (the agent's "
                                   "/profile) with this node's measured bandwidths; unset: this node's device facts "
                                   "and the nominal bandwidths (dlo.plan.profile)"))


def _add_lora_arguments(group: argparse._ArgumentGroup) -> None:
    """LoRA adapters per request (`--lora-merge-kernel`, a benchmark knob, is in the tuning group)."""
    group.add_argument("--lora-dir", type=existing_dir, default=None, metavar="DIR",
                       help=_unset("LoRA adapters, chosen per request: each NAME.safetensors file or NAME/ folder of "
                                   "DIR in the format diffusers' load_lora_weights reads for the family (`dlo "
                                   "make-random-lora` writes one); listed in GET /v1/models as MODEL:NAME, chosen by "
                                   'that model id or "lora": NAME (+ "lora_scale") in a request; every adapter is '
                                   "checked against the model at start (a mismatch exits 2 naming the file) and "
                                   "loaded once onto every rank's device (its bytes in the model's dtype: ~0.6 GB for "
                                   "a rank-64 adapter of every Wan2.1-14B block linear); requests for different "
                                   "adapters share a wave; unset: no adapters"))
    group.add_argument("--lora-apply", choices=LORA_APPLIES, default="auto",
                       help="how a request's adapter reaches a layer: branch adds the unmerged low-rank branch to "
                            "the layer's output, bit for bit what diffusers + load_lora_weights gives; merge computes "
                            "the layer with W + scaling * B A merged per call into a scratch of the rank's own (never "
                            "the weight or the shared slot), bit for bit what diffusers' fuse_lora gives, cheaper "
                            "where a call's tokens outnumber a layer's width (video); auto: merge for a request of "
                            "more than --lora-merge-above tokens a transformer call, else branch (decided by the "
                            "request's shape and these flags: its bytes are the same in every mode, dp and sp); "
                            "merge and auto cost the largest adapted weight once per rank (~142 MB for Wan2.1-14B)")
    group.add_argument("--lora-merge-cache", type=_merge_cache, default="auto", metavar="BYTES|auto|0",
                       help="with --lora-apply merge or auto: device bytes per rank (an integer or 48GiB, 48GB) that "
                            "keep resident layers' merges per adapter and scale, so a request whose adapter is "
                            "cached runs at the base model's cost (the least recently used adapter is dropped "
                            "first; streamed layers always merge per call); the device budget counts it all as "
                            "taken. auto: what the device budget has spare after the mode's predicted peak and its "
                            "margin, up to every adapter's merges (logged at start; none on cpu); 0: none (and an "
                            f"unset --lora-merge-above is then {LORA_MERGE_ABOVE_TOKENS})")
    group.add_argument("--lora-merge-above", type=non_negative_int, default=None, metavar="TOKENS",
                       help=_unset("with --lora-apply auto: latent tokens per transformer call above which a "
                                   "request's adapter is merged; unset: 0 with a merge cache, so every request "
                                   f"merges and a cached adapter costs nothing, else {LORA_MERGE_ABOVE_TOKENS} "
                                   "(measured on an H200, merging a rank-64 adapter costs a Wan2.1-14B block what "
                                   "the branch costs at ~7,800 tokens; a 832x480 frame is 1,560 tokens, an 81-frame "
                                   "clip 32,760)"))


def _add_startup_arguments(group: argparse._ArgumentGroup) -> None:
    """The warm-up and the start-up deadline."""
    group.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                       help="every rank runs one generation (--warmup-steps steps at --warmup-size) before /ready "
                            "turns 200, so the first clients do not pay start-up costs (graph capture, library "
                            "set-up, first text-encoder and VAE calls); its seconds are in the ready log and /ready")
    group.add_argument("--warmup-size", default=None, metavar="WxH|smallest",
                       help=_unset("size of the warm-up generation; unset: what a request without `size` gets (the "
                                   "limits' default_size, clamped to them; it also loads the kernels chosen per "
                                   "shape, which a fresh node otherwise loads on the first such request); "
                                   "`smallest`: the smallest valid size, the quickest warm-up"))
    group.add_argument("--warmup-steps", type=positive_int, default=WARMUP_STEPS, metavar="N",
                       help="denoising steps of the warm-up generation (one step runs every kernel a request does; "
                            "the request limits do not bound it)")
    group.add_argument("--startup-timeout", type=positive_seconds, default=900.0,
                       help="seconds the engine may spend loading: after that /health answers 503 unhealthy "
                            "(so a liveness probe restarts a start that hangs); /ready stays 503 until ready")


def _add_tuning_arguments(group: argparse._ArgumentGroup) -> None:
    """The knobs whose defaults were measured: each also has a `DLO_*` variable
    (dlo.engine.settings.ENVIRONMENT) but `--lora-merge-kernel`; unset, the variable decides, else the
    default; a flag given wins over the variable."""
    group.add_argument("--gather", choices=TRANSFERS, default=None,
                       help=_unset("allgather over more than one rank: how a block is rebuilt on each device: "
                                   "collective (an in-place AllGather) or peer (each rank copies the others' shards "
                                   "out of their slots with the copy engines, no SM; every rank on one host); "
                                   "unset: DLO_GATHER, else collective"))
    group.add_argument("--gather-max-ctas", type=_cta_cap, default=None, metavar="N",
                       help=_unset(f"allgather on NCCL: run the weight gathers on their own communicator capped at "
                                   f"N CTAs (1-{MAX_GATHER_CTAS}); unset: DLO_GATHER_MAX_CTAS, else NCCL's choice"))
    group.add_argument("--ulysses-exchange", choices=ULYSSES_EXCHANGES, default=None,
                       help=_unset("--sp > 1, Wan with ulysses: how self-attention exchanges: overlap (fewer copies, "
                                   "exchanges beside compute), lean, or diffusers (diffusers' own); all give the "
                                   "same bytes; unset: DLO_ULYSSES, else overlap"))
    group.add_argument("--register-early", action=argparse.BooleanOptionalAction, default=None,
                       help=_unset("register the engine's models' page cache for DMA on a thread while the pipeline "
                                   "is built, in every mode; the resident copies read it (off: pageable copies; "
                                   "cuda); unset: DLO_REGISTER_EARLY (0|1), else on"))
    group.add_argument("--lora-merge-kernel", choices=LORA_MERGE_KERNELS, default=LoraSettings.merge_kernel,
                       help="with a LoRA merge: triton merges a weight in one pass on a GPU (the weight read and "
                            "the sum written, half the memory traffic of two steps), checked against the two steps "
                            "at load for every shape an adapter merges as, and the two steps wherever the bytes "
                            "differ or the kernel cannot run (cpu, no Triton); torch runs peft's two steps as "
                            "torch ops")


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The one `ServeConfig` of these flags (`ConfigError` where the LoRA flags disagree): the
    Namespace goes no further than this module."""
    return ServeConfig(
        model=args.model_dir,
        api=ApiConfig(host=args.host, port=args.port, served_model_name=args.served_model_name,
                      api_key_file=args.api_key_file, api_keys=args.api_keys, admin_keys=tuple(args.admin_keys),
                      max_queue=args.max_queue, max_queue_per_tenant=args.max_queue_per_tenant,
                      wave_window_ms=args.wave_window_ms,
                      progress_timeout=args.progress_timeout, shutdown_grace=args.shutdown_grace,
                      max_connections=args.max_connections, idle_timeout=args.idle_timeout,
                      body_timeout=args.body_timeout, min_body_rate=args.min_body_rate,
                      probe_cidr=tuple(args.probe_cidr), log_level=args.log_level, log_format=args.log_format),
        requests=RequestLimits(limits=args.limits, small_limits=args.small_limits, max_steps=args.max_steps,
                               max_size=args.max_size, warmup=args.warmup, warmup_size=args.warmup_size,
                               warmup_steps=args.warmup_steps, startup_timeout=args.startup_timeout,
                               video_dir=args.video_dir, video_ttl=args.video_ttl,
                               max_video_jobs_per_tenant=args.max_video_jobs_per_tenant),
        layout=LayoutConfig(device=args.device, dp=args.dp, sp=args.sp, sp_kind=args.sp_kind, mode=args.mode,
                            profile=args.profile),
        memory=MemoryConfig(max_device_memory=args.max_device_memory, resident_blocks=args.resident_blocks,
                            stream_dtype=args.stream_dtype, stream_text_encoders=args.stream_text_encoders,
                            cfg_pairs=args.cfg_pairs, vae_tiling=args.vae_tiling, peaks_deadline=args.peaks_deadline,
                            weights=args.weights, cpu_threads=args.cpu_threads,
                            safety_checker=args.safety_checker),
        cache=args.cache,
        lora=LoraSettings(directory=str(args.lora_dir.resolve()) if args.lora_dir else None, apply=args.lora_apply,
                          merge_cache_bytes=args.lora_merge_cache, merge_above_tokens=args.lora_merge_above,
                          merge_kernel=args.lora_merge_kernel),
        tuning=TuningConfig(gather=args.gather, gather_max_ctas=args.gather_max_ctas,
                            ulysses_exchange=args.ulysses_exchange, register_early=args.register_early),
    )
