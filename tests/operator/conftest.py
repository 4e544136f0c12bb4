import os
import sys
from pathlib import Path

# The operator's status timer runs every second under test; set before anything imports the handlers.
os.environ.setdefault("DLO_OPERATOR_STATUS_INTERVAL", "1")
# The emulator harness (`cluster.py`) is shared with tests/e2e.
sys.path.insert(0, str(Path(__file__).parent))
