"""The memory model: the peak bytes one device of a stage holds, written once. Every check (the
searches' vectorised :class:`MemoryLimit`, a plan's price and the simulation through
:func:`peak_bytes`) goes through it, so they agree by construction; the terms, each measured by
``benchmarks/bench_memory.py``: docs/optimizer-pricing.md."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from partitioner.errors import PlanError
from partitioner.graph import Node, Profile
from partitioner.optimizer.pricing.stage import FloatArray, IntArray
from runtime.schedule import REGISTRY

__all__ = [
    "BUCKET_BYTES",
    "OPTIMIZER_STATE",
    "MemoryLimit",
    "Shared",
    "allreduce_bytes",
    "backward_excess",
    "copy_bytes",
    "deferred_as_saved",
    "made_at_once",
    "master_ratio",
    "peak_bytes",
    "persistent_factor",
    "replica_share",
    "shared_weights",
    "transient_bytes",
    "weight_bytes",
]

Bytes = FloatArray | float

#: the most bytes one gradient all-reduce copies into a flat buffer (``runtime.executing.comm.BUCKET_BYTES``,
#: DDP's default bucket; a test holds the two equal, as this module imports no torch).
BUCKET_BYTES = 25 * 2**20

#: optimizer state per parameter byte: sgd keeps none, momentum one buffer, adam and adamw two moments
#: (adamw differs only in how weight decay is applied).
OPTIMIZER_STATE = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}


def _state(optimizer: str) -> int:
    if optimizer not in OPTIMIZER_STATE:
        raise PlanError(f"unknown optimizer {optimizer!r}; use sgd, momentum, adam or adamw")
    return OPTIMIZER_STATE[optimizer]


def master_ratio(dtype: str) -> float:
    """Bytes of a float32 master copy per weight byte: 2 for bfloat16 or float16 weights, 0 for
    float32 ones (they are their own master)."""
    return 2.0 if dtype in ("bfloat16", "float16") else 0.0


def persistent_factor(optimizer: str, master: float = 0.0) -> float:
    """Bytes a device keeps per weight byte whatever it runs: the weight, its gradient, the float32
    master copy (``master`` bytes, :func:`master_ratio`) and the optimizer's state, kept in the
    master's precision (float32) where there is one. float32 Adam: 1 + 1 + 2 = 4 (16 bytes a
    parameter); bfloat16 Adam: 1 + 1 + 2 + 2 x 2 = 8 (16 bytes a parameter too)."""
    return 2 + master + _state(optimizer) * max(master, 1.0)


def weight_bytes(params: Bytes, held: Bytes, schedule: str, optimizer: str, master: float = 0.0) -> Bytes:
    """Weights, gradients, master weights, optimizer state and (pipedream, ``held`` > 1) one weight
    snapshot per item."""
    snapshots = np.where(np.asarray(held) > 1, held, 0) if REGISTRY[schedule].stashes else 0
    return params * (persistent_factor(optimizer, master) + snapshots)


def allreduce_bytes(params: Bytes, optimizer: str, master: float = 0.0) -> Bytes:
    """What a replica of a synchronous stage holds while its gradients are summed, after the
    minibatch's last backward (its activations gone): its weights' persistent bytes and one bucket's
    flat copy, at most ``BUCKET_BYTES`` and never more than the gradients (a bound: a lone tensor is
    summed in place). resnet18 on 2 replicas: 45 MiB of weights, 45 of gradients and a 25 MiB bucket,
    above its backward's peak."""
    return params * persistent_factor(optimizer, master) + np.minimum(BUCKET_BYTES, params)


def transient_bytes(params: Bytes, largest: Bytes, schedule: str) -> Bytes:
    """The gradient being accumulated, for a replica that runs more than one microbatch per step:
    the largest one autograd makes at once (``largest``, :func:`made_at_once`), or under a split
    backward, whose W makes the whole stage's before adding them, all of them."""
    return params if REGISTRY[schedule].split_backward else np.minimum(params, largest)


