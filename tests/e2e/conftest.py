import os
import sys
from pathlib import Path

# The operator's status timer runs every second under test; set before anything imports the handlers.
os.environ.setdefault("DLO_OPERATOR_STATUS_INTERVAL", "1")
# The emulator harness lives with the operator tests (tests/operator/cluster.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
sys.path.insert(0, str(Path(__file__).parent))
