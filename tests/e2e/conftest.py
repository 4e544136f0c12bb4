import sys
from pathlib import Path

# The emulator harness lives with the operator tests (tests/operator/cluster.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
sys.path.insert(0, str(Path(__file__).parent))
