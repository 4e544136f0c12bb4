"""dlo.serving: `dlo serve`, the OpenAI-compatible server on the offload engine.

Map (which file to open for which concept; every file of the folder):
  cli.py         the subcommands it owns: `dlo serve` (serve.py) and `dlo demo` (demo.py)
  options.py     `dlo serve`'s flags in groups, the one reader of their Namespace -> config.py's ServeConfig,
                 and the engine settings from the configuration and the deployment plan
  config.py      ServeConfig: every flag typed and grouped, built once and passed down
  serve.py       `dlo serve`'s start in named steps; host.py  this host's NodeProfile for the plan
  server.py      HTTP only: routes, request bodies, clients that leave (499), domain errors -> status codes
  request_bodies.py the bodies FastAPI does not parse itself (`POST /v1/videos`, JSON or form data)
  accounting.py  the API key, the request's tenant, and what every answer is counted as (dlo_requests_total,
                 durations, by tenant)
  api_keys.py    where keys come from: one key (--api-key-file, DLO_API_KEY) or named keys (--api-keys)
  tenants.py     tenants: who a request is (Caller), what it sees of the video jobs, its share of the queue
  body_limit.py  413 before a body is parsed
  service.py     the domain on rank 0: lifecycle states, queue -> waves, withdrawing, the drain, faults
  threads.py     rank 0's blocking work beside its event loop (the group's start, waves, stop)
  startup.py     the warm-up request, startup_seconds, start-cost warnings; warm_run.py  its run on a rank
  start_peaks.py the peaks a start plans with, measured on its device at each limit set the plan weighs
  errors.py      the domain errors (QueueFull, EngineUnavailable, EngineFailed, ShuttingDown, RequestFailed,
                 InvalidInput, video jobs)
  connections.py the listener's limits: cap and probe reserve, idle/header and body timeouts, episode logs
  http_protocol.py the HTTP/1.1 connection applying them (uvicorn's h11), 16 KiB heads, RFC 9112 framing
  uvicorn_server.py the uvicorn server with them, and its drain on SIGTERM/SIGINT
  faults.py      test-only fault injection (DLO_TEST_HOOKS=1 + DLO_TEST_FAULTS) and its seams, off in production
  waves.py       compatibility keys of a Generation (dlo.engine.request), the wave-forming rule, WaveQueue
  request_trace.py OpenTelemetry spans of a request (opt-in by OTEL_*): HTTP, queue, wave, the ranks' phases
  phase_marks.py the text encoders' marks on a rank's phase clock (the traces' dlo.text_encode)
  videos.py      the video job store; video_records.py a job's files; video_jobs.py running jobs
  peers.py       forwarding a video request to the pod whose job it is
  child_env.py   the environment every child process gets (no API key); die_with_parent, its first call
  library_noise.py third-party warnings and progress bars filtered at every rank's start (not ours to fix)
  ranks.py       rank 0's side: RankGroup (spawn, control socket, start, run_wave, stop, kill), the watchdog
  rendezvous.py  the weight plane's rendezvous, on loopback only
  rank_main.py   a rank's compute side and the children's main (python -m dlo.serving.rank_main)
  control.py     every message between rank 0 and its children (frozen dataclasses), RankConfig
  pipeline.py    ServingPipeline: the family's diffusers pipeline around dlo.engine.load
  prewarm.py     what a rank's start runs beside its imports: readahead, the device libraries' warm-up
  readahead.py   the readahead's child process (python -m dlo.serving.readahead): no shared GIL
  first_cached.py whether a start's other files are in the page cache already (dlo.pagecache)
  distmap.py     the installed distributions' import-name map, computed beside a rank's start
  encode.py      PNG / MP4 encoders
  api_models.py  OpenAI request/response models and their validation into a Generation
  served_limits.py the limits a server serves: loaded, checked against the family, the request defaults
  metrics.py     Prometheus metrics; launch.py  ServerProcess; demo.py  `dlo demo`
The deployment plan (mode, budget, resident blocks, decode rule, limits) is `dlo.plan`'s; the
page-cache readers are `dlo.pagecache`'s.

Owns: nothing itself; importing it imports neither torch nor FastAPI.
Must never: reach into the offload core's internals (only `load`, the report and stats types, the
family adapters and the platform).
"""
