"""Check every rank's recorded communication (:mod:`.comm_record` events) against NCCL's rules. Pure Python.

:func:`check` takes one event list per rank (index = global rank) and returns one line per problem (empty: the
streams are consistent and cannot deadlock under the model below):

a. ``new_group`` is collective over the world: every rank creates the same groups in the same order. Under
   eager NCCL initialisation (``init_process_group(device_id=...)``, what the runtime does on GPUs) that holds
   for a group made with ``use_local_synchronization`` too (event ``("new_group", ranks, "local")``): torch
   splits every new group from the world communicator (``ncclCommSplit``, a collective of the whole world)
   and a rank outside a local group makes no call, so its members wait. A local group is therefore one
   world split as well: at the same position of every rank's sequence of ``new_group`` calls, every rank makes
   a local group holding itself, and ranks in one such group name the same group (one rank's one-rank group
   each, say);
b. a communicator (a group's rank set) is a stream of kernels: every member issues that communicator's
   collectives in the same order, with the same operation, shape and dtype; only members issue them;
c. NCCL has no tags: per ordered pair (src, dst) the k-th send src->dst meets the k-th receive at dst from src,
   and they must agree in shape and dtype; where the tags' order differs from the posting order, gloo (which
   matches by tag) would pair the messages differently from NCCL, and that is reported too;
d. no deadlock under NCCL's conservative model: each rank's operations complete in issue order (kernels of
   one rank may serialize); a collective completes once every member has reached it; ``new_group`` (local or
   not) once every rank has reached the same split; a P2P batch once every operation's matching operation sits
   in a batch at the head of its rank, closed transitively (the batches complete together, as one group
   call). The simulation runs until nothing
   moves; ranks left with operations are reported with the operation they are stuck at (a cycle of waits
   across communicators, or a message nobody receives).

:func:`summary` counts, per rank: communicators used (distinct groups of its collectives, the default group
always counted: NCCL keeps one per group), P2P peers, and operations per recorded pass (collectives and P2P
operations), with their maximum and mean over the ranks.
"""
from __future__ import annotations

from collections import deque
from typing import Sequence

Event = tuple
#: at most this many lines per kind of problem (a 1024-rank mismatch would otherwise print thousands)
MAX_LINES = 8


def _capped(lines: list[str], what: str) -> list[str]:
    if len(lines) <= MAX_LINES:
        return lines
    return lines[:MAX_LINES] + [f"... and {len(lines) - MAX_LINES} more {what}"]


def _fmt(e: Event) -> str:
    if e[0] == "coll":
        return f"{e[1]} over {_span(e[2])} {list(e[3])} {e[4]}"
    if e[0] == "p2p":
        return "p2p batch [" + ", ".join(f"{k} {'to' if k == 'send' else 'from'} {p} {list(s)} {d} tag {t}"
                                         for k, p, s, d, t in e[1]) + "]"
    return f"{e[0]} {_span(e[1])}"


def _span(ranks: Sequence[int]) -> str:
    ranks = list(ranks)
    if len(ranks) > 6 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}..{ranks[-1]}"
    if len(ranks) > 6:
        return f"ranks {ranks[:3]}+{len(ranks) - 3} more"
    return f"ranks {ranks}"


def _local(e: Event) -> bool:
    return e[0] == "new_group" and len(e) > 2 and e[2] == "local"


def _split(e: Event) -> str:
    return f"local group {_span(e[1])}" if _local(e) else _span(e[1])


def _check_groups(events_by_rank) -> list[str]:
    seqs = [[e for e in evs if e[0] == "new_group"] for evs in events_by_rank]
    out = []
    for k in range(max((len(s) for s in seqs), default=0)):
        heads = {r: seq[k] for r, seq in enumerate(seqs) if k < len(seq)}
        ref = heads.get(0)
        if ref is not None and _local(ref):
            for r, e in sorted(heads.items()):
                if not _local(e):
                    out.append(f"new_group #{k}: rank {r} creates {_split(e)}, rank 0 creates {_split(ref)} "
                               f"(under eager NCCL initialisation every new_group is one split of the world "
                               f"communicator: at each position every rank makes a local group, or every rank "
                               f"the same group)")
                elif r not in e[1]:
                    out.append(f"new_group #{k}: rank {r} creates {_split(e)} without being in it")
                else:
                    for q in e[1]:
                        if q in heads and _local(heads[q]) and tuple(heads[q][1]) != tuple(e[1]):
                            out.append(f"new_group #{k}: rank {r} creates {_split(e)}, rank {q} "
                                       f"{_split(heads[q])}: ranks of one local group must name the same group")
                            break
        else:
            for r, e in sorted(heads.items()):
                if ref is None or _local(e) or tuple(e[1]) != tuple(ref[1]):
                    out.append(f"new_group #{k}: rank {r} creates {_split(e)}, rank 0 creates "
                               f"{_split(ref) if ref is not None else 'nothing'} (new_group is collective over "
                               f"the world: same groups, same order on every rank)")
        for r in range(len(seqs)):
            if r not in heads and ref is not None:
                out.append(f"new_group #{k}: rank {r} creates nothing, rank 0 creates "
                           f"{_split(ref) if ref is not None else 'nothing'} (new_group is collective over the "
                           f"world: same groups, same order on every rank)")
    return _capped(out, "group mismatches")


