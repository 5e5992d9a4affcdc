"""The DP's states: downsets of the layer DAG, as every pipeline cut is one (all of them when few,
else prefixes of three topological orders, honestly flagged; docs/optimizer-search.md)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from partitioner.errors import PlanError
from partitioner.graph import Profile
from partitioner.optimizer.pricing.stage import FloatArray, IntArray

__all__ = [
    "DEFAULT_MAX_STATES",
    "StateSet",
    "build_states",
    "chain_states",
    "csr_offsets",
    "downset_states",
    "downsets_at_least",
    "free_sinks",
    "more_downsets_than",
    "multi_order_states",
    "prefix_chain",
    "runs",
    "thin_prefixes",
    "without_free_sinks",
]

log = logging.getLogger(__name__)

WordArray = npt.NDArray[np.uint64]
DEFAULT_MAX_STATES = 2500
MULTI_ORDER_MAX_LAYERS = 1500  # NASNet-large: 1,249 layers, 3,657 prefixes, 6.3M subset pairs


@dataclass(frozen=True)
class StateSet:
    """Downsets ordered by size (index 0 = nothing, last = every layer) with their prefix sums.

    Attributes:
        layer_ids: the layers (profile nodes other than inputs), topologically ordered.
        masks: bit i set = layer_ids[i] is in the downset.
        compute_s: forward+backward seconds of each downset.
        param_bytes: parameter bytes of each downset.
        saved_bytes: activation bytes kept for backward by each downset.
        act_bytes: bytes leaving the downset (outputs of its members read by non-members).
        sent_bytes: of those, what their producers' backwards do not keep: a stage ending at this
            state holds them per item as autograd's roots (``Node.kept_output_bytes``; 0 where
            not measured).
        received_bytes: of those, what their producers keep: a stage starting at this state holds
            its own copy per item, which no count of its layers covers.
        preds: for state j, the states k with mask_k a strict subset of mask_j (None: all k < j;
            prefix states keep them as runs, ``PrefixPreds``).
        exact: True when every downset of the DAG is present.
        stage_s: seconds every stage adds per minibatch whatever its layers: the runtime's time per
            action times the actions a stage runs (``pricing.schedules.with_actions``); 0 until a
            search sets it for its schedule (:meth:`with_actions`).
    """

    layer_ids: tuple[str, ...]
    masks: tuple[int, ...]
    compute_s: FloatArray
    param_bytes: FloatArray
    saved_bytes: FloatArray
    act_bytes: FloatArray
    sent_bytes: FloatArray
    received_bytes: FloatArray
    preds: tuple[IntArray, ...] | PrefixPreds | None
    exact: bool
    stage_s: float = 0.0

    def __len__(self) -> int:
        return len(self.masks)

    def pred(self, j: int) -> IntArray:
        """States that can precede state j as the previous cut."""
        if self.preds is None:
            return np.arange(j, dtype=np.int64)
        return self.preds[j]

    def pair_count(self) -> int:
        """How many (earlier, later) state pairs there are: stage candidates before any pruning."""
        if isinstance(self.preds, tuple):
            return sum(len(p) for p in self.preds)
        return int(self._runs().counts().sum())

    def pair_blocks(
        self, size: int, limit: tuple[IntArray, IntArray] | None = None
    ) -> Iterator[tuple[IntArray, IntArray]]:
        """Every pair (k, j), k a strict subset of j, as (ks, js) grouped by j, about ``size`` at a
        time; with ``limit`` = (need, room), only those with need[k] <= room[j], never listing the
        others (a filter by unit windows that NASNet's millions of prefix pairs mostly fail)."""
        if isinstance(self.preds, tuple):
            counts = np.array([len(p) for p in self.preds], dtype=np.int64)
            for lo, hi in blocks(counts, size):
                ks = np.concatenate(self.preds[lo:hi]).astype(np.int64)
                js = np.repeat(np.arange(lo, hi), counts[lo:hi])
                if limit is not None:
                    fits = limit[0][ks] <= limit[1][js]
                    ks, js = ks[fits], js[fits]
                yield ks, js
            return
        runs = self._runs() if limit is None else self._runs().limited(*limit)
        for lo, hi in blocks(runs.counts(), size):
            yield runs.block(lo, hi)

    def all_pairs(self) -> tuple[IntArray, IntArray]:
        """Every pair (k, j), k a strict subset of j, grouped by j."""
        ks, js = zip(*self.pair_blocks(1 << 62), strict=True)
        return np.concatenate(ks), np.concatenate(js)

    def _runs(self) -> PrefixPreds:
        """The subsets as runs (a chain's state j has every earlier state as one run)."""
        if isinstance(self.preds, PrefixPreds):
            return self.preds
        every = np.arange(len(self), dtype=np.int64)
        return PrefixPreds((every,), every[None, :])

    def size_layers(self) -> IntArray:
        """States of one size are ``layers[i]:layers[i + 1]``: no stage joins two of them."""
        sizes = np.array([m.bit_count() for m in self.masks])
        return np.flatnonzero(np.diff(sizes, prepend=-1, append=-1)).astype(np.int64)

    def subset_matrix(self) -> npt.NDArray[np.bool_]:
        """sub[k, j] = state k is a strict subset of state j."""
        n = len(self)
        sub = np.zeros((n, n), dtype=bool)
        for j in range(n):
            sub[self.pred(j), j] = True
        return sub

    def take(self, idx: IntArray, preds: PrefixPreds | None) -> StateSet:
        """The states ``idx`` (ascending), renumbered 0.. in that order, with ``preds``; not exact."""
        masks = tuple(self.masks[i] for i in idx)
        sums = (self.compute_s[idx], self.param_bytes[idx], self.saved_bytes[idx], self.act_bytes[idx],
                self.sent_bytes[idx], self.received_bytes[idx])  # fmt: skip
        return StateSet(self.layer_ids, masks, *sums, preds, False, self.stage_s)

    def compute(self, ks: IntArray | int, js: IntArray | int) -> FloatArray:
        """Seconds per minibatch of stages (ks, js] on one device: their layers' compute and the
        runtime's time on their actions (``stage_s``), as the price's closed forms charge them."""
        return np.asarray(self.compute_s[js] - self.compute_s[ks] + self.stage_s, dtype=np.float64)

    def sums(self, values: FloatArray) -> FloatArray:
        """Per state, the sum of ``values`` (one per layer, in ``layer_ids`` order) over its layers."""
        width = len(self.layer_ids)
        member = _unpack(_pack(list(self.masks), width), width).astype(np.float64)
        return np.asarray(member @ np.asarray(values, dtype=np.float64), dtype=np.float64)

    def with_actions(self, action_s: float, actions: int) -> StateSet:
        """These states priced for a schedule whose stages run ``actions`` actions a minibatch at
        ``action_s`` each (``ScheduleModel.actions``, ``Cluster.action_s``)."""
        return replace(self, stage_s=action_s * actions)

    def item_bytes(self, ks: IntArray, js: IntArray) -> FloatArray:
        """What stages (ks, js] hold per item in flight: their layers' saved bytes, the outputs they
        send that no layer keeps, and the copies of kept tensors they receive (as the price's
        ``StageLoad.item_bytes``)."""
        return np.asarray(
            self.saved_bytes[js] - self.saved_bytes[ks] + self.sent_bytes[js] + self.received_bytes[ks],
            dtype=np.float64,
        )

    def members(self, k: int, j: int) -> tuple[str, ...]:
        """Layer ids in state j but not in state k, in topological order."""
        diff = self.masks[j] & ~self.masks[k]
        return tuple(lid for i, lid in enumerate(self.layer_ids) if diff >> i & 1)


def csr_offsets(js: IntArray, n: int) -> IntArray:
    """offsets[j] = how many of ``js`` are below j (n + 1 entries): items grouped by j, CSR."""
    offsets = np.zeros(n + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(np.bincount(js, minlength=n))
    return offsets


def runs(start: IntArray, count: IntArray) -> tuple[IntArray, IntArray]:
    """(owner, element) for every element of the runs [start[i], start[i] + count[i])."""
    owner = np.repeat(np.arange(len(count)), count)
    return owner, np.repeat(start - (np.cumsum(count) - count), count) + np.arange(int(count.sum()))


def blocks(counts: IntArray, size: int) -> Iterator[tuple[int, int]]:
    """Runs of states [lo, hi) with about ``size`` pairs each (at least one state per run)."""
    ends = np.cumsum(counts)
    lo, n = 0, len(counts)
    while lo < n:
        done = int(ends[lo - 1]) if lo else 0
        hi = max(lo + 1, int(np.searchsorted(ends, done + size, side="right")))
        yield lo, min(hi, n)
        lo = hi


def free_sinks(profile: Profile) -> dict[str, str]:
    """Sinks that cost nothing (no time, no parameters, one non-input producer) -> their producer.

    PipeDream's graphs end LSTMs with unused ``__getitem__`` outputs; each one doubles the number
    of downsets (it may sit on either side of any later cut), yet the best plan always keeps it with
    its producer (anywhere else only adds traffic). PipeDream deletes them; we let them ride along.
    """
    readers = {src for n in profile.nodes for src in n.inputs}
    kinds = {n.id: n.op for n in profile.nodes}
    out: dict[str, str] = {}
    for n in profile.nodes:
        if n.id in readers or n.op in ("input", "output") or len(n.inputs) != 1:
            continue
        if n.compute_ms == 0 and n.param_bytes == 0 and kinds.get(n.inputs[0]) != "input":
            out[n.id] = n.inputs[0]
    return out


def without_free_sinks(profile: Profile) -> Profile:
    """The profile the search runs on: free sinks removed (their saved bytes go to the producer)."""
    riders = free_sinks(profile)
    if not riders:
        return profile
    extra_saved: dict[str, int] = {}
    for sink, producer in riders.items():
        extra_saved[producer] = extra_saved.get(producer, 0) + profile.node(sink).saved_bytes
    nodes = tuple(
        replace(n, saved_bytes=n.saved_bytes + extra_saved[n.id]) if n.id in extra_saved else n
        for n in profile.nodes
        if n.id not in riders
    )
    return replace(profile, nodes=nodes)


def _layers(profile: Profile) -> tuple[list[str], list[int], list[int]]:
    """Layer ids plus predecessor and successor bitmasks (inputs are free and excluded)."""
    ids = [n.id for n in profile.nodes if n.op != "input"]
    if not ids:
        raise PlanError("the profile has no layers to partition")
    index = {lid: i for i, lid in enumerate(ids)}
    preds = [0] * len(ids)
    succs = [0] * len(ids)
    for node in profile.nodes:
        if node.id not in index:
            continue
        for src in node.inputs:
            if src in index:
                preds[index[node.id]] |= 1 << index[src]
                succs[index[src]] |= 1 << index[node.id]
    return ids, preds, succs


def _enumerate(preds: list[int], succs: list[int], cap: int) -> list[int] | None:
    """Every downset, breadth first by size, each grown only by the layers that may join it; None
    once there are more than ``cap``."""
    roots = sum(1 << i for i, p in enumerate(preds) if p == 0)
    layer = {0: roots}
    found = [0]
    while layer:
        nxt: dict[int, int] = {}
        for mask, free in layer.items():
            rest = free
            while rest:
                low = rest & -rest
                rest ^= low
                grown = mask | low
                if grown not in nxt:
                    nxt[grown] = addable(free & ~low, low.bit_length() - 1, grown, preds, succs)
            if len(found) + len(nxt) > cap:
                return None
        found.extend(sorted(nxt))
        layer = nxt
    return found


def addable(base: int, x: int, grown: int, preds: list[int], succs: list[int]) -> int:
    """Layers that may join downset ``grown`` (just grown by layer x from a set whose were ``base``)."""
    free, s = base, succs[x]
    while s:
        low = s & -s
        s ^= low
        y = low.bit_length() - 1
        if preds[y] & grown == preds[y]:
            free |= low
    return free


def _pack(masks: list[int], width: int) -> WordArray:
    """Python-int bitmasks as rows of little-endian 64-bit words."""
    words = max(1, (width + 63) // 64)
    raw = b"".join(m.to_bytes(8 * words, "little") for m in masks)
    return np.frombuffer(raw, dtype=np.uint64).reshape(len(masks), words).copy()


def _unpack(rows: WordArray, width: int) -> npt.NDArray[np.uint8]:
    """Rows of words as a 0/1 matrix [row, layer]."""
    as_bytes = np.ascontiguousarray(rows).view(np.uint8).reshape(len(rows), -1)
    return np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :width]


def _columns(profile: Profile, ids: list[str]) -> FloatArray:
    """[layer, 6]: each layer's compute seconds, parameter, saved and output bytes, and of its output
    bytes those its backward does not keep and those it keeps (both 0 where not measured)."""
    nodes = {n.id: n for n in profile.nodes}
    layers = [nodes[i] for i in ids]
    cols = [
        [n.compute_ms / 1000.0, n.param_bytes, n.saved_bytes, n.output_bytes,
         0 if n.kept_output_bytes is None else n.output_bytes - n.kept_output_bytes, n.kept_output_bytes or 0]
        for n in layers
    ]  # fmt: skip
    return np.array(cols, dtype=np.float64).reshape(len(ids), 6)


def _sums(profile: Profile, ids: list[str], masks: list[int]) -> tuple[FloatArray, ...]:
    mat = _unpack(_pack(masks, len(ids)), len(ids)).astype(np.float64)
    comp, par, sav = _columns(profile, ids)[:, :3].T.copy()  # (contiguous rows, as the products had)
    return mat @ comp, mat @ par, mat @ sav, mat


def _boundary(profile: Profile, ids: list[str], succs: list[int], mat: FloatArray) -> FloatArray:
    """[state, 3]: bytes each downset sends onward (outputs of members that a non-member reads), and
    of those what their producers do not keep and what they keep (:func:`_columns`)."""
    src = [i for i, s in enumerate(succs) for _ in _bit_indices(s)]
    dst = [t for s in succs for t in _bit_indices(s)]
    if not src:
        return np.zeros((len(mat), 3))
    senders = np.array(sorted(set(src)), dtype=np.int64)
    starts = np.searchsorted(np.asarray(src), senders)  # src is sorted: edges grouped by sender
    bits = mat.astype(np.uint8)
    inside = np.add.reduceat(bits[:, dst], starts, axis=1, dtype=np.int32)  # [state, sender]: readers inside
    degree = np.diff(np.append(starts, len(src)))
    leaving = (mat[:, senders] > 0) & (inside < degree[None, :])
    return np.asarray(leaving @ _columns(profile, ids)[senders, 3:], dtype=np.float64)


def _bit_indices(mask: int) -> list[int]:
    """Positions of the set bits, lowest first."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def _subset_preds(masks: list[int], width: int) -> tuple[IntArray, ...]:
    """preds[j]: the states strictly inside state j, ascending (64 layers per vectorised test)."""
    packed = _pack(masks, width)
    outside = np.zeros((len(masks), len(masks)), dtype=np.uint64)  # [k, j]: bits of k not in j
    for w in range(packed.shape[1]):
        col = packed[:, w]
        outside |= col[:, None] & ~col[None, :]
    sub = outside == 0
    np.fill_diagonal(sub, False)  # the masks are distinct: equal sets are the diagonal only
    js, ks = np.nonzero(sub.T)
    counts = np.bincount(js, minlength=len(masks))
    return tuple(np.split(ks.astype(np.int64), np.cumsum(counts)[:-1]))


def downsets_at_least(preds: list[int], succs: list[int], cap: int) -> int:
    """A lower bound on the number of downsets (exceeds ``cap`` early), to skip a doomed listing: the
    product of (length + 1) over pairwise incomparable series runs (docs/optimizer-search.md)."""
    below: list[int] = []  # per layer: its ancestors as a bitmask
    for bits in preds:
        mask = 0
        for p in _bit_indices(bits):
            mask |= below[p] | 1 << p
        below.append(mask)
    runs = []
    for head, bits in enumerate(preds):
        if bits.bit_count() == 1 and succs[bits.bit_length() - 1].bit_count() == 1:
            continue  # inside a run
        tail, length = head, 1
        while succs[tail].bit_count() == 1 and preds[succs[tail].bit_length() - 1].bit_count() == 1:
            tail, length = succs[tail].bit_length() - 1, length + 1
        runs.append((length, head, tail))
    chosen: list[tuple[int, int]] = []
    count = 1
    for length, head, tail in sorted(runs, reverse=True):
        if all(not (below[h] >> tail & 1 or below[head] >> t & 1) for h, t in chosen):
            chosen.append((head, tail))
            count *= length + 1
            if count > cap:
                break
    return count


def more_downsets_than(profile: Profile, cap: int) -> bool:
    """Whether the layer DAG surely has more than ``cap`` downsets (``downsets_at_least``)."""
    _, preds, succs = _layers(profile)
    return downsets_at_least(preds, succs, cap) > cap


def downset_states(profile: Profile, max_states: int = DEFAULT_MAX_STATES) -> StateSet | None:
    """All downsets of the layer DAG, or None when there are more than ``max_states``."""
    ids, preds, succs = _layers(profile)
    if downsets_at_least(preds, succs, max_states) > max_states:
        return None
    masks = _enumerate(preds, succs, max_states)
    if masks is None:
        return None
    comp, par, sav, mat = _sums(profile, ids, masks)
    act, sent, received = _boundary(profile, ids, succs, mat).T
    is_chain = all(masks[i] & masks[i + 1] == masks[i] for i in range(len(masks) - 1))
    preds_ = None if is_chain else _subset_preds(masks, len(ids))
    return StateSet(tuple(ids), tuple(masks), comp, par, sav, act, sent, received, preds_, True)


def chain_states(profile: Profile, max_states: int | None = None) -> StateSet:
    """Prefixes of the profile's topological order (optionally thinned evenly by compute time)."""
    ids, _, succs = _layers(profile)
    n = len(ids)
    order = [list(range(n))]
    prefixes = _prefix_masks(order)
    comp, par, sav, act, sent, received = _prefix_sums(profile, ids, succs, order, prefixes, prefixes[0])
    cuts = np.arange(n + 1)
    if max_states is not None and n + 1 > max_states:
        pick = np.searchsorted(comp, np.linspace(0.0, comp[-1], max_states)).tolist()
        cuts = np.array(sorted({0, n, *pick}))  # (np.unique imports numpy.ma)
    masks = tuple(prefixes[0][c] for c in cuts)
    exact = len(cuts) == n + 1 and _is_chain(succs)
    sums = (comp[cuts], par[cuts], sav[cuts], act[cuts], sent[cuts], received[cuts])
    return StateSet(tuple(ids), masks, *sums, None, exact)


def _orders(preds: list[int], succs: list[int]) -> list[list[int]]:
    """Three topological orders: the profile's, as-soon-as-possible and as-late-as-possible.

    On branching graphs they interleave the branches differently (a ResNet shortcut early or
    late, Inception's towers in lockstep or one after another), so their prefixes give the DP
    cuts that no single order has.
    """
    n = len(preds)
    depth, height = [0] * n, [0] * n
    for i in range(n):
        depth[i] = max((depth[p] + 1 for p in _bit_indices(preds[i])), default=0)
    for i in reversed(range(n)):
        height[i] = max((height[x] + 1 for x in _bit_indices(succs[i])), default=0)
    top = max(d + h for d, h in zip(depth, height, strict=True))
    asap = sorted(range(n), key=lambda i: (depth[i], i))
    alap = sorted(range(n), key=lambda i: (top - height[i], i))
    return [list(range(n)), asap, alap]


def _prefix_masks(orders: list[list[int]]) -> list[list[int]]:
    """Per order, the masks of its prefixes (lengths 0 to n)."""
    prefixes = [[0] for _ in orders]
    for order, masks in zip(orders, prefixes, strict=True):
        for i in order:
            masks.append(masks[-1] | 1 << i)
    return prefixes


def multi_order_states(profile: Profile, max_layers: int = MULTI_ORDER_MAX_LAYERS) -> StateSet:
    """Prefixes of several topological orders (a superset of :func:`chain_states`); not exhaustive."""
    ids, preds, succs = _layers(profile)
    if len(ids) > max_layers:
        return chain_states(profile)
    orders = _orders(preds, succs)
    prefixes = _prefix_masks(orders)
    ordered = sorted({m for masks in prefixes for m in masks}, key=lambda m: (m.bit_count(), m))
    comp, par, sav, act, sent, received = _prefix_sums(profile, ids, succs, orders, prefixes, ordered)
    is_chain = all(ordered[i] & ordered[i + 1] == ordered[i] for i in range(len(ordered) - 1))
    preds_ = None if is_chain else PrefixPreds.of(orders, prefixes, ordered)
    return StateSet(tuple(ids), tuple(ordered), comp, par, sav, act, sent, received, preds_, False)


def _prefix_sums(
    profile: Profile, ids: list[str], succs: list[int], orders: list[list[int]], prefixes: list[list[int]],
    ordered: list[int],
) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray, FloatArray, FloatArray]:  # fmt: skip
    """``_sums`` and ``_boundary`` of prefix states, from running sums along each order (the bytes
    leaving every prefix are one cumulative sum of +out / -out marks)."""
    cols = _columns(profile, ids)
    out = np.zeros((len(ordered), 6))
    index = {m: i for i, m in enumerate(ordered)}
    src = np.array([x for x, readers in enumerate(succs) for _ in _bit_indices(readers)], dtype=np.int64)
    dst = np.array([y for readers in succs for y in _bit_indices(readers)], dtype=np.int64)
    senders = np.unique(src)
    for order, masks in zip(orders, prefixes, strict=True):
        pos = np.empty(len(order), dtype=np.int64)
        pos[np.asarray(order, dtype=np.int64)] = np.arange(len(order))
        sums = np.vstack([np.zeros((1, 3)), np.cumsum(cols[order, :3], axis=0)])
        last = np.full(len(order), -1, dtype=np.int64)
        np.maximum.at(last, src, pos[dst])  # each sender's last reader, in this order
        marks = np.zeros((len(order) + 2, 3))
        np.add.at(marks, pos[senders] + 1, cols[senders, 3:])
        np.add.at(marks, last[senders] + 1, -cols[senders, 3:])
        where = np.array([index[m] for m in masks], dtype=np.int64)
        out[where, :3] = sums
        out[where, 3:] = np.cumsum(marks, axis=0)[: len(order) + 1]
    return out[:, 0], out[:, 1], out[:, 2], out[:, 3], out[:, 4], out[:, 5]


@dataclass(frozen=True)
class PrefixPreds:
    """The strict subsets of every prefix state, kept as runs along the orders (one binary search per
    state and order), not listed: NASNet's prefixes have millions of subset pairs
    (docs/optimizer-search.md)."""

    own: tuple[IntArray, ...]  # per order: the states whose home it is, shortest prefix first
    upto: IntArray  # [order, j]: how many of own[order] are strict subsets of state j
    chains: tuple[IntArray, ...] = ()  # per order: its prefixes' states, shortest first

    def __getitem__(self, j: int) -> IntArray:
        parts = [own[:count] for own, count in zip(self.own, self.upto[:, j].tolist(), strict=True)]
        return np.sort(np.concatenate(parts))

    def counts(self) -> IntArray:
        return np.asarray(self.upto.sum(axis=0), dtype=np.int64)

    def limited(self, need: IntArray, room: IntArray) -> PrefixPreds:
        """The runs of pairs (k, j) with need[k] <= room[j] only (one filtered copy per room value)."""
        own: list[IntArray] = []
        rows: list[IntArray] = []
        for value in np.unique(room).tolist():
            here = room == value
            for a, states in enumerate(self.own):
                fits = need[states] <= value
                seen = np.concatenate([[0], np.cumsum(fits)])
                own.append(states[fits])
                rows.append(np.where(here, seen[self.upto[a]], 0))
        return PrefixPreds(tuple(own), np.array(rows, dtype=np.int64).reshape(len(rows), -1))

    def subset(self, idx: IntArray) -> PrefixPreds:
        """The runs among the states ``idx`` (ascending), renumbered 0.. in that order."""
        keep = np.zeros(self.upto.shape[1], dtype=bool)
        keep[idx] = True
        new = np.cumsum(keep) - 1
        own, upto = [], np.zeros((len(self.own), len(idx)), dtype=np.int64)
        for a, states in enumerate(self.own):
            fits = keep[states]
            seen = np.concatenate([[0], np.cumsum(fits)])
            own.append(new[states[fits]])
            upto[a] = seen[self.upto[a][idx]]
        chains = tuple(new[c[keep[c]]] for c in self.chains)
        return PrefixPreds(tuple(own), upto, chains)

    def block(self, lo: int, hi: int) -> tuple[IntArray, IntArray]:
        """The pairs (k, j) for j in [lo, hi), grouped by j: one pass, however many orders."""
        count = self.upto[:, lo:hi].T.reshape(-1)  # runs (j, order), j-major
        first = np.cumsum([0] + [len(o) for o in self.own[:-1]])
        run, at = runs(np.tile(first, hi - lo), count)
        ks = np.concatenate(self.own)[at] if len(at) else np.zeros(0, dtype=np.int64)
        return ks.astype(np.int64), (lo + run // len(self.own)).astype(np.int64)

    @staticmethod
    def of(orders: list[list[int]], prefixes: list[list[int]], ordered: list[int]) -> PrefixPreds:
        index = {m: i for i, m in enumerate(ordered)}
        idx = [np.array([index[m] for m in masks], dtype=np.int64) for masks in prefixes]
        pos = []
        for order in orders:
            where = np.empty(len(order), dtype=np.int64)
            where[np.asarray(order, dtype=np.int64)] = np.arange(len(order))
            pos.append(where)
        home = np.full(len(ordered), -1, dtype=np.int64)  # each state as (order b, length q): any one
        length = np.zeros(len(ordered), dtype=np.int64)
        for b in reversed(range(len(orders))):
            home[idx[b]], length[idx[b]] = b, np.arange(len(idx[b]))
        runs = np.zeros((len(orders), len(ordered)), dtype=np.int64)  # [a, j]: prefixes of a inside j
        for a, order in enumerate(orders):
            for b in range(len(orders)):
                top = np.concatenate([[-1], np.maximum.accumulate(pos[b][np.asarray(order, dtype=np.int64)])])
                mine = home == b
                runs[a, mine] = np.searchsorted(top, length[mine], side="left")
        own, upto = [], np.zeros_like(runs)
        for a in range(len(orders)):
            at_home = home[idx[a]] == a  # idx[a] ascends with length: own[a] stays shortest first
            seen = np.concatenate([[0], np.cumsum(at_home)])
            own.append(idx[a][at_home])
            upto[a] = seen[runs[a]] - (home == a)  # a state's own run ends with itself: not strict
        return PrefixPreds(tuple(own), upto, tuple(idx))


def thin_prefixes(states: StateSet, most: int) -> StateSet | None:
    """Prefix states with each order's prefixes thinned evenly by compute to ``most`` (None when
    the states are not prefixes of several orders, or not more than that already).

    Plans over them mix the orders as the full search does (a single order's chain cannot: on
    NASNet-large at 16 GPUs its best is 6% slower than the optimum), on a tenth of the pairs.
    """
    if not isinstance(states.preds, PrefixPreds) or len(states) <= len(states.preds.chains) * most:
        return None
    picked = {0, len(states) - 1}
    for chain in states.preds.chains:
        c = states.compute_s[chain]
        picked.update(
            chain[np.minimum(np.searchsorted(c, np.linspace(0.0, c[-1], most)), len(chain) - 1)].tolist()
        )
    idx = np.array(sorted(picked), dtype=np.int64)
    return states.take(idx, states.preds.subset(idx))


def prefix_chain(states: StateSet, most: int = 48) -> tuple[IntArray, StateSet] | None:
    """The states that are prefixes of the layer order, thinned evenly by compute to ``most``.

    Returns their indices and them as a chain of states (each a subset of the next), or None when
    the set has no such chain from nothing to everything.
    """
    idx = np.flatnonzero([m & (m + 1) == 0 for m in states.masks])
    if len(idx) < 2 or idx[0] != 0 or idx[-1] != len(states) - 1:
        return None
    if len(idx) > most:
        c = states.compute_s[idx]
        pick = np.searchsorted(c, np.linspace(0.0, c[-1], most))
        idx = idx[sorted({0, len(idx) - 1, *np.minimum(pick, len(idx) - 1).tolist()})]
    return idx.astype(np.int64), states.take(idx, None)


def _is_chain(succs: list[int]) -> bool:
    """A plain chain: layer i feeds only layer i+1, so prefixes are all the downsets."""
    return all(s == 1 << (i + 1) for i, s in enumerate(succs[:-1])) and succs[-1] == 0


def build_states(profile: Profile, max_states: int = DEFAULT_MAX_STATES) -> StateSet:
    """All downsets when there are at most ``max_states``, else the topological prefixes."""
    states = downset_states(profile, max_states)
    if states is not None:
        return states
    log.info("more than %d downsets: falling back to topological prefixes (not optimal)", max_states)
    return multi_order_states(profile)
