"""Clusters that are not here: GPUs per node, link bandwidth and latency per level, memory per GPU.

``pipeplan partition --cluster dgx-h100:8`` plans for 8 nodes of 8 H100s without spelling out
``--topology 8,8 --bandwidth 450GB/s,50GB/s --memory 80GiB``. A preset is one node design; the
count after the colon is how many nodes (1 by default). A cluster file (JSON) describes any
hierarchy: levels innermost first, each with its devices and the bandwidth one device has to its
peers at that level, and the latency every message between them pays besides its bytes.

Bandwidths are per GPU and per direction, what the cost model divides bytes by: NVLink's
datasheet figures are bidirectional totals per GPU (900 GB/s for NVLink 4), so half of them; the
network is one NIC per GPU (DGX H100: eight 400 Gb/s ConnectX-7 ports per node, 50 GB/s a GPU).
Latencies are NCCL's own per-step estimates for a ring with its Simple protocol (``hwLat`` in NCCL's
src/graph/tuning.cc: 3.4 us over NVLink, 9.6 us over the network): what NCCL itself assumes
when it picks an algorithm, not a measurement; ``pipeplan probe`` is the way to measure one.
Plain data, no torch.

Example:
    >>> load_cluster("dgx-h100:8").gpus
    64
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from partitioner.errors import PlanError
from partitioner.hardware.devices import read_spec_file
from partitioner.optimizer.units import parse_bandwidth, parse_bytes, parse_latency
from partitioner.plan import Cluster, Level

__all__ = [
    "CLUSTER_SCHEMA",
    "GLOO_LOCAL_LATENCY_S",
    "NCCL_NET_LATENCY_S",
    "NCCL_NVLINK_LATENCY_S",
    "NCCL_PCI_LATENCY_S",
    "NODES",
    "NodeDesign",
    "cluster_from_json",
    "default_latency",
    "levels_of",
    "load_cluster",
]

CLUSTER_SCHEMA = "pipeplan.cluster/1"

#: one gloo message between two local CPU ranks, one way, 16 B to 64 KiB: the median of
#: benchmarks/results/bench_gloo_latency.md (1.68-1.70 ms; 1.82 ms at 1 MiB)
GLOO_LOCAL_LATENCY_S = 1.7e-3
#: NCCL's per-step latency of a ring, Simple protocol (src/graph/tuning.cc ``hwLat``), by link
NCCL_NVLINK_LATENCY_S = 3.4e-6
NCCL_PCI_LATENCY_S = 5.7e-6
NCCL_NET_LATENCY_S = 9.6e-6


@dataclass(frozen=True)
class NodeDesign:
    """One kind of node, repeated to make a cluster.

    Attributes:
        name: the preset name.
        description: what it is.
        gpus: GPUs in one node.
        nvlink: bytes/s one GPU sends to another in the node (one direction).
        network: bytes/s one GPU sends to another node (one direction: its NIC's rate).
        nvlink_latency: seconds a message in the node costs besides its bytes.
        network_latency: seconds a message to another node costs besides its bytes.
        memory_bytes: memory of one GPU.
        device_model: the device preset (``partitioner.hardware.devices``) its GPUs are.
        sources: where the numbers come from.
    """

    name: str
    description: str
    gpus: int
    nvlink: float
    network: float
    memory_bytes: int
    device_model: str
    sources: str
    nvlink_latency: float = NCCL_NVLINK_LATENCY_S
    network_latency: float = NCCL_NET_LATENCY_S

    def cluster(self, nodes: int = 1) -> Cluster:
        """``nodes`` of these nodes: one level of NVLink, and one of network when there are several."""
        if nodes < 1:
            raise PlanError(f"a cluster needs at least 1 node, got {nodes}")
        levels = [Level(self.gpus, self.nvlink, self.nvlink_latency)]
        levels += [Level(nodes, self.network, self.network_latency)] if nodes > 1 else []
        return Cluster(tuple(levels), self.memory_bytes)


NODES: dict[str, NodeDesign] = {
    "dgx-a100": NodeDesign(
        "dgx-a100", "DGX A100: 8 A100 80GB SXM4, NVLink 3, 8 HDR InfiniBand 200 Gb/s ports", 8, 300e9, 25e9,
        80 * 2**30, "a100-80gb",
        "NVIDIA DGX A100 datasheet: NVLink 3 600 GB/s per GPU (both directions), 8 x 200 Gb/s HDR NICs; "
        "latencies: NCCL's ring/Simple per-step estimates (src/graph/tuning.cc)",
    ),
    "dgx-h100": NodeDesign(
        "dgx-h100", "DGX H100: 8 H100 SXM5 80GB, NVLink 4, 8 NDR InfiniBand 400 Gb/s ports", 8, 450e9, 50e9,
        80 * 2**30, "h100",
        "NVIDIA DGX H100 datasheet: NVLink 4 900 GB/s per GPU (both directions), 8 x 400 Gb/s ConnectX-7; "
        "latencies: NCCL's ring/Simple per-step estimates (src/graph/tuning.cc)",
    ),
    "hgx-h200": NodeDesign(
        "hgx-h200", "HGX H200: 8 H200 SXM 141GB, NVLink 4, one 400 Gb/s NIC per GPU", 8, 450e9, 50e9,
        141 * 10**9, "h200",
        "NVIDIA HGX H200 datasheet: NVLink 4 900 GB/s per GPU (both directions); 400 Gb/s per GPU assumed; "
        "latencies: NCCL's ring/Simple per-step estimates (src/graph/tuning.cc)",
    ),
}  # fmt: skip


def load_cluster(spec: str) -> Cluster:
    """``NAME`` or ``NAME:NODES`` (a preset of :data:`NODES`), or a cluster JSON file.

    Raises:
        PipeplanError: neither a preset nor a valid file (PlanError: a bad node count); the message
            lists the presets.
    """
    name, _, count = spec.partition(":")
    if name in NODES:
        try:
            nodes = int(count) if count else 1
        except ValueError:
            raise PlanError(f"--cluster {spec}: the node count after ':' must be an integer") from None
        return NODES[name].cluster(nodes)
    presets = f": use a preset NAME[:NODES] ({', '.join(NODES)}) or a cluster JSON file"
    return cluster_from_json(read_spec_file(spec, "cluster", presets), spec)


def default_latency(device: str) -> float:
    """The latency a level gets when none is given: a CPU profile's ranks are local gloo processes
    (:data:`GLOO_LOCAL_LATENCY_S`, measured here); GPUs talk through NCCL, whose estimate for a
    link it knows nothing about is PCIe's (:data:`NCCL_PCI_LATENCY_S`)."""
    return GLOO_LOCAL_LATENCY_S if device == "cpu" else NCCL_PCI_LATENCY_S


def levels_of(
    devices: list[int], bandwidth: str | None, latency: str | None, default: float
) -> tuple[Level, ...]:
    """``--topology``'s levels with ``--bandwidth`` and ``--latency`` (comma lists, one value per
    level, innermost first; absent: 1e9 bytes/s and ``default`` seconds everywhere)."""
    rates = [parse_bandwidth(b) for b in bandwidth.split(",")] if bandwidth else [1e9] * len(devices)
    delays = [parse_latency(t) for t in latency.split(",")] if latency else [default] * len(devices)
    for name, values in (("--bandwidth", rates), ("--latency", delays)):
        if len(values) != len(devices):
            raise PlanError(f"{name} has {len(values)} values but the topology has {len(devices)} levels")
    return tuple(Level(d, r, t) for d, r, t in zip(devices, rates, delays, strict=True))


def _given(level: Mapping[str, Any], key: str, parse: Callable[[str], float]) -> float | None:
    return parse(str(level[key])) if level.get(key) is not None else None


def cluster_from_json(doc: Any, source: str = "cluster") -> Cluster:
    """A cluster file: ``{"schema": "pipeplan.cluster/1", "levels": [{"devices": 8, "bandwidth":
    "450GB/s", "latency": "3.4us"}, ...], "memory": "80GiB"}``, levels innermost first (a level
    without a latency: 0, bandwidth only). A level may give a gradient all-reduce its own
    ``allreduce_bandwidth`` and ``allreduce_latency`` (per ring step; what ``pipeplan probe`` fits).
    ``action_overhead``: the runtime's own time per compute action (:attr:`Cluster.action_s`; what
    ``pipeplan calibrate --trace`` measures); ``action_overhead_by_schedule``: ``{schedule: time}``
    where a schedule's ranks spend another (:attr:`Cluster.schedule_action_s`; ``pipeplan probe``
    times interleaved's and zbv's, whose ranks host two stages)."""
    if not isinstance(doc, Mapping) or doc.get("schema") != CLUSTER_SCHEMA:
        raise PlanError(f"{source} is not a pipeplan cluster file (schema {CLUSTER_SCHEMA!r})")
    known = {"schema", "name", "description", "levels", "memory", "device_model", "sources", "probe",
             "action_overhead", "action_overhead_by_schedule"}  # fmt: skip
    unknown = sorted(set(doc) - known - {"calibrated"})  # calibrated: what `calibrate --cluster` changed
    if unknown:
        raise PlanError(f"{source}: unknown field {unknown[0]!r}")
    try:
        levels = tuple(
            Level(
                int(level["devices"]),
                parse_bandwidth(str(level["bandwidth"])),
                parse_latency(str(level.get("latency", 0))),
                _given(level, "allreduce_bandwidth", parse_bandwidth),
                _given(level, "allreduce_latency", parse_latency),
            )
            for level in doc["levels"]
        )
        memory = parse_bytes(str(doc["memory"])) if doc.get("memory") is not None else None
        action = parse_latency(str(doc.get("action_overhead", 0)))
        scheduled = tuple(
            (str(name), parse_latency(str(value)))
            for name, value in dict(doc.get("action_overhead_by_schedule") or {}).items()
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanError(
            f"{source}: bad or missing field {exc}; each level needs devices and bandwidth"
        ) from exc
    return Cluster(levels, memory, action_s=action, schedule_action_s=scheduled)
