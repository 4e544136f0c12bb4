import sys
from pathlib import Path

# The emulator harness and the local kubelet live with the operator tests (tests/operator/).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
sys.path.insert(0, str(Path(__file__).parent))
