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
    import numpy as np

    from cyclescope.app.profile import Profile
    from cyclescope.db.stacks import StackArrays
    from cyclescope.images.registry import ImageInfo
    from cyclescope.report.export import Frame, Stacks
    from cyclescope.report.flame import Trie

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

    profile_set = p.profile_set
    images = set(match_images(profile_set, list(image_patterns))) if image_patterns else None
    if image_patterns and not images:
        raise NotFoundError(f"no image matching {', '.join(image_patterns)} in the selection")
    sel = p.stacks(images)
    infos = dict(profile_set.images)
    for k, d in sel.images.items():
        infos.setdefault(k, ImageInfo.from_json(d))
    stacks: Stacks = sel.counts
    flat = not stacks
    if flat:
        t = query_counts(profile_set, images=sorted(images) if images else None)
        stacks = Counter()
        for img, off, ev, c in zip(t.column("image").to_pylist(), t.column("offset").to_pylist(),
                                   t.column("event").to_pylist(), t.column("count").to_pylist(), strict=True):
            stacks[(ev, ((img, int(off)),))] += int(c)
    if events:
        stacks = Counter({k: n for k, n in stacks.items() if k[0] in events})
        if not stacks:
            raise NotFoundError(f"no samples of {', '.join(sorted(events))} in the selection")
    return SelectedStacks(stacks, infos, flat, list(sel.corrupt))


def frame_namer(p: Profile, infos: dict[str, ImageInfo], offsets: bool = False,
                python_lines: bool = False) -> Callable[[Frame], str]:
    """A frame's name: its procedure (``offsets``: procedure+offset; a Python function's line with
    ``offsets`` or ``python_lines``), else image+offset; memoized."""
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
                    if info.kind == "python":  # the offset in a Python function's symbol is its line
                        n = t.names[i] + (f":{off - s}" if offsets or python_lines else "")
                    else:
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
        title = f"cyclescope epoch {','.join(map(str, p.profile_set.epochs))}"
        return (json.dumps(speedscope(per, title), separators=(",", ":")) + "\n").encode()
    raise ValueError(f"unknown stack format {fmt}")


def _pprof(p: Profile, sel: SelectedStacks, events: list[str], name: Callable[[Frame], str],
           warn: Callable[[str], None] | None) -> bytes:
    """Function, source file and line per frame (DWARF where the binary has it), then the profile."""
    import numpy as np

    from cyclescope.images.dwarf import DwarfIndex, dwarf_source
    from cyclescope.report.export import pprof

    profile_set, sym, infos, stacks = p.profile_set, p.sym, sel.infos, sel.stacks
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
    if events and events[0] in profile_set.events and profile_set.events[events[0]].time_based:
        em = profile_set.events[events[0]]
        if em.samples:
            period = (events[0], int(em.period_sum / em.samples))
    time_ns = int(profile_set.start_time * 1e9)
    duration = int(max(0.0, profile_set.end_time - profile_set.start_time) * 1e9)
    return pprof(stacks, events, meta, lambda f: (name(f), *where.get(f, (None, None))), time_ns, duration,
                 period)


MAX_FLAME_NODES = 20_000  # a flame graph's frames: past it the narrowest go (see flame_json)


@dataclass
class SelectedArrays:
    """A selection's stacks as columns (db.stacks.StackArrays) with the images their frames name."""

    arrays: StackArrays
    infos: dict[str, ImageInfo]
    flat: bool  # no stacks were recorded: one-frame stacks of the flat profile
    corrupt: list[str] = field(default_factory=list)

    @property
    def events(self) -> list[str]:
        import numpy as np

        return sorted(self.arrays.events[int(i)] for i in np.unique(self.arrays.event))


def select_stack_arrays(p: Profile, image_patterns: list[str] | None = None, events: list[str] | None = None
                        ) -> SelectedArrays:
    """select_stacks's selection as columns, for the flame graphs: no Python object per frame."""
    import numpy as np

    from cyclescope.db.query import match_images, query_counts
    from cyclescope.db.stacks import StackArrays
    from cyclescope.images.registry import ImageInfo

    profile_set = p.profile_set
    images = set(match_images(profile_set, list(image_patterns))) if image_patterns else None
    if image_patterns and not images:
        raise NotFoundError(f"no image matching {', '.join(image_patterns)} in the selection")
    arr = p.stack_arrays(images)
    infos = dict(profile_set.images)
    for k, d in arr.images.items():
        infos.setdefault(k, ImageInfo.from_json(d))
    flat = not len(arr)
    if flat:
        t = query_counts(profile_set, images=sorted(images) if images else None)
        keys = sorted(set(t.column("image").to_pylist()))
        evs = sorted(set(t.column("event").to_pylist()))
        kx, ex = {k: i for i, k in enumerate(keys)}, {e: i for i, e in enumerate(evs)}
        img = np.array([kx[k] for k in t.column("image").to_pylist()], np.int32)
        ev = np.array([ex[e] for e in t.column("event").to_pylist()], np.int32)
        corrupt = arr.corrupt
        arr = StackArrays.build(evs, ev, t.column("count").to_numpy().astype(np.float64),
                                np.ones(len(img), np.int64), keys, img, t.column("offset").to_numpy())
        arr.corrupt = corrupt
    if events:
        want = [i for i, e in enumerate(arr.events) if e in events]
        if not np.isin(arr.event, want).any():
            raise NotFoundError(f"no samples of {', '.join(sorted(events))} in the selection")
    return SelectedArrays(arr, infos, flat, list(arr.corrupt))