def _check_collectives(events_by_rank) -> list[str]:
    world = len(events_by_rank)
    per: dict[tuple, dict[int, list]] = {}
    out = []
    for r, evs in enumerate(events_by_rank):
        for i, e in enumerate(evs):
            if e[0] != "coll":
                continue
            if r not in e[2]:
                out.append(f"rank {r} event #{i}: {_fmt(e)} on a group it is not in")
                continue
            if e[2] and e[2][-1] >= world:
                out.append(f"rank {r} event #{i}: {_fmt(e)} names ranks beyond the world of {world}")
                continue
            per.setdefault(tuple(e[2]), {}).setdefault(r, []).append((e[1], tuple(e[3]), e[4]))
    for ranks, by_rank in sorted(per.items()):
        ref_rank = ranks[0]
        ref = by_rank.get(ref_rank, [])
        for r in ranks:
            seq = by_rank.get(r, [])
            if seq == ref:
                continue
            k = next((i for i, (a, b) in enumerate(zip(seq, ref)) if a != b), min(len(seq), len(ref)))
            mine = " ".join(map(str, seq[k])) if k < len(seq) else "nothing"
            theirs = " ".join(map(str, ref[k])) if k < len(ref) else "nothing"
            out.append(f"communicator {_span(ranks)}: collective #{k} is {mine} on rank {r} but {theirs} "
                       f"on rank {ref_rank}")
    return _capped(out, "collective mismatches")


def _pairs(events_by_rank):
    """{(src, dst): [(rank, event index, op index, shape, dtype, tag)]} for sends and for receives."""
    sends: dict[tuple[int, int], list] = {}
    recvs: dict[tuple[int, int], list] = {}
    for r, evs in enumerate(events_by_rank):
        for i, e in enumerate(evs):
            if e[0] != "p2p":
                continue
            for j, (kind, peer, shape, dtype, tag) in enumerate(e[1]):
                if kind == "send":
                    sends.setdefault((r, peer), []).append((r, i, j, tuple(shape), dtype, tag))
                else:
                    recvs.setdefault((peer, r), []).append((r, i, j, tuple(shape), dtype, tag))
    return sends, recvs


def _check_p2p(events_by_rank, sends, recvs) -> list[str]:
    world = len(events_by_rank)
    out, tags = [], []
    for r, evs in enumerate(events_by_rank):
        for i, e in enumerate(evs):
            if e[0] == "p2p":
                for kind, peer, *_ in e[1]:
                    if not 0 <= peer < world or peer == r:
                        out.append(f"rank {r} event #{i}: {kind} with peer {peer} (world of {world})")
    for pair in sorted(set(sends) | set(recvs)):
        src, dst = pair
        s, v = sends.get(pair, []), recvs.get(pair, [])
        for k, (a, b) in enumerate(zip(s, v)):
            if (a[3], a[4]) != (b[3], b[4]):
                out.append(f"{src}->{dst} message #{k}: rank {src} sends {list(a[3])} {a[4]} (event #{a[1]}), "
                           f"rank {dst} receives {list(b[3])} {b[4]} (event #{b[1]})")
                break
        if len(s) != len(v):
            out.append(f"{src}->{dst}: rank {src} posts {len(s)} sends, rank {dst} posts {len(v)} receives")
        if len(s) == len(v) and [a[5] for a in s] != [b[5] for b in v]:
            k = next(k for k, (a, b) in enumerate(zip(s, v)) if a[5] != b[5])
            tags.append(f"{src}->{dst} message #{k}: send tag {s[k][5]}, receive tag {v[k][5]}: gloo matches by "
                        f"tag, NCCL by posting order, so they pair these messages differently")
    return _capped(out, "P2P mismatches") + _capped(tags, "tag/posting-order disagreements")


