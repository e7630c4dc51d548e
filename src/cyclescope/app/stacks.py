"""Call stacks of a selection: named, exported in the formats other tools read, and folded into the
tree a flame graph draws (one-frame stacks of the flat profile where none were recorded)."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cyclescope.errors import NotFoundError

if TYPE_CHECKING:
    from cyclescope.app.profile import Profile
    from cyclescope.images.registry import ImageInfo
    from cyclescope.report.export import Frame, Stacks

FLAT_NOTE = ("no call stacks recorded in the selection (record with -g dwarf or -g fp); "
             "each instruction is a one-frame stack (the flat profile)")


@dataclass
class SelectedStacks:
    stacks: Stacks  # (event, frames leaf first) -> samples
    infos: dict[str, ImageInfo]  # every image a frame names
    flat: bool  # no stacks were recorded: one-frame stacks of the flat profile
    corrupt: list[str] = field(default_factory=list)

    @property
    def events(self) -> list[str]:
        return sorted({ev for ev, _ in self.stacks})


def select_stacks(p: Profile, image_patterns: list[str] | None = None, events: list[str] | None = None
                  ) -> SelectedStacks:
    """The selection's stacks (of stacks whose leaf is in an image matching ``image_patterns``, of
    ``events`` only); NotFoundError when the patterns or events match nothing."""
    from cyclescope.db.query import match_images, query_counts
    from cyclescope.images.registry import ImageInfo

    ps = p.ps
    images = set(match_images(ps, list(image_patterns))) if image_patterns else None
    if image_patterns and not images:
        raise NotFoundError(f"no image matching {', '.join(image_patterns)} in the selection")
    sel = p.stacks(images)
    infos = dict(ps.images)
    for k, d in sel.images.items():
        infos.setdefault(k, ImageInfo.from_json(d))
    stacks: Stacks = sel.counts
    flat = not stacks
    if flat:
        t = query_counts(ps, images=sorted(images) if images else None)
        stacks = Counter()
        for img, off, ev, c in zip(t.column("image").to_pylist(), t.column("offset").to_pylist(),
                                   t.column("event").to_pylist(), t.column("count").to_pylist(), strict=True):
            stacks[(ev, ((img, int(off)),))] += int(c)
    if events:
        stacks = Counter({k: n for k, n in stacks.items() if k[0] in events})
        if not stacks:
            raise NotFoundError(f"no samples of {', '.join(sorted(events))} in the selection")
    return SelectedStacks(stacks, infos, flat, list(sel.corrupt))


def frame_namer(p: Profile, infos: dict[str, ImageInfo], offsets: bool = False) -> Callable[[Frame], str]:
    """A frame's name: its procedure (``offsets``: procedure+offset), else image+offset; memoized."""
    import numpy as np

    sym = p.sym
    names: dict[Frame, str] = {}

    def name(f: Frame) -> str:
        n = names.get(f)
        if n is None:
            key, off = f
            info = infos.get(key)
            if info is None:
                n = "[unknown]"
            else:
                t = sym.table(info)
                i = int(t.lookup(np.array([off], np.uint64))[0]) if len(t) else -1
                base = os.path.basename(info.path) if info.path else key[:12]
                if i < 0:
                    n = f"{base}+{off:#x}"
                else:
                    s = int(t.starts[i])
                    n = t.names[i] + (f"+{off - s:#x}" if offsets and off != s else "")
            names[f] = n
        return n

    return name


def export_stacks(p: Profile, fmt: str, sel: SelectedStacks, offsets: bool = False,
                  warn: Callable[[str], None] | None = None) -> bytes:
    """The stacks as 'collapsed' (the first event's), 'speedscope' or 'pprof' (gzip) bytes."""
    from cyclescope.report.export import collapsed, named_stacks, speedscope

    name = frame_namer(p, sel.infos, offsets)
    events = sel.events
    if fmt == "pprof":
        return _pprof(p, sel, events, name, warn)
    if fmt == "collapsed":
        if len(events) > 1 and warn is not None:
            warn(f"collapsed stacks of {events[0]} (of {', '.join(events)})")
        return collapsed(named_stacks(sel.stacks, name, events[0] if len(events) > 1 else None)).encode()
    if fmt == "speedscope":
        per = {ev: named_stacks(sel.stacks, name, ev) for ev in events}
        title = f"cyclescope epoch {','.join(map(str, p.ps.epochs))}"
        return (json.dumps(speedscope(per, title), separators=(",", ":")) + "\n").encode()
    raise ValueError(f"unknown stack format {fmt}")


