import sys
from pathlib import Path

# The emulator harness (`cluster.py`) is shared with tests/e2e.
sys.path.insert(0, str(Path(__file__).parent))