def _simulate(events_by_rank, sends, recvs) -> list[str]:
    world = len(events_by_rank)
    partners: dict[tuple[int, int], set] = {}
    unmatched: set[tuple[int, int]] = set()
    for pair in set(sends) | set(recvs):
        s, v = sends.get(pair, []), recvs.get(pair, [])
        for a, b in zip(s, v):
            partners.setdefault((a[0], a[1]), set()).add((b[0], b[1]))
            partners.setdefault((b[0], b[1]), set()).add((a[0], a[1]))
        for x in s[len(v):] + v[len(s):]:
            unmatched.add((x[0], x[1]))
    pos = [0] * world
    groups_done = [0] * world

    def participants(r: int):
        """Ranks and event indices that complete together with rank r's head, or None when not all there."""
        e = events_by_rank[r][pos[r]]
        if e[0] == "destroy_group":
            return [(r, pos[r])]
        if e[0] == "new_group":  # a split of the world communicator: every rank at the same split
            def same(h: Event) -> bool:
                return (h[0] == "new_group" and _local(h) == _local(e)
                        and (_local(h) or tuple(h[1]) == tuple(e[1])))
            ok = all(pos[q] < len(events_by_rank[q]) and same(events_by_rank[q][pos[q]])
                     and groups_done[q] == groups_done[r] for q in range(world))
            return [(q, pos[q]) for q in range(world)] if ok else None
        if e[0] == "coll":
            key = e[2]
            for q in key:
                if not (0 <= q < world and pos[q] < len(events_by_rank[q])):
                    return None
                h = events_by_rank[q][pos[q]]
                if h[0] != "coll" or h[2] != key:
                    return None
            return [(q, pos[q]) for q in key]
        # a P2P batch: its matching batches' closure, every one at the head of its rank
        seen, todo = {(r, pos[r])}, [(r, pos[r])]
        while todo:
            node = todo.pop()
            if node in unmatched:
                return None
            for q, i in partners.get(node, ()):
                if pos[q] != i:
                    return None
                if (q, i) not in seen:
                    seen.add((q, i))
                    todo.append((q, i))
        return sorted(seen)

    queue = deque(range(world))
    queued = [True] * world
    while queue:
        r = queue.popleft()
        queued[r] = False
        if pos[r] >= len(events_by_rank[r]):
            continue
        done = participants(r)
        if done is None:
            continue
        for q, i in done:
            if events_by_rank[q][i][0] == "new_group":
                groups_done[q] += 1
            pos[q] = i + 1
            if not queued[q]:
                queued[q] = True
                queue.append(q)
    stuck = [f"rank {r} stuck at event #{pos[r]} of {len(evs)}: {_fmt(evs[pos[r]])}"
             for r, evs in enumerate(events_by_rank) if pos[r] < len(evs)]
    if stuck:
        stuck.insert(0, f"deadlock under NCCL's in-order model: {len(stuck)} of {world} ranks cannot finish")
    return _capped(stuck, "stuck ranks")


def check(events_by_rank: Sequence[Sequence[Event]]) -> list[str]:
    """One line per problem found in every rank's events (see the module docstring); empty when consistent."""
    evs = [list(e) for e in events_by_rank]
    sends, recvs = _pairs(evs)
    return _check_groups(evs) + _check_collectives(evs) + _check_p2p(evs, sends, recvs) + \
        _simulate(evs, sends, recvs)


def summary(events_by_rank: Sequence[Sequence[Event]]) -> dict:
    """Per-rank counts and their max/mean: ``groups`` (communicators a rank's collectives use, the default group
    included), ``peers`` (distinct P2P peers), ``ops`` (collectives plus P2P operations, per recorded pass),
    ``collectives``, ``p2p_ops``, ``new_groups`` (groups created: every rank creates every group)."""
    world = len(events_by_rank)
    rows = {"groups": [], "peers": [], "ops": [], "collectives": [], "p2p_ops": [], "new_groups": []}
    everyone = tuple(range(world))
    for evs in events_by_rank:
        comms, peers, colls, p2p, made = {everyone}, set(), 0, 0, 0
        for e in evs:
            if e[0] == "coll":
                comms.add(tuple(e[2]))
                colls += 1
            elif e[0] == "p2p":
                p2p += len(e[1])
                peers.update(op[1] for op in e[1])
            elif e[0] == "new_group" and not _local(e):
                made += 1
        for key, v in (("groups", len(comms)), ("peers", len(peers)), ("ops", colls + p2p),
                       ("collectives", colls), ("p2p_ops", p2p), ("new_groups", made)):
            rows[key].append(v)
    return {k: {"max": max(v) if v else 0, "mean": sum(v) / len(v) if v else 0.0, "per_rank": v}
            for k, v in rows.items()}