def name_frames(p: Profile, infos: dict[str, ImageInfo], arr: StackArrays,
                python_lines: bool = False) -> tuple[list[str], np.ndarray]:
    """Every frame's name as frame_namer gives it (its procedure, else image+offset; a Python
    function's line with ``python_lines``), as an index into a list of names: each image's offsets
    looked up at once."""
    import numpy as np

    names: list[str] = []
    index: dict[str, int] = {}
    out = np.zeros(len(arr.image), np.int64)

    def intern(n: str) -> int:
        i = index.get(n)
        if i is None:
            i = index[n] = len(names)
            names.append(n)
        return i

    order = np.argsort(arr.image, kind="stable")
    codes, firsts = np.unique(arr.image[order], return_index=True)
    for code, lo, hi in zip(codes.tolist(), firsts.tolist(), [*firsts[1:].tolist(), len(order)], strict=True):
        where = order[lo:hi]
        offs, inv = np.unique(arr.offset[where], return_inverse=True)
        info = infos.get(arr.keys[code])
        if info is None:
            out[where] = intern("[unknown]")
            continue
        t = p.sym.table(info)
        sym = t.lookup(offs) if len(t) else np.full(len(offs), -1, np.int64)
        base = os.path.basename(info.path) if info.path else arr.keys[code][:12]
        ids = np.empty(len(offs), np.int64)
        found = sym >= 0
        if found.any() and python_lines and info.kind == "python":  # the offset in its symbol is the line
            lines = (offs[found] - t.starts[sym[found]]).astype(np.int64)
            pairs, back = np.unique(np.stack([sym[found].astype(np.int64), lines]), axis=1, return_inverse=True)
            ids[found] = np.array([intern(f"{t.names[int(i)]}:{int(ln)}") for i, ln in pairs.T.tolist()],
                                  np.int64)[back.reshape(-1)]
        elif found.any():
            u, back = np.unique(sym[found], return_inverse=True)
            ids[found] = np.array([intern(t.names[int(i)]) for i in u.tolist()], np.int64)[back]
        for j in np.nonzero(~found)[0].tolist():
            ids[j] = intern(f"{base}+{int(offs[j]):#x}")
        out[where] = ids[inv]
    return names, out


def flame_tree(p: Profile, sel: SelectedArrays, event: str, focus: str | None = None,
               max_nodes: int = MAX_FLAME_NODES, python_lines: bool = False) -> dict[str, Any]:
    """The stacks of ``event`` as the nested tree a flame graph draws: {name, value, children}, root
    first, frames of the same procedure under the same caller merged (Python functions' frames of
    one line with ``python_lines``); with ``focus``, only the stacks that pass through a frame of
    that name (its callers and callees at full resolution); at most ``max_nodes`` frames, the
    narrowest left out (``pruned`` at the root says how many)."""
    import numpy as np

    from cyclescope.db.stacks import select_rows
    from cyclescope.report.flame import fold_arrays

    arr = sel.arrays
    names, frame_name = name_frames(p, sel.infos, arr, python_lines)
    rows = arr.rows_of(event)
    if focus:
        fid = names.index(focus) if focus in names else -1
        row_of = np.repeat(np.arange(len(arr)), np.diff(arr.splits))
        rows = np.intersect1d(rows, row_of[frame_name == fid])
    splits, frames = select_rows(arr.splits, rows)
    trie = fold_arrays(splits, frame_name[frames], arr.count[rows])
    return flame_json(trie, names, max_nodes)


def flame_json(trie: Trie, names: list[str], max_nodes: int = MAX_FLAME_NODES) -> dict[str, Any]:
    """A trie of one side as a flame graph's tree, pruned to ``max_nodes`` frames as Pyroscope and
    Grafana cap theirs: a browser lays out and searches a few ten thousand frames in milliseconds,
    not the millions of 100,000 deep, distinct stacks, and at 1,280 pixels the frames left out are
    far narrower than a pixel. A caller keeps its full width, so what was left out shows as its self
    time."""
    import numpy as np

    from cyclescope.report.flame import keep_widest, pruned_stats, to_json

    size = trie.value[:, 0]
    keep = keep_widest(size, max_nodes)
    out = to_json(trie, names, keep, {"value": np.rint(size).astype(np.int64)})
    out["pruned"] = pruned_stats(size, keep)
    return out