def made_at_once(node: Node) -> float:
    """The most gradient bytes a layer's backward makes at once beside the sums it adds them to:
    its largest weight's (``Node.largest_tensor_bytes``), as autograd adds each weight's gradient
    as it is made, or where not measured its whole parameter bytes, a bound. A decoder layer of
    nine weights (hf:llama-shaped, 577 KiB) makes at most its 128 KiB MLP weight's at once: priced
    as the whole layer, its first stage measured 0.89 of the price (``bench_3d_memory.py``)."""
    return float(node.largest_tensor_bytes or node.param_bytes)


def peak_bytes(
    params: float,
    saved: float,
    held: int,
    share: int,
    schedule: str,
    optimizer: str,
    transient: float = 0.0,
    inputs: float = 0.0,
    recompute: bool = False,
    master: float = 0.0,
    kept: float = 0.0,
) -> int:
    """Peak bytes of one device holding ``held`` items, each ``1/share`` of a minibatch.

    ``transient``: :func:`transient_bytes` where the replica accumulates, else 0; ``inputs``: the
    bytes of the stage's forward inputs per minibatch (what a recomputing stage keeps per item);
    ``master``: :func:`master_ratio` of the weights' dtype; ``kept``: the part of ``saved`` a
    recomputing stage keeps per item all the same (the loss's, ``StageLoad.kept_bytes``)."""
    held_bytes = (held * (inputs + kept) + saved - kept) if recompute else held * saved
    weights = float(weight_bytes(params, held, schedule, optimizer, master))
    return round(weights + transient + held_bytes / share)


@dataclass(frozen=True)
class Shared:
    """A weight several layers use: ``owner`` (its first user) carries its bytes in the profile."""

    owner: str
    users: tuple[str, ...]
    nbytes: float


_SHARED: list[tuple[Profile, tuple[Shared, ...]]] = []
"""The last profiles :func:`shared_weights` read and what it found (a search prices many plans of
one profile: each plan's stage loads ask again)."""


def shared_weights(profile: Profile) -> tuple[Shared, ...]:
    """Weights used by more than one layer, under any of their names (``profile.tied``: gpt2's head
    uses ``lm_head.weight``, the embedding's ``wte.weight``). A weight's bytes are its first user's
    ``param_bytes`` (the profile records bytes per layer, not per weight): exact for an embedding
    tied to a head, an upper bound where the owner has other weights too. Remembered for the last
    few profiles, by identity (a profile is frozen)."""
    for seen, found in _SHARED:
        if seen is profile:
            return found
    found = _shared_weights(profile)
    _SHARED.insert(0, (profile, found))
    del _SHARED[8:]
    return found


def _shared_weights(profile: Profile) -> tuple[Shared, ...]:
    canonical = {name: group[0] for group in profile.tied for name in group}
    first: dict[str, str] = {}
    users: dict[str, list[str]] = {}
    sizes = {n.id: float(n.param_bytes) for n in profile.nodes}
    for node in profile.nodes:
        for name in dict.fromkeys(canonical.get(n, n) for n in node.param_names):
            if name in first and node.id != first[name] and node.id not in users[name]:
                users[name].append(node.id)
            first.setdefault(name, node.id)
            users.setdefault(name, [])
    return tuple(Shared(first[n], tuple(u), sizes[first[n]]) for n, u in users.items() if u)


def copy_bytes(shared: Sequence[Shared], stages: Sequence[Sequence[str]]) -> list[tuple[float, float]]:
    """Per stage, (bytes of the tied copies it holds, the largest of them): a stage that uses a
    shared weight whose owner is on another stage holds its own copy (``runtime`` ties them)."""
    out = []
    for nodes in stages:
        members = set(nodes)
        copies = [s.nbytes for s in shared if s.owner not in members and members.intersection(s.users)]
        out.append((float(sum(copies)), max(copies, default=0.0)))
    return out


def _bits(masks: Sequence[int], layer_ids: Sequence[str], ids: Sequence[str]) -> npt.NDArray[np.bool_]:
    """Per state, whether it holds any of the layers ``ids``."""
    where = {lid: i for i, lid in enumerate(layer_ids)}
    want = sum(1 << where[i] for i in ids if i in where)
    return np.array([bool(m & want) for m in masks], dtype=bool)


