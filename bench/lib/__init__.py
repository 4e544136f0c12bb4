"""The benchmarks' shared library: what every suite records and how records are joined.

Map:
- `provenance`: the commit, the card (read from the device), the driver, the library versions, the
  package set's digest and the command of a record.
- `packages`: the committed lock (`engine.lock`), this interpreter's package set and how it differs.
- `stats`: a figure's spread (first request, median, n, min, max) and ratios of one statistic.
- `records`: the record format (raw and merged), writing it, the card a record names.
- `merge`: the one merge of raw records (one card, runs by name, sources listed).
- `cards`: the index of which card made each committed result, and how that was told.
- `device_env`: the device prelude's private site (`bench/device.sh`).

Must never: import torch, diffusers or dlo at import time (the prelude runs it before they exist).
"""
