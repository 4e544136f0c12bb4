"""The operator's configuration: one typed, frozen object built once by `dlo operator run` from its
flags (and `DLO_DEFAULT_ENGINE_IMAGE`) and passed down whole to the handlers and the reconcile.

Owns: `OperatorConfig` and its defaults.
Must never: read the environment or the command line (the CLI does, once), or import torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dlo.operator.models import DEFAULT_IMAGE
from dlo.operator.security_config import FetchIdentity, NetworkPolicySettings

DEFAULT_CACHE_ROOT = "/var/lib/dlo/models"
DEFAULT_PROMETHEUS_URL = "http://prometheus-operated.monitoring.svc:9090"


@dataclass(frozen=True)
class OperatorConfig:
    # Seconds between two reconciles of a DLODeployment when nothing changes (a resync: every
    # change of the resource, its pods, its fetch Jobs or the nodes is reconciled at once).
    status_interval: float = 15.0
    # The engine image of specs that name none (`DLO_DEFAULT_ENGINE_IMAGE`, which the chart sets).
    default_image: str = DEFAULT_IMAGE
    # Node folder models of `spec.model.uri` are fetched into (`<cacheRoot>/<cache key>`); the fetch
    # Jobs create it, the agent scans it when it is its models root.
    cache_root: str = DEFAULT_CACHE_ROOT
    # Fetch Jobs running at once over every DLODeployment (a node runs one at a time).
    max_fetches: int = 4
    # A failed fetch Job is kept (its reason in the status) this long, then tried again.
    fetch_retry_seconds: float = 300.0
    # Bytes the fetched models of one node may take (`dlo fetch --disk-budget`); None: the free space.
    cache_disk_budget: int | None = None
    # The Prometheus the KEDA ScaledObjects query (an HPA reads the external metrics API instead).
    prometheus_url: str = DEFAULT_PROMETHEUS_URL
    # `release: <value>` on the monitors the operator creates (kube-prometheus-stack selects on it).
    monitoring_release: str = ""
    # A NetworkPolicy per DLODeployment for its engine pods (None: none; `--network-policy`).
    network_policy: NetworkPolicySettings | None = None
    # The uid and gid fetch Jobs run as, and how the node cache becomes theirs (`--fetch-user`, ...).
    fetch: FetchIdentity = field(default_factory=FetchIdentity)
    # `--log-format` (text or json): the operator's own records, and those of the fetch Jobs it creates.
    log_format: str = "text"

    @property
    def retry_seconds(self) -> float:
        """After a failed reconcile (an API error, a timeout): one status interval, not a minute."""
        return self.status_interval