@dataclass(frozen=True)
class MemoryLimit:
    """A per-device limit as the searches check it, vectorised over candidate stages; two terms of
    :func:`peak_bytes` may be bounds there (docs/optimizer-pricing.md), and every plan is then priced
    by :func:`peak_bytes` itself.

    Attributes:
        limit: bytes per device.
        optimizer: sgd, momentum, adam or adamw.
        schedule: the schedule (``runtime.schedule.REGISTRY``): whether it stashes weights and
            splits its backward.
        devices: devices in the cluster (pipedream's in-flight count is the devices from a stage on).
        microbatches: M of the synchronous schedules.
        largest: the most gradient any layer makes at once (:func:`made_at_once`; tied copies
            counted): the bound of the accumulated gradient where a search does not pass a stage's
            own (:meth:`extras`).
        shared: the weights several layers use (:func:`shared_weights`).
        layers: (layer id, :func:`made_at_once`) of the layers with parameters, largest first.
        master: :func:`master_ratio` of the profile's weight dtype.
        working: the largest ``Node.working_bytes`` of the profile, per minibatch: a bound on one
            item's backward working bytes, charged to every stage where a search does not pass a
            stage's own (:meth:`extras`; a plan's price charges each stage its own).
        workings: (layer id, working bytes) of the layers with any, largest first.
        backwards: (layer id, working bytes, saved bytes) of every layer in forward order: what
            :func:`backward_excess` reads, exact for a chain's stages (:meth:`extras`).
        posted: the ranks post each receive one receiving action ahead (CPU ranks): a device holds
            one more message (:meth:`posted_of`; ``StageLoad.posted_bytes``).
    """

    limit: float
    optimizer: str
    schedule: str
    devices: int
    microbatches: int = 1
    largest: float = 0.0
    shared: tuple[Shared, ...] = ()
    layers: tuple[tuple[str, float], ...] = ()
    master: float = 0.0
    working: float = 0.0
    workings: tuple[tuple[str, float], ...] = ()
    backwards: tuple[tuple[str, float, float], ...] = ()
    posted: bool = False

    @property
    def per_byte(self) -> float:
        """Bytes kept per weight byte: :func:`persistent_factor`."""
        return persistent_factor(self.optimizer, self.master)

    @property
    def asynchronous(self) -> bool:
        """Whole minibatches in flight per replica (pipedream): their count is the devices from the
        stage on, not the microbatches of one minibatch."""
        return not REGISTRY[self.schedule].flushes

    @staticmethod
    def of(
        limit: float, profile: Profile, optimizer: str, schedule: str, devices: int, m: int,
        posted: bool = False,
    ) -> MemoryLimit:  # fmt: skip
        """The limit for ``profile``: its shared weights and largest layer."""
        shared = shared_weights(profile)
        layers = sorted(((n.id, made_at_once(n)) for n in profile.nodes if n.param_bytes > 0),
                        key=lambda x: -x[1])  # fmt: skip
        largest = max([b for _, b in layers] + [s.nbytes for s in shared], default=0.0)
        master = master_ratio(profile.dtype)
        workings = sorted(((n.id, float(n.working_bytes)) for n in profile.nodes if n.working_bytes > 0),
                          key=lambda x: -x[1])  # fmt: skip
        working = workings[0][1] if workings else 0.0
        backwards = tuple((n.id, float(n.working_bytes), float(n.saved_bytes)) for n in profile.nodes
                          if n.op != "input")  # fmt: skip
        return MemoryLimit(
            limit, optimizer, schedule, devices, m, largest, shared, tuple(layers), master, working,
            tuple(workings), backwards, posted,
        )  # fmt: skip

    def extras(
        self, masks: Sequence[int], layer_ids: Sequence[str], ks: IntArray, js: IntArray, into: FloatArray,
        out: FloatArray,
    ) -> tuple[FloatArray, FloatArray, FloatArray]:  # fmt: skip
        """(tied copies' bytes, largest layer's parameter bytes, a copy counted, working bytes
        (:meth:`working_of`)) of the stages (ks, js]: what makes :meth:`fits` and :meth:`replicas`
        exact rather than bounded."""
        copies, largest = self.copies(masks, layer_ids, ks, js)
        own = _largest_of(self.layers, masks, layer_ids, ks, js)
        return copies, np.maximum(largest, own), self.working_of(masks, layer_ids, ks, js, into, out)

    def working_of(
        self, masks: Sequence[int], layer_ids: Sequence[str], ks: IntArray, js: IntArray, into: FloatArray,
        out: FloatArray,
    ) -> FloatArray:  # fmt: skip
        """Per stage (ks, js], what one item's backward holds beyond its saved bytes, as
        ``StageLoad.working_bytes + posted_bytes``: :meth:`excess` (``out``: the bytes it sends on,
        whose gradients it is sent back) and :meth:`posted_of` (``into``: the bytes it receives)."""
        return self.excess(masks, layer_ids, ks, js, out) + self.posted_of(into, out)

    def posted_of(self, into: FloatArray, out: FloatArray) -> FloatArray:
        """Per stage, the receive its rank posts ahead, beside the working bytes: the larger of what it
        receives (``into``) and is sent back (``out``), or 0 (``posted`` unset)."""
        return np.maximum(into, out) if self.posted else np.zeros(len(out))

    def excess(
        self, masks: Sequence[int], layer_ids: Sequence[str], ks: IntArray, js: IntArray, received: FloatArray
    ) -> FloatArray:
        """Per stage (ks, js], :func:`backward_excess` of its layers (``received``: the output
        gradients it is sent) where the states are a chain's prefixes in forward order (every stage
        a run of layers); elsewhere the largest working bytes among its layers plus ``received``, a
        bound (a downset's stage need not be a run)."""
        if [lid for lid, _, _ in self.backwards] != list(layer_ids) or any(
            m != (1 << m.bit_count()) - 1 for m in masks
        ):
            return _largest_of(self.workings, masks, layer_ids, ks, js) + received
        working = np.array([w for _, w, _ in self.backwards])
        after = np.concatenate([[0.0], np.cumsum([b for _, _, b in self.backwards])])  # saved before i
        starts = np.array([m.bit_count() for m in masks])
        lo, hi = starts[ks], starts[js]  # the stage's layers are lo .. hi - 1, the last alone
        # working[i] - (saved of layers i+1 .. hi-1) = (working[i] + after[i + 1]) - after[hi]
        inner = np.where(
            hi - 1 > lo, _range_max(working + after[1:], lo, np.maximum(hi - 1, lo + 1)), -np.inf
        )
        return np.asarray(np.maximum(working[hi - 1], inner - after[hi] + received), dtype=np.float64)

    def copies(
        self, masks: Sequence[int], layer_ids: Sequence[str], ks: IntArray, js: IntArray
    ) -> tuple[FloatArray, FloatArray]:
        """(Tied copies' bytes, the largest copy) of the stages (ks, js] of the states ``masks``
        (:func:`copy_bytes`)."""
        total, largest = np.zeros(len(ks)), np.zeros(len(ks))
        for s in self.shared:
            owner = _bits(masks, layer_ids, (s.owner,))
            uses = np.zeros(len(ks), dtype=bool)
            for user in s.users:
                bits = _bits(masks, layer_ids, (user,))
                uses |= bits[js] & ~bits[ks]
            copy = np.where(uses & ~(owner[js] & ~owner[ks]), s.nbytes, 0.0)
            total += copy
            largest = np.maximum(largest, copy)
        return total, largest

    def items(self, params: FloatArray, saved: FloatArray, working: FloatArray | None = None) -> FloatArray:
        """pipedream: the most minibatches one device can hold in flight (< 1: none); ``working``:
        the stages' own (:meth:`excess`), else the profile's bound."""
        free = self.limit - params * self.per_byte - (self.working if working is None else working)
        many = np.floor(free / np.maximum(params + saved, 1e-9))  # h > 1: P (f + h) + h S <= limit
        return np.asarray(np.where(many >= 2, many, np.where(free >= saved, 1.0, 0.0)), dtype=np.float64)

    def replicas(
        self,
        params: FloatArray,
        saved: FloatArray,
        largest: FloatArray | None = None,
        working: FloatArray | None = None,
    ) -> FloatArray:
        """Synchronous: the fewest replicas whose replicas each hold all of their microbatches'
        activations (:meth:`fits`; inf: none; ``largest`` and ``working``: the stages' own
        (:meth:`extras`), else the profile's bounds): a lower bound, as more than one replica also
        needs room for the gradient all-reduce, which :meth:`fits` checks."""
        work = self.working if working is None else working
        base = self.limit - params * self.per_byte - work / self.microbatches
        alone = _ceil_div(saved, base)
        bound = self.largest if largest is None else largest
        room = base - transient_bytes(params, bound, self.schedule)
        m = float(self.microbatches)
        with np.errstate(divide="ignore", invalid="ignore"):
            # k items fit while the first backward runs, k - 1 beside the gradient a later one adds
            per = m / np.maximum(saved, 1e-9)
            later = 0 if REGISTRY[self.schedule].split_backward else 1  # as in :meth:`fits`
            most = np.where(
                saved > 0,
                np.minimum(np.floor(base * per + 1e-9), np.floor(room * per + 1e-9) + later),
                np.where(room >= 0, np.inf, 0.0),
            )
            with_grad = np.where(most >= 1, np.ceil(m / most - 1e-9), np.inf)
        return np.asarray(np.where(with_grad < m, with_grad, np.maximum(alone, m)), dtype=np.float64)

    def fits(
        self,
        params: FloatArray,
        saved: FloatArray,
        replicas: FloatArray,
        largest: FloatArray | None = None,
        working: FloatArray | None = None,
    ) -> npt.NDArray[np.bool_]:
        """Synchronous: whether stages fit on ``replicas`` each (shapes broadcast; ``largest`` and
        ``working`` as in :meth:`replicas`)."""
        transient = transient_bytes(params, self.largest if largest is None else largest, self.schedule)
        items = np.maximum(replicas, float(self.microbatches))  # price.backward_item
        # a later backward adds the gradient beside one item fewer (price.held_memory's ``later``);
        # a split backward's items keep W's bytes after their B, which this bound leaves to it
        freed = 0.0 if REGISTRY[self.schedule].split_backward else saved / items
        grad = np.where(replicas < self.microbatches, np.maximum(transient - freed, 0.0), 0.0)
        work = self.working if working is None else working
        share = replica_share(self.microbatches, replicas)
        need = params * self.per_byte + grad + work / items + saved * share
        summed = np.where(replicas > 1, allreduce_bytes(params, self.optimizer, self.master), 0.0)
        return np.asarray((need <= self.limit) & (summed <= self.limit))

    def fits_held(
        self,
        params: FloatArray,
        saved: FloatArray,
        replicas: FloatArray,
        held: FloatArray,
        later: FloatArray,
        largest: FloatArray | None = None,
        working: FloatArray | None = None,
    ) -> npt.NDArray[np.bool_]:
        """Synchronous, where a replica's items in flight are known (``ScheduleModel.held`` and
        ``later``, which 1f1b's depend on the stages after it): whether stages fit holding ``held``
        items, ``later`` of them beside the gradient a later backward adds, each ``1/max(M, r)`` of
        a minibatch: ``price.held_memory``'s terms (shapes broadcast; ``largest`` and ``working`` as
        in :meth:`replicas`). :meth:`fits` is this with all of a replica's microbatches held."""
        transient = transient_bytes(params, self.largest if largest is None else largest, self.schedule)
        items = np.maximum(replicas, float(self.microbatches))  # price.backward_item
        work = self.working if working is None else working
        base = params * self.per_byte + work / items
        peak = base + held * saved / items
        grad = np.where(replicas < self.microbatches, base + transient + later * saved / items, -np.inf)
        summed = np.where(replicas > 1, allreduce_bytes(params, self.optimizer, self.master), 0.0)
        return np.asarray((np.maximum(peak, grad) <= self.limit) & (summed <= self.limit))


