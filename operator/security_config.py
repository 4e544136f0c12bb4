"""The operator-wide security settings the chart sets: who may reach the engine pods (a NetworkPolicy
per DLODeployment) and as whom the fetch Jobs write the node's model cache.

Owns: `NetworkPolicySettings`, `FetchIdentity` (together `SecuritySettings`), their flags (`add_flags`, shared by `dlo operator
run` and `render`) and `from_args`. A bad value is one line naming the flag, exit 2 (`dlo.cli.args`).
Must never: read the environment, talk to the API server, or import torch.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any, Callable, Literal

from dlo.cli.args import positive_int
from dlo.operator.k8s_schemas import check, schema

CacheOwnership = Literal["chown", "preset"]
CACHE_OWNERSHIPS: tuple[CacheOwnership, ...] = ("chown", "preset")
DEFAULT_FETCH_ID = 10001  # the images' user (Dockerfile), as the engine pods run


@dataclass(frozen=True)
class NetworkPolicySettings:
    """Ingress to engine pods: the engine's port from the DLODeployment's own namespace, from the
    namespaces `client_namespace_selector` matches (None: no other), from the pods of
    `monitoring_namespaces` (Prometheus scrapes /metrics on the same port) and from the DLO agents
    of `agent_namespace` (they scrape it too; "": none)."""

    client_namespace_selector: dict[str, Any] | None = None
    monitoring_namespaces: tuple[str, ...] = ()
    agent_namespace: str = ""


@dataclass(frozen=True)
class FetchIdentity:
    """The uid and gid `dlo fetch` runs as, and how the node's cache folder becomes theirs: `chown`
    (an init container, root with CAP_CHOWN alone, gives the cache folder and what is in it to
    uid:gid first) or `preset` (the folder exists and is theirs, or group-writable for gid: no root
    container at all)."""

    uid: int = DEFAULT_FETCH_ID
    gid: int = DEFAULT_FETCH_ID
    cache_ownership: CacheOwnership = "chown"


def label_selector(text: str) -> dict[str, Any]:
    """A Kubernetes LabelSelector given as JSON (`{"matchLabels": {...}, "matchExpressions": [...]}`),
    checked against the upstream schema (a namespace selector of a pod affinity term is one)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    node = schema("Affinity")["properties"]["podAffinity"]["properties"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["items"]["properties"]["namespaceSelector"]
    problems = check(value, node)
    if problems:
        raise argparse.ArgumentTypeError("; ".join(f"{p or 'selector'}: {m}" for p, m in problems[:3]))
    return dict(value)


def add_flags(parser: argparse.ArgumentParser, namespace: Callable[[str], str]) -> None:
    """The flags, on `parser`; `namespace` is the CLI's type of a namespace name."""
    group = parser.add_argument_group("security (the chart sets these)")
    group.add_argument("--network-policy", action="store_true",
                       help="give each DLODeployment a NetworkPolicy: its engine port is reachable only from its "
                            "own namespace and the namespaces, monitoring and agents below")
    group.add_argument("--client-namespace-selector", type=label_selector, default=None, metavar="JSON",
                       help="namespaces (a LabelSelector as JSON, e.g. '{\"matchLabels\": {\"team\": \"ml\"}}'; "
                            "'{}': every namespace) whose pods may call the engines besides their own namespace")
    group.add_argument("--monitoring-namespace", action="append", default=[], metavar="NAME", type=namespace,
                       help="a namespace whose pods may scrape the engines' /metrics (repeatable)")
    group.add_argument("--agent-namespace", default=None, metavar="NAME", type=namespace,
                       help="the namespace of the DLO agents, which scrape the engines")
    group.add_argument("--fetch-user", type=positive_int, default=DEFAULT_FETCH_ID, metavar="UID",
                       help=f"uid fetch Jobs write the node's model cache as (default {DEFAULT_FETCH_ID}; not root)")
    group.add_argument("--fetch-group", type=positive_int, default=DEFAULT_FETCH_ID, metavar="GID",
                       help=f"gid (and fsGroup) of the fetch Jobs (default {DEFAULT_FETCH_ID})")
    group.add_argument("--cache-ownership", choices=CACHE_OWNERSHIPS, default="chown",
                       help="chown: a root init container with CAP_CHOWN alone gives the cache folder to the fetch "
                            "user first (default); preset: the folder exists and is the fetch user's already")


@dataclass(frozen=True)
class SecuritySettings:
    network_policy: NetworkPolicySettings | None
    fetch: FetchIdentity


def from_args(args: argparse.Namespace) -> SecuritySettings:
    """The settings of parsed flags; ValueError for a NetworkPolicy flag without --network-policy."""
    netpol = None
    if args.network_policy:
        netpol = NetworkPolicySettings(args.client_namespace_selector, tuple(args.monitoring_namespace),
                                       args.agent_namespace or "")
    elif args.client_namespace_selector is not None or args.monitoring_namespace or args.agent_namespace:
        raise ValueError("--client-namespace-selector, --monitoring-namespace and --agent-namespace need "
                         "--network-policy")
    return SecuritySettings(netpol, FetchIdentity(args.fetch_user, args.fetch_group, args.cache_ownership))
