"""The parts of a request's phases a rank marks on its phase clock: text encoding.

Owns: `mark_text_encoding`: a forward pre- and post-hook on each text encoder of a rank's diffusers
pipeline (its `text_encoder*` components) that opens and ends a `text_encode` mark on the
pipeline's `PhaseClock` (`dlo.engine.timing`), one per encoder forward. The marks travel to rank 0
in `Result.timeline`, where the request's trace shows them inside its `prepare` phase
(`request_trace.py`). A pipeline that calls no encoder's forward (Cosmos3's tokenizes and encodes
inside its call) shows none.
Must never: change the phase (`RequestError.phase` and `phase_seconds` keep theirs), or hold a hook
the pipeline's `HookSet` does not remove on close.
"""

from __future__ import annotations

from typing import Any

TEXT_ENCODE = "text_encode"


def mark_text_encoding(pipe: Any) -> int:
    """Hook the text encoders of `pipe` (a `ServingPipeline`); returns how many were hooked."""
    encoders = [m for name, m in pipe.pipe.components.items()
                if name.startswith("text_encoder") and hasattr(m, "register_forward_pre_hook")]
    for module in encoders:
        pipe.hooks.add_pre(module, lambda *_: pipe.clock.start_mark(TEXT_ENCODE))
        pipe.hooks.add_post(module, lambda *_: pipe.clock.end_mark(TEXT_ENCODE))
    return len(encoders)