def _pprof(p: Profile, sel: SelectedStacks, events: list[str], name: Callable[[Frame], str],
           warn: Callable[[str], None] | None) -> bytes:
    """Function, source file and line per frame (DWARF where the binary has it), then the profile."""
    import numpy as np

    from cyclescope.images.dwarf import DwarfIndex, dwarf_source
    from cyclescope.report.export import pprof

    ps, sym, infos, stacks = p.ps, p.sym, sel.infos, sel.stacks
    frames = sorted({f for _, st in stacks for f in st})
    where: dict[Frame, tuple[str | None, int | None]] = {}
    by_image: dict[str, list[int]] = {}
    for key, off in frames:
        by_image.setdefault(key, []).append(off)
    for key, offs in by_image.items():
        info = infos.get(key)
        if info is None or info.kind != "elf":
            continue
        try:
            b = sym.binary(info)
            path = dwarf_source(b.path, info.key) if b.path else None
            if not path:
                continue
            pos = DwarfIndex(path, info.key).positions(np.array(offs, np.uint64))
        except Exception as e:  # a damaged or missing debug file: names without lines
            if warn is not None:
                warn(f"no source lines for {info.path}: {e}")
            continue
        for off, sp in zip(offs, pos, strict=True):
            if sp is not None:
                where[(key, off)] = (sp.file, sp.line)
    meta = {k: {"path": i.path, "build_id": i.build_id or "", "size": getattr(i, "size", 0)}
            for k, i in infos.items()}
    period = None
    if events and events[0] in ps.events and ps.events[events[0]].time_based:
        em = ps.events[events[0]]
        if em.samples:
            period = (events[0], int(em.period_sum / em.samples))
    time_ns = int(ps.start_time * 1e9)
    duration = int(max(0.0, ps.end_time - ps.start_time) * 1e9)
    return pprof(stacks, events, meta, lambda f: (name(f), *where.get(f, (None, None))), time_ns, duration,
                 period)


def flame_tree(p: Profile, sel: SelectedStacks, event: str) -> dict[str, Any]:
    """The stacks of ``event`` as the nested tree a flame graph draws: {name, value, children}, root
    first, frames of the same procedure under the same caller merged."""
    from cyclescope.report.export import named_stacks

    name = frame_namer(p, sel.infos)
    return fold(named_stacks(sel.stacks, name, event), "all")


def fold(named: Counter[tuple[str, ...]], root: str) -> dict[str, Any]:
    """Named stacks (root first) -> {name, value, children}: each node's value its samples with
    every callee's included."""
    top: dict[str, Any] = {"name": root, "value": 0, "children": {}}
    for frames, n in named.items():
        node = top
        node["value"] += n
        for f in frames:
            kids = node["children"]
            nxt = kids.get(f)
            if nxt is None:
                nxt = kids[f] = {"name": f, "value": 0, "children": {}}
            nxt["value"] += n
            node = nxt
    return _lists(top)


def _lists(node: dict[str, Any]) -> dict[str, Any]:
    """Children dicts -> lists, iteratively (stacks can be deeper than Python's recursion limit)."""
    todo = [node]
    while todo:
        n = todo.pop()
        kids = list(n["children"].values())
        n["children"] = kids
        todo.extend(kids)
    return node


def diff_tree(a: Counter[tuple[str, ...]], b: Counter[tuple[str, ...]], alpha: float = 0.05,
              min_change: float = 0.001) -> dict[str, Any]:
    """A differential flame graph: B's tree (named stacks root first), each node with ``a`` (its
    samples in A), ``share_a``/``share_b`` (of each set's total), and ``delta``, B's samples it gained
    over A's share, set only where `diff`'s test calls the change significant (two-proportion z-test,
    Benjamini-Hochberg at ``alpha``, and a move of at least ``min_change`` of the total); nodes only
    A has are kept with value 0 (the graph draws B)."""
    import numpy as np

    from cyclescope.report.compare import benjamini_hochberg, two_proportion_z

    na, nb = sum(a.values()), sum(b.values())
    top: dict[str, Any] = {"name": "all", "value": 0, "a": 0, "children": {}}
    for named, key in ((a, "a"), (b, "value")):
        for frames, n in named.items():
            node = top
            node[key] += n
            for f in frames:
                kids = node["children"]
                nxt = kids.get(f)
                if nxt is None:
                    nxt = kids[f] = {"name": f, "value": 0, "a": 0, "children": {}}
                nxt[key] += n
                node = nxt
    root = _lists(top)
    nodes: list[dict[str, Any]] = []
    todo: list[dict[str, Any]] = [root]
    while todo:
        nd = todo.pop()
        nodes.append(nd)
        todo.extend(nd["children"])
    ca = np.array([nd["a"] for nd in nodes], np.float64)
    cb = np.array([nd["value"] for nd in nodes], np.float64)
    if na and nb:
        _, p = two_proportion_z(ca, cb, na, nb)
        q = benjamini_hochberg(p)
    else:
        q = np.ones(len(nodes))
    sa = ca / na if na else np.zeros(len(nodes))
    sb = cb / nb if nb else np.zeros(len(nodes))
    sig = (q < alpha) & (np.abs(sb - sa) >= min_change)
    for i, nd in enumerate(nodes):
        nd["share_a"] = float(sa[i])
        nd["share_b"] = float(sb[i])
        nd["delta"] = round((sb[i] - sa[i]) * nb) if sig[i] else 0
        nd["q"] = float(q[i])
    root["totals"] = {"a": na, "b": nb}
    return root
