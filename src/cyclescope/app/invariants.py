"""Semi-invariant candidates (`invariants`): the hotlists whose top value is frequent enough in
procedures that hold enough of the samples, ranked by the samples the value could save.

A computation over the profile, not a report (issue 25): it lives above report because it ranks
the rows report.values.hot_rows names and formats through the value modules, and decodes with
values.insn, which analysis (a sibling of values) may not import."""

from __future__ import annotations

import os

import numpy as np

from cyclescope.db.hotlist import PER_CALL_SITE
from cyclescope.db.query import ProfileSet, query_counts
from cyclescope.db.values import NamedHotlists
from cyclescope.images.registry import ImageInfo
from cyclescope.report.values import NOT_INVARIANT_KINDS, HotRow, HotValue, Invariant, Namer, hot_rows
from cyclescope.values.api import ValueModule
from cyclescope.values.insn import REG_VIEWS, InsnDetail, decode


def _slice_samples(insns: list[InsnDetail], counts: dict[int, int], at: int, regs: set[str],
                   include_self: bool) -> int:
    """Samples on the instructions that depend, through registers, on ``regs`` as they are at ``at``.

    A forward slice over the procedure in address order, from ``at`` to the end and around once
    more (loops), ignoring memory: an upper-bound guide to what constant-folding the value could
    touch, not an exact dataflow analysis.
    """
    pos = {d.address: i for i, d in enumerate(insns)}
    i0 = pos.get(at)
    if i0 is None:
        return counts.get(at, 0)
    tainted = set(regs)
    hit: set[int] = set()
    n = len(insns)
    for step in range(2 * n):
        d = insns[(i0 + step) % n]
        uses = {r.full for r in d.reads}
        if (step == 0 and include_self) or (uses & tainted):
            hit.add(d.address)
            tainted |= {r.full for r in d.writes}
        elif step > 0:
            tainted -= {r.full for r in d.writes}
        if not tainted:
            break
    return sum(counts.get(a, 0) for a in hit)


def ctx_shares(named: NamedHotlists, image_key: str, entry: int) -> dict[tuple[int, int], float]:
    """P(call site) from the ctx hotlist at a procedure's entry: {(image index, offset): share}."""
    lists = named.lists
    if "ctx" not in named.kinds or image_key not in named.images or not len(lists):
        return {}
    k = lists.keys
    hit = np.flatnonzero((k["image"] == named.images.index(image_key)) & (k["offset"] == entry)
                         & (k["kind"] == named.kinds.index("ctx")))
    if not len(hit):
        return {}
    i = int(hit[0])
    rows = np.flatnonzero(lists.hot == i)
    total = float(lists.total[i]) or 1.0
    values = lists.values
    return {(int(values[r]["vimg"]), int(values[r]["v0"])): float(lists.counts[r]) / float(lists.p[i]) / total
            for r in rows.tolist()}


def find_invariants(named: NamedHotlists, modules: list[ValueModule], namer: Namer, profile_set: ProfileSet,
                    min_prob: float, min_vtot: int, min_proc_share: float, limit: int) -> list[Invariant]:
    from cyclescope.images.dwarf import DwarfIndex, dwarf_source

    lists = named.lists
    if not len(lists):
        return []
    per, grand = _flat_counts(profile_set)
    if not grand:
        return []
    kinds = named.kinds
    cand = np.array([not k.startswith(NOT_INVARIANT_KINDS) for k in kinds], bool)[lists.keys["kind"]]
    cand &= lists.total >= min_vtot
    rows = hot_rows(named, modules, namer, 16, cand)
    proc_cache: dict[tuple[str, int], tuple[float, list[InsnDetail], dict[int, int]]] = {}
    dwarf: dict[str, DwarfIndex | None] = {}
    out: list[Invariant] = []
    for r in rows:
        info = namer.info(r.image)
        if info is None or not r.values:
            continue
        table = namer.sym.table(info)
        i = int(table.lookup(np.array([r.offset], np.uint64))[0]) if len(table) else -1
        if i < 0:
            continue
        start, end = int(table.starts[i]), int(table.ends[i])
        pk = (r.image, start)
        if pk not in proc_cache:
            counts = per.get(r.image, {})
            pcounts = {o: c for o, c in counts.items() if start <= o < end}
            proc_cache[pk] = (sum(pcounts.values()) / grand, _procedure_code(namer, info, start, end), pcounts)
        share, insns, pcounts = proc_cache[pk]
        if share < min_proc_share:
            continue
        me = next((d for d in insns if d.address == r.offset), None)
        if me is not None and me.mem is None and not me.reads and r.kind.startswith("out:"):
            continue  # an immediate move: constant by construction, nothing to learn
        for site, vs, _n, site_share in _groups(named, namer, r, start, min_vtot):
            top = vs[0]
            if top.share < min_prob:
                continue
            base = r.kind.split(":", 1)[-1].split("@", 1)[0]
            view = REG_VIEWS.get(base)
            regs = {view.full} if view is not None else set()
            if (r.kind.startswith(("load", "out:")) or r.kind == "addr") and me is not None:
                regs = {w.full for w in me.writes}
            save = site_share * top.share * _slice_samples(insns, pcounts, r.offset, regs, True) / grand
            src = ""
            if r.image not in dwarf:
                b = namer.sym.binary(info)
                path = dwarf_source(b.path, info.key) if b.path else None
                dwarf[r.image] = DwarfIndex(path, info.key) if path else None
            dwarf_index = dwarf[r.image]
            if dwarf_index is not None:
                pos = dwarf_index.positions(np.array([r.offset], np.uint64))[0]
                if pos is not None:
                    src = f"{os.path.basename(pos.file)}:{pos.line}"
            here = namer.insn(r.image, r.offset)
            out.append(Invariant(r.image, r.offset, namer.where(r.image, r.offset), here.text if here else "", r.kind,
                                 top.text, top.share, max(0.0, top.share - 2 * top.se), r.vtot, share, save, src,
                                 site))
    for dwarf_index in dwarf.values():
        if dwarf_index is not None:
            dwarf_index.close()
    return _pruned(out, limit)