def replica_share(microbatches: int, replicas: FloatArray | float) -> FloatArray:
    """The share of a minibatch's activations one replica of a synchronous stage holds when it holds
    all of its microbatches (gpipe): ceil(M' / r) microbatches of 1/M' each, M' = max(M, r) (the
    runtime runs at least one microbatch per replica, ``price.backward_item``). 1/r where r divides
    M; more where it does not (M = 4 on 3 replicas: one replica runs 2 of the 4, half)."""
    r = np.asarray(replicas, dtype=np.float64)
    m = np.maximum(float(microbatches), r)
    return np.asarray(np.ceil(m / r - 1e-9) / m, dtype=np.float64)


def _ceil_div(saved: FloatArray, room: FloatArray) -> FloatArray:
    """ceil(saved / room) where room > 0, inf elsewhere."""
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(room > 0, np.ceil(saved / np.maximum(room, 1e-9) - 1e-9), np.inf)
    return np.asarray(out, dtype=np.float64)


def _range_max(values: FloatArray, lo: IntArray, hi: IntArray) -> FloatArray:
    """max(values[lo:hi]) per pair (lo < hi), by a sparse table: O(1) a pair after O(n log n)."""
    table = [np.asarray(values, dtype=np.float64)]
    while 2 ** len(table) <= len(values):
        prev, half = table[-1], 2 ** (len(table) - 1)
        table.append(np.maximum(prev[:-half], prev[half:]))
    level = np.floor(np.log2(np.maximum(hi - lo, 1))).astype(np.int64)
    out = np.empty(len(lo))
    for lv in np.unique(level):
        at = level == lv
        row = table[int(lv)]
        out[at] = np.maximum(row[lo[at]], row[hi[at] - 2 ** int(lv)])
    return out


