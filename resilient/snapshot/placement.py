"""Where each node's peer replicas go: k targets in other failure domains, the load spread
evenly, and stable when a node leaves.

Why not the ring (``peer.peer_order``: the next nodes in sorted order whose domain
differs): with domains laid out in name order (``rack3-node07``...), every node of a rack
picks the *first* node of the next rack, which then holds a whole rack's replicas (16×
the average with 16 nodes a rack) while the others hold none; its RAM and its link are
what a version waits for.

:func:`place` is a pure function of the membership (``{node: domain}``), ``k`` and,
optionally, the previous placement:

* **other domains**: every target is in another domain than its source whenever enough
  such nodes exist (then same-domain nodes, never the source itself);
* **balanced**: no node is the target of more than ``capacity(k, eps)`` =
  ``max(k + 1, ceil(k × (1 + eps)))`` sources, when the domains allow it (no domain
  holding more than half the nodes). Sources are placed from the largest domain down
  (the most constrained first) and each takes its least-loaded eligible targets, ties
  broken by rendezvous hashing (a per-pair hash, so two fleets of the same names place
  alike and no name order is favoured);
* **stable**: given ``previous``, every previous target that is still a member and still
  valid is kept, whatever its load, and only the missing slots are filled (under the
  capacity where a valid node is under it). When one node leaves, only the replicas it
  held move (and its own sources vanish); when the kept replicas fill every valid node, a
  new pick may go one over the capacity rather than move a replica that is still valid.

Every agent computes the whole fleet's placement from the same registry, so all agree
without talking; an agent that saw another sequence of memberships may differ on a few
pairs, which costs balance, never correctness (a commit records where replicas are).
Cost: O(N × N × k) comparisons: 512 nodes, k = 2, ≈ 0.3-0.7 s of one core (memoized).
"""

from __future__ import annotations

import hashlib
import math
import threading
from typing import Mapping, Sequence

__all__ = ["capacity", "place", "replica_order", "loads"]


def capacity(k: int, eps: float) -> int:
    """The most sources one node should hold replicas of."""
    return max(k + 1, math.ceil(k * (1 + eps)))


def _node_hash(node: str) -> int:
    return int.from_bytes(hashlib.blake2b(node.encode(), digest_size=8).digest(), "big")


_M64 = (1 << 64) - 1


def _score(hs: int, ht: int) -> int:
    """Rendezvous-hashing weight of a target for a source, from their name hashes (higher
    wins a tie): a 64-bit mix (splitmix64's finalizer) of the pair, so every source ranks
    the targets in its own order."""
    x = (hs ^ (ht * 0x9E3779B97F4A7C15)) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


_MEMO: dict[tuple, dict[str, list[str]]] = {}
_MEMO_LOCK = threading.Lock()


def place(domains: Mapping[str, str], k: int, *, eps: float = 0.25,
          previous: Mapping[str, Sequence[str]] | None = None) -> dict[str, list[str]]:
    """``{node: [k targets]}`` for every node of ``domains`` (``{node: failure domain}``).
    See the module docstring for the guarantees. A node gets fewer than ``k`` targets only
    when fewer than ``k`` other nodes exist. Memoized (a few entries): agents sharing a
    process, as the simulator's do, compute a membership's placement once."""
    key = (tuple(sorted(domains.items())), k, eps,
           tuple(sorted((s, tuple(t)) for s, t in (previous or {}).items())))
    with _MEMO_LOCK:
        got = _MEMO.get(key)
    if got is None:
        got = _place(domains, k, eps, previous)
        with _MEMO_LOCK:
            if len(_MEMO) >= 8:
                _MEMO.pop(next(iter(_MEMO)))
            _MEMO[key] = got
    return {s: list(t) for s, t in got.items()}


def _place(domains: Mapping[str, str], k: int, eps: float,
           previous: Mapping[str, Sequence[str]] | None) -> dict[str, list[str]]:
    if k < 0:
        raise ValueError(f"k={k}: the number of replicas cannot be negative")
    cap = capacity(k, eps)
    load = {n: 0 for n in domains}
    h = {n: _node_hash(n) for n in domains}
    out: dict[str, list[str]] = {}
    size: dict[str, int] = {}
    for d in domains.values():
        size[d] = size.get(d, 0) + 1
    # Keep what is still valid (whatever the load: the cap governs new picks, so a removal
    # never moves a replica that stays valid). A target in the source's own domain is valid
    # only while other domains are too few.
    for src in sorted(domains):
        kept: list[str] = []
        few = len(domains) - size[domains[src]] < k
        for t in (previous or {}).get(src, ()):
            if (t in domains and t != src and t not in kept and (few or domains[t] != domains[src])
                    and len(kept) < k):
                kept.append(t)
                load[t] += 1
        out[src] = kept
    # The most constrained sources first: those of the largest domain have the fewest choices.
    order = sorted(domains, key=lambda n: (-size[domains[n]], domains[n], n))
    for src in order:
        need = min(k, len(domains) - 1) - len(out[src])
        if need <= 0:
            continue
        mine = domains[src]
        used = {domains[t] for t in out[src]}
        cands = [t for t in domains if t != src and t not in out[src]]
        for _ in range(need):
            # Other domains first; among them those under the cap, a domain this source does
            # not use yet, the least loaded, then the hash.
            t = min(cands, key=lambda t: (domains[t] == mine, load[t] >= cap, domains[t] in used, load[t],
                                          -_score(h[src], h[t])))
            cands.remove(t)
            out[src].append(t)
            used.add(domains[t])
            load[t] += 1
    return out


def loads(placement: Mapping[str, Sequence[str]]) -> dict[str, int]:
    """How many sources each node holds replicas of."""
    got = {n: 0 for n in placement}
    for targets in placement.values():
        for t in targets:
            got[t] = got.get(t, 0) + 1
    return got


def replica_order(me: str, placement: Mapping[str, Sequence[str]], domains: Mapping[str, str]) -> list[str]:
    """Where ``me`` pushes: its placed targets, then every other node as a fallback (a
    target that fails is skipped), other domains first, by rendezvous hash."""
    first = [t for t in placement.get(me, ()) if t in domains and t != me]
    mine, hm = domains.get(me, me), _node_hash(me)
    rest = sorted((n for n in domains if n != me and n not in first),
                  key=lambda n: (domains[n] == mine, -_score(hm, _node_hash(n))))
    return first + rest