def _flat_counts(profile_set: ProfileSet) -> tuple[dict[str, dict[int, int]], int]:
    """Flat samples of the first event per image and offset, and their total."""
    t = query_counts(profile_set)
    events = profile_set.event_names
    ev0 = events[0] if events else None
    per: dict[str, dict[int, int]] = {}
    grand = 0
    for img, off, ev, c in zip(t.column("image").to_pylist(), t.column("offset").to_pylist(),
                               t.column("event").to_pylist(), t.column("count").to_pylist(), strict=True):
        if ev != ev0:
            continue
        grand += int(c)
        d = per.setdefault(img, {})
        d[int(off)] = d.get(int(off), 0) + int(c)
    return per, grand


def _procedure_code(namer: Namer, info: ImageInfo, start: int, end: int) -> list[InsnDetail]:
    """The procedure's instructions, decoded (none where its code cannot be read, or it is over
    256 KiB)."""
    from cyclescope.images.disasm import read_code

    insns: list[InsnDetail] = []
    b = namer.sym.binary(info)
    if not b.path or end - start > 1 << 18:
        return insns
    try:
        code = read_code(b.path, start, end)
    except Exception:
        return insns
    a = start
    while a < end and code:
        ins = decode(code[a - start : a - start + 16], a)
        if ins is None:
            break
        insns.append(ins)
        a += ins.size
    return insns


def _groups(named: NamedHotlists, namer: Namer, r: HotRow, start: int, min_vtot: int
            ) -> list[tuple[str, list[HotValue], float, float]]:
    """A hotlist's top values as (call site, top, values, the site's share): one group for all
    sites, or, for a per-call-site kind, one per site: P(value | site) = est(value, site) / (vtot x
    P(site)), P(site) from the procedure's ctx hotlist (the pairs kept in this hotlist alone would
    overstate it)."""
    if not r.kind.endswith(PER_CALL_SITE):
        return [("", r.values[:1], float(r.vtot), 1.0)]
    groups: list[tuple[str, list[HotValue], float, float]] = []
    site_p = ctx_shares(named, r.image, start)
    by_site: dict[tuple[int, int], list[HotValue]] = {}
    for v in r.values:
        by_site.setdefault((v.value.image, v.value.v1), []).append(v)
    for (simg, soff), vs in by_site.items():
        p_site = site_p.get((simg, soff))
        site_total = r.vtot * p_site if p_site else sum(v.count for v in vs)
        if site_total < min_vtot / 2:
            continue
        top = max(vs, key=lambda v: v.count)
        prob = min(1.0, top.count / site_total)
        se = top.se * (r.vtot / site_total) if site_total else 1.0
        groups.append((namer.by_index(simg, soff), [HotValue(top.text.split(" from ")[0], prob, top.count,
                                                             top.value, se)], site_total,
                       site_total / r.vtot if r.vtot else 0.0))
    return groups


def _pruned(out: list[Invariant], limit: int) -> list[Invariant]:
    """Most saving first, without repeats: a call-site row that says no more than the row for all
    sites (one caller) is dropped, and of the same instruction and value through several kinds (rdi
    in, and per call site) the best is kept."""
    overall = {(x.image, x.offset, x.kind.split("@")[0], x.value): x.prob for x in out if not x.call_site}
    out = [x for x in out if not x.call_site
           or x.prob_low > overall.get((x.image, x.offset, x.kind.split("@")[0], x.value), 0.0)]
    out.sort(key=lambda x: (-x.save, -x.prob))
    seen: set[tuple[str, int, str, str]] = set()
    uniq = []
    for x in out:
        k = (x.image, x.offset, x.value, x.call_site)
        if k in seen:
            continue
        seen.add(k)
        uniq.append(x)
    return uniq[:limit] if limit else uniq