def _largest_of(
    entries: Sequence[tuple[str, float]],
    masks: Sequence[int],
    layer_ids: Sequence[str],
    ks: IntArray,
    js: IntArray,
) -> FloatArray:
    """Per stage (ks, js], the largest value of ``entries`` ((layer id, value), largest first) among
    its layers: each entry settles the stages that hold its layer and no larger one (few rounds
    touch many stages)."""
    out = np.zeros(len(ks))
    todo = np.arange(len(ks))
    for lid, value in entries:
        if todo.size == 0:
            break
        bits = _bits(masks, layer_ids, (lid,))
        hit = bits[js[todo]] & ~bits[ks[todo]]
        out[todo[hit]] = value
        todo = todo[~hit]
    return out


def backward_excess(layers: Sequence[tuple[float, float]], received: float = 0.0) -> float:
    """The most one item's backward holds beyond the saved bytes of a stage whose ``layers`` are
    (working bytes, saved bytes) in their forward order: the backward runs them last first, and by
    the time a layer's runs, the layers after it have freed what they saved. So the highest of
    a layer's working bytes less what the layers after it saved (vgg16's first layers' gradients,
    8 MiB each at 64x64, meet a stage whose later layers' activations are gone). ``received``: the
    output gradients the stage was sent, alive through its whole backward (the runtime hands them
    to autograd and holds them until it returns): part of the last layer's working bytes already,
    added to every other layer's."""
    excess, after = 0.0, 0.0
    for i, (working, saved) in enumerate(reversed(layers)):
        excess = max(excess, working - after + (received if i else 0.0))
        after += saved
    return excess


def deferred_as_saved(profile: Profile, schedule: str) -> Profile:
    """The profile a search checks memory on: under a split backward (zb1p, zbv) each item is
    charged what its B keeps for its W (``Node.deferred_bytes``) as if saved from its forward on, a
    bound; the plan is then priced with the items the runtime's list holds between B and W only
    (``ScheduleModel.between``). Other schedules: the profile itself."""
    if not REGISTRY[schedule].split_backward or not any(n.deferred_bytes for n in profile.nodes):
        return profile
    nodes = tuple(replace(n, saved_bytes=n.saved_bytes + n.deferred_bytes) for n in profile.nodes)
    return replace(profile, nodes=nodes)
