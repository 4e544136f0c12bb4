"""The nodes as the operator reads them, and which DLODeployments a node's change concerns: the cost
of a node event grows with what changed, not with the fleet.

Owns: `NodeIndex`: each node's summary (what the reconcile reads of it, never a heartbeat time:
`handlers._node_summary`), replaced only when it changes, so a kubelet's heartbeat is no change and
wakes nothing; each DLODeployment's `modes.Selector` (from its spec); and `concerned`: the
DLODeployments a changed node matches before or after the change (eligible for their pods), or
that run a pod on it (its loss, its residency).
Must never: talk to the API server, or copy the inventory: the reconcile gets the summaries
themselves (read-only) and a summary is never changed in place, only replaced.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from dlo.operator.modes import Selector

Key = tuple[str, str]  # a DLODeployment: (namespace, name)
Change = tuple[dict[str, Any] | None, dict[str, Any] | None]  # a node's summary before and after


def selector_of(spec: Mapping[str, Any]) -> Selector:
    """The Selector of a DLODeployment's spec as stored (its defaults where unset); a spec the models
    refuse still gets one (its reconcile says what is wrong)."""
    placement = spec.get("placement") or {}
    engine = spec.get("engine") or {}
    selector = placement.get("nodeSelector") or {}
    try:
        devices = int(spec.get("devicesPerNode") or 1)
    except (TypeError, ValueError):
        devices = 1
    return Selector(tuple(sorted((str(k), str(v)) for k, v in selector.items())),
                    str(spec.get("acceleratorResource") or "nvidia.com/gpu"), devices, engine.get("device") == "cpu")


class NodeIndex:
    def __init__(self) -> None:
        self.nodes: dict[str, dict[str, Any]] = {}
        self._selectors: dict[Key, Selector] = {}
        self._pending: dict[str, Change] = {}
        self.seen: Counter[str] = Counter()  # node events handled, changed or not
        self.woke: Counter[Key] = Counter()  # wakes a node change caused, per DLODeployment

    def values(self) -> list[dict[str, Any]]:
        """The summaries (the reconcile's `View.nodes`: references, read-only)."""
        return list(self.nodes.values())

    def select(self, key: Key, spec: Mapping[str, Any]) -> None:
        self._selectors[key] = selector_of(spec)

    def forget(self, key: Key) -> None:
        self._selectors.pop(key, None)

    def update(self, name: str, summary: dict[str, Any] | None) -> Change | None:
        """Record the node's summary (None: deleted); (before, after) when it changed, else None."""
        before = self.nodes.get(name)
        if summary == before:
            return None
        if summary is None:
            self.nodes.pop(name, None)
        else:
            self.nodes[name] = summary
        return before, summary

    def record(self, name: str, summary: dict[str, Any]) -> None:
        """`update` from the node's index handler: its change waits for `changed` (the event handler)."""
        change = self.update(name, summary)
        if change is not None:
            self._pending[name] = change

    def changed(self, name: str) -> Change | None:
        """The change `record` left for this node's event (None: none, a heartbeat)."""
        self.seen[name] += 1
        return self._pending.pop(name, None)

    def concerned(self, name: str, change: Change, pods: Iterable[tuple[Key, Iterable[dict[str, Any]]]]) -> set[Key]:
        """The DLODeployments a node's change concerns: its eligibility for their pods before or
        after, or one of their pods on it. `pods`: (owner, its pods), kopf's pod index."""
        out = {key for key, selector in self._selectors.items()
               if any(node is not None and selector.matches(node) for node in change)}
        for owner, owned in pods:
            if owner not in out and any((p.get("spec") or {}).get("nodeName") == name for p in owned):
                out.add(owner)
        self.woke.update(out)
        return out