def named_arrays(sides: list[Counter[tuple[str, ...]]]) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """Named stacks (root first) of one or more sides as (names, splits, frame names leaf first,
    weights: a row per stack, a column per side)."""
    import numpy as np

    index: dict[str, int] = {}
    lengths: list[int] = []
    frames: list[int] = []
    weights: list[list[float]] = []
    for k, named in enumerate(sides):
        for stack, n in named.items():
            lengths.append(len(stack))
            frames.extend(index.setdefault(f, len(index)) for f in reversed(stack))
            w = [0.0] * len(sides)
            w[k] = float(n)
            weights.append(w)
    names = list(index)
    splits = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(np.array(lengths, np.int64), out=splits[1:])
    return names, splits, np.array(frames, np.int64), np.array(weights, np.float64).reshape(-1, len(sides))


def fold(named: Counter[tuple[str, ...]], root: str) -> dict[str, Any]:
    """Named stacks (root first) -> {name, value, children}: each node's value its samples with
    every callee's included (every frame kept)."""
    import numpy as np

    from cyclescope.report.flame import fold_arrays, to_json

    names, splits, frames, weights = named_arrays([named])
    trie = fold_arrays(splits, frames, weights)
    return to_json(trie, names, np.ones(len(trie), bool), {"value": np.rint(trie.value[:, 0]).astype(np.int64)},
                   root)


def diff_tree(a: Counter[tuple[str, ...]], b: Counter[tuple[str, ...]], alpha: float = 0.05,
              min_change: float = 0.001, max_nodes: int = MAX_FLAME_NODES) -> dict[str, Any]:
    """diff_json over named stacks (root first) of A and B."""
    from cyclescope.report.flame import fold_arrays

    names, splits, frames, weights = named_arrays([a, b])
    return diff_json(fold_arrays(splits, frames, weights), names, alpha, min_change, max_nodes)


def diff_flame_tree(sides: list[tuple[Profile, SelectedArrays]], event: str, alpha: float = 0.05,
                    min_change: float = 0.001, max_nodes: int = MAX_FLAME_NODES) -> dict[str, Any]:
    """diff_json over the stacks of ``event`` in two selections (A, B)."""
    import numpy as np

    from cyclescope.db.stacks import select_rows
    from cyclescope.report.flame import fold_arrays

    index: dict[str, int] = {}
    splits_all: list[np.ndarray] = [np.zeros(1, np.int64)]
    frames_all: list[np.ndarray] = []
    weights_all: list[np.ndarray] = []
    offset = 0
    for k, (p, sel) in enumerate(sides):
        arr = sel.arrays
        own, frame_name = name_frames(p, sel.infos, arr)
        to_all = np.array([index.setdefault(n, len(index)) for n in own] or [0], np.int64)
        rows = arr.rows_of(event)
        splits, frames = select_rows(arr.splits, rows)
        splits_all.append(splits[1:] + offset)
        offset += len(frames)
        frames_all.append(to_all[frame_name[frames]])
        w = np.zeros((len(rows), len(sides)))
        w[:, k] = arr.count[rows]
        weights_all.append(w)
    names = list(index)
    trie = fold_arrays(np.concatenate(splits_all), np.concatenate(frames_all), np.concatenate(weights_all))
    return diff_json(trie, names, alpha, min_change, max_nodes)


def diff_json(trie: Trie, names: list[str], alpha: float = 0.05, min_change: float = 0.001,
              max_nodes: int = MAX_FLAME_NODES) -> dict[str, Any]:
    """A differential flame graph from a trie of two sides (A, B): B's tree, each node with ``a``
    (its samples in A), ``share_a``/``share_b`` (of each set's total), and ``delta``, B's samples it
    gained over A's share, set only where `diff`'s test calls the change significant (two-proportion
    z-test, Benjamini-Hochberg at ``alpha``, and a move of at least ``min_change`` of the total);
    nodes only A has are kept with value 0 (the graph draws B). The test sees every frame; the tree
    drawn is pruned to ``max_nodes`` (flame_json), by the wider of a frame's two sides."""
    import numpy as np

    from cyclescope.report.compare import benjamini_hochberg, two_proportion_z
    from cyclescope.report.flame import keep_widest, pruned_stats, to_json

    ca, cb = trie.value[:, 0], trie.value[:, 1]
    na, nb = round(float(ca[0])), round(float(cb[0]))
    if na and nb:
        _, p = two_proportion_z(ca, cb, na, nb)
        q = benjamini_hochberg(p)
    else:
        q = np.ones(len(trie))
    sa = ca / na if na else np.zeros(len(trie))
    sb = cb / nb if nb else np.zeros(len(trie))
    sig = (q < alpha) & (np.abs(sb - sa) >= min_change)
    size = np.maximum(ca, cb)
    keep = keep_widest(size, max_nodes)
    root = to_json(trie, names, keep, {
        "value": np.rint(cb).astype(np.int64), "a": np.rint(ca).astype(np.int64), "share_a": sa, "share_b": sb,
        "delta": np.where(sig, np.rint((sb - sa) * nb), 0).astype(np.int64), "q": q})
    root["totals"] = {"a": na, "b": nb}
    root["pruned"] = pruned_stats(size, keep)
    return root
