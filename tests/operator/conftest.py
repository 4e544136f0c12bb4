import sys
from pathlib import Path

# The emulator harness (`cluster.py`, `emulator.py`, `controllers.py`, `kubelet.py`) is shared with
# tests/e2e and tests/reliability.
sys.path.insert(0, str(Path(__file__).parent))
