"""dlo.engine.serving: `dlo serve`, the OpenAI-compatible server on the offload engine.

Map (which file to open for which concept):
  server.py      HTTP only: routes, auth, body limit, domain errors -> status codes
  service.py     the domain on rank 0: lifecycle states, queue -> waves, video jobs, faults
  errors.py      the domain errors (QueueFull, EngineUnavailable, EngineFailed, ShuttingDown, RequestFailed,
                 InvalidInput)
  connections.py the listener's connection cap, idle/header timeout and once-per-episode logs
  faults.py      test-only fault injection (DLO_TEST_HOOKS=1 + DLO_TEST_FAULTS), off in production
  waves.py       Generation (one request), compatibility keys, the wave-forming rule, WaveQueue
  ranks.py       rank 0's side: RankGroup (spawn, start, run_wave, stop, kill) and the watchdog
  rank_main.py   a rank's compute side and the children's main (python -m dlo.engine.serving.rank_main)
  control.py     every message between rank 0 and its children (frozen dataclasses), RankConfig
  pipeline.py    ServingPipeline: the family's diffusers pipeline around dlo.engine.load
  encode.py      PNG / MP4 encoders
  api_models.py  OpenAI request/response models and their validation into a Generation
  limits.py      request limits; metrics.py  Prometheus metrics; launch.py  ServerProcess
  cli.py         `dlo serve`; demo.py  `dlo demo`

Owns: nothing itself; importing it imports neither torch nor FastAPI.
Must never: reach into the offload core's internals (only `load`, the report and stats types, the
family adapters and the platform).
"""
