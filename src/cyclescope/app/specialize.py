"""`specialize`: the opportunities for value-based specialization, from calc's counts, the static
model and the value hotlists, under the optimizer's cost-benefit model (analysis/goal.py); and
the plan `record --goal` profiles (the candidates static elimination keeps)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from cyclescope.analysis.goal import PHI_SHARE, Candidate, GoalModel, select
from cyclescope.errors import NotFoundError
from cyclescope.report.specialize import Opportunity, ProcedureGoal, SpecializeReport
from cyclescope.values.goal import kind_of, share_se

if TYPE_CHECKING:
    from cyclescope.analysis.calc import Calc
    from cyclescope.app.profile import Profile
    from cyclescope.db.values import NamedHotlists
    from cyclescope.report.listing import Target

MIN_VALUES = 30  # values behind a probability before rule (1) is applied to it


def live_points(m: GoalModel, c: Candidate) -> tuple[str, list[tuple[int, str]], int, float]:
    """Where candidate ``c``'s value can be seen: the register(s) as the plan names them ("rdx", or
    "edx-ecx" for a difference as its cmp reads them), every (instruction, that name) where the
    value is live, the instruction a probe would go before (the one after the definition; for a
    difference, the cmp, or the procedure's entry when both registers are arguments: once a call,
    and on every path) and that instruction's executions."""
    if c.kind == "difference":
        name, same = m.difference_range(c.point)
        args = 0 in same and all(m.rd.defs(str(r), c.point) == {-1} for r in c.reg.split("-"))
        return name, [(k, name) for k in same], (0 if args else c.at), (m.entry_freq if args else c.freq)
    if c.kind == "load":  # both addresses: wherever their registers are those at the load
        return c.reg, [(k, c.reg) for k in m.load_range(c.pair, c.point)], c.at, c.freq
    live = m.available(c.point, c.reg) if c.kind in ("argument", "register") else c.observe
    return c.reg, live, c.at, c.freq


def probe_site(m: GoalModel, k: int, reg: str, live: list[tuple[int, str]]) -> tuple[int, bool]:
    """Where to probe a value that instruction ``k`` sees in ``reg``: the first instruction from
    ``k`` on in its block, up to the block's first call, that the kernel emulates at a hit (a
    conditional jump, a push: images/disasm.uprobe_emulated; 0.4 us a hit against 14 us
    single-stepped on the Xeons), as long as the register still holds the value there (``live``),
    else ``k``. Every instruction of a block before a call runs as often as the first."""
    from cyclescope.images.disasm import first_emulated

    held = set(live)
    insns, block_of = m.cfg.insns, m.cfg.block_of
    end = k
    while end < len(insns) and block_of[end] == block_of[k] and (end, reg) in held:
        end += 1
    j = first_emulated(insns[k:end])
    return (k + j, True) if j is not None else (k, False)


def goal_model(c: Calc) -> GoalModel:
    """The cost-benefit model of one procedure on calc's counts (executions per period) and the
    static model's latencies."""
    cfg = c.cfg
    lat: list[float] = [1.0] * len(cfg.insns)
    for b in cfg.blocks:
        for i, im in enumerate(c.model.blocks[b.id].insns):
            lat[b.first + i] = max(float(im.own), 0.0)
    freq = [float(c.freq.block[cfg.block_of[k]] or 0.0) for k in range(len(cfg.insns))]
    confidence = [c.freq.block_confidence[cfg.block_of[k]] for k in range(len(cfg.insns))]
    edges = [float(e or 0.0) for e in c.freq.edge]
    return GoalModel(cfg, c.infos, lat, freq, edges, confidence)


def procedure_goal(c: Calc, target: Target, phi: float, path: str, offsets: dict[int, int]
                   ) -> tuple[ProcedureGoal, GoalModel]:
    from cyclescope.analysis.calc import _loops

    m = goal_model(c)
    cands = m.candidates() + m.differences() + m.load_pairs() + m.trip_counts(_loops(c.cfg, c.infos))
    kept = select(cands, phi)
    return ProcedureGoal(target.name, target.info.key, path, target.info.build_id, target.start, len(c.cfg.insns),
                         sum(1 for i in c.infos if i.loads), cands, kept, [i.address for i in c.cfg.insns],
                         offsets), m


class _Hotlists:
    """The register hotlists (in:REG, out:REG) of one image by (ELF address, 64-bit register)."""

    def __init__(self, p: Profile, named: NamedHotlists, image_key: str) -> None:
        from cyclescope.values.goal import SAME, operands

        self.named = named
        self.at: dict[tuple[int, str, str], int] = {}
        lists = named.lists
        if image_key not in named.images or not len(lists):
            return
        info = p.images[image_key]
        mine = np.flatnonzero(lists.keys["image"] == named.images.index(image_key))
        addrs = p.sym.offsets_to_vaddr(info, lists.keys["offset"][mine].astype(np.uint64))
        for i, a in zip(mine.tolist(), addrs.tolist(), strict=True):
            kind = named.kinds[int(lists.keys["kind"][i])]
            io, _, reg = kind.partition(":")
            if io not in ("in", "out", "goal", "exact") or "@" in reg or (operands(reg) is None
                                                                           and not reg.startswith(SAME)):
                continue
            io = "in" if io == "goal" else io  # goal:REG: the value live at the instruction, as in:REG
            key = (int(a), kind_of(reg), io)
            if key not in self.at or lists.total[i] > lists.total[self.at[key]]:
                self.at[key] = i

    def top(self, found: list[int]) -> tuple[int, float, float, int]:
        """(top value, share, standard error, values seen) over the hotlists ``found``: the same
        value read at several instructions, merged (estimated counts added)."""
        lists = self.named.lists
        est: dict[int, float] = {}
        total = 0
        for i in found:
            rows = np.flatnonzero(lists.hot == i)
            p = float(lists.p[i]) or 1.0
            total += int(lists.total[i])
            for r in rows.tolist():
                v = int(lists.values[r]["v0"])
                est[v] = est.get(v, 0.0) + float(lists.counts[r]) / p
        if not est or not total:
            return 0, 0.0, 1.0, total
        value = max(est, key=est.__getitem__)
        share = min(1.0, est[value] / total)
        return value, share, share_se(share, total), total


def opportunities(p: Profile, goals: list[ProcedureGoal], models: dict[str, GoalModel], phi: float, total: float,
                  named: NamedHotlists | None, min_values: int = MIN_VALUES) -> tuple[list[Opportunity], int]:
    """Rule (1) on every kept candidate whose value was observed: the opportunities, most valuable
    first, and how many kept candidates had no values."""
    from cyclescope.images.dwarf import DwarfIndex, dwarf_source

    out: list[Opportunity] = []
    unobserved = 0
    hots: dict[str, _Hotlists | None] = {}
    dwarf: dict[str, DwarfIndex | None] = {}
    for g in goals:
        if g.image not in hots:  # once per image: several procedures of one binary share both
            hots[g.image] = _Hotlists(p, named, g.image) if named is not None else None
            src = dwarf_source(g.path, g.image)
            dwarf[g.image] = DwarfIndex(src, g.image) if src else None
        hot, dwarf_index = hots[g.image], dwarf[g.image]
        for c in g.kept:
            best, exact = None, []
            m = models.get(f"{g.image}:{g.start}")
            if hot is not None and (c.kind != "difference" or m is not None):
                sites = []
                if m is not None:
                    name, live, probe_at, _ = live_points(m, c)
                    if c.kind in ("argument", "register", "difference") and (probe_at, name) in live:
                        sites.append(probe_site(m, probe_at, name, live)[0])  # where write_plan put the probe
                else:
                    live, probe_at = c.observe, c.at
                sites.append(probe_at)  # a plan's from before probes went to emulated instructions
                # keys name registers as the hotlists do: 64-bit, a difference's as "rdx-rcx"
                keys = [(g.addresses[k], kind_of(r), "in") for k, r in live]
                if c.point >= 0 and c.kind == "register":
                    keys.append((g.addresses[c.point], c.reg, "out"))
                # Every execution of the point (a probe's) where there is one; else what samples saw.
                probed = [(g.addresses[k], c.reg, "exact") for k in sites if 0 <= k < len(g.addresses)]
                exact = [hot.at[k] for k in probed if k in hot.at][:1]
                found = exact or [hot.at[k] for k in keys if k in hot.at]
                if found:
                    best = hot.top(found)
            if best is None or best[3] < min_values:
                unobserved += 1
                continue
            value, prob, se, n = best
            net = c.net(prob, value)
            if net < phi:
                continue
            at = g.addresses[c.at] if 0 <= c.at < len(g.addresses) else g.start
            line = ""
            if dwarf_index is not None:
                pos = dwarf_index.positions(np.array([at], np.uint64))[0]
                line = f"{os.path.basename(pos.file)}:{pos.line}" if pos is not None else ""
            off = at - g.start
            out.append(Opportunity(g.name, at, g.name + (f"+{off:#x}" if off else ""), line, c.reg, c.kind, value,
                                   prob, se, n, c.benefit, net, net / total if total else 0.0, len(c.folded),
                                   bool(exact)))
    for dwarf_index in dwarf.values():
        if dwarf_index is not None:
            dwarf_index.close()
    # The same value saving the same instructions through a copy (mov ecx, edx): the first point
    # only (the lowest address: the definition, not the copy), whichever of the two the sampled
    # probabilities happen to favour.
    first: dict[tuple[str, int, int], Opportunity] = {}
    for o in sorted(out, key=lambda o: (o.address, o.kind != "argument", o.what)):
        first.setdefault((o.procedure, o.value, round(o.benefit)), o)
    out = sorted(first.values(), key=lambda o: -o.net)
    return out, unobserved


def specialize_targets(p: Profile, event: str, procedure: str | None, image_patterns: list[str], limit: int
                       ) -> list[Target]:
    """What `specialize` analyzes: ``procedure``, else the ``limit`` procedures of ELF images with
    most samples of ``event`` (0: all)."""
    from cyclescope.app.procedures import procedure_target, procedures_with_samples, resolve_target

    if procedure:
        return [resolve_target(p, procedure, image_patterns)[0]]
    rows = [r for r in procedures_with_samples(p, event)[0] if p.profile_set.images[r.image_key].kind == "elf"]
    if limit:
        rows = rows[:limit]
    targets = [t for r in rows if (t := procedure_target(p, r.image_key, r.procedure)) is not None]
    if not targets:
        raise NotFoundError("no procedure with samples to analyze")
    return targets


def specialize(p: Profile, targets: list[Target], event: str, mcpu: str | None = None,
               phi_share: float = PHI_SHARE, min_values: int = MIN_VALUES) -> SpecializeReport:
    """The selection's opportunities in ``targets`` (calc of each, the model, the hotlists)."""
    from cyclescope.app.calc import calc_target, period_cycles
    from cyclescope.errors import CycleScopeError

    total = float(p.event_totals().get(event, 0))
    phi = phi_share * total
    notes: list[str] = []
    goals = []
    models: dict[str, GoalModel] = {}
    for t in targets:
        try:
            c = calc_target(p, t, event, mcpu)
        except CycleScopeError as e:
            notes.append(f"{t.name}: {e}")
            continue
        b = p.sym.binary(t.info)
        addrs = np.array([i.address for i in c.cfg.insns], np.uint64)
        path = b.path or t.info.path
        offsets = dict(zip(addrs.tolist(), _vaddr_to_offsets(p, t, path, addrs).tolist(), strict=True))
        g, m = procedure_goal(c, t, phi, path, offsets)
        goals.append(g)
        models[f"{g.image}:{g.start}"] = m
    vs = p.values()
    named = vs.hotlists if vs.files else None
    if named is None:
        notes.append("no value samples in this selection: record with --values (or --goal PLAN) to see which "
                     "kept candidates pay")
    opps, unobserved = opportunities(p, goals, models, phi, total, named, min_values)
    clock = p.profile_set.clock_ghz
    rate_scale = clock * 1e9 / total if clock and total else None
    return SpecializeReport(opps, goals, unobserved, phi, total, period_cycles(p, event), notes, models, rate_scale)


def _vaddr_to_offsets(p: Profile, t: Target, path: str, addrs: np.ndarray) -> np.ndarray:
    """ELF addresses to the image's offsets as samples key them: the same, unless the image was
    recorded with file offsets (its ELF unreadable then)."""
    from cyclescope.images.elf import read_load_info

    if t.info.offsets != "file" or not len(addrs):
        return addrs
    elf = read_load_info(path)
    return np.array([elf.file_offset(int(a)) or int(a) for a in addrs.tolist()], np.uint64)


# --- the plan `record --goal` follows ---------------------------------------------------------


def write_plan(report: SpecializeReport, path: str | Path) -> int:
    """The kept candidates and every instruction where each one's value is live, as a JSON plan for
    `record --goal` (values/goal.py reads it), with rule (3)'s probability for dynamic elimination.
    A difference's two registers are taken together, as its ``cmp`` reads them ("edi-esi").
    Returns the number of candidates in the plan."""
    from cyclescope.errors import CycleScopeError
    from cyclescope.images.elf import ElfInfo, read_load_info
    from cyclescope.values.goal import PLAN_VERSION

    points = []
    elves: dict[str, ElfInfo | None] = {}
    for g in report.procedures:
        m = report.models.get(f"{g.image}:{g.start}")
        for c in g.kept:
            if m is None:
                continue
            probe_reg, at, probe_at, rate = live_points(m, c)
            if not at:
                continue
            point: dict[str, object] = {
                "image": g.image, "procedure": g.name, "what": c.reg, "kind": c.kind,
                "min_prob": round(min(c.min_prob(report.phi), 2.0), 6),
                "at": [[g.offsets.get(g.addresses[k], g.addresses[k]), r] for k, r in at]}
            if c.kind == "load":  # the two addresses, formed from the registers where a sample lands
                mems = [m.infos[c.pair].mem, m.infos[c.point].mem]
                point["mems"] = [[x.base, x.index, x.scale, x.disp, x.size] for x in mems if x is not None]
            # The probe site: the instruction just after the definition (an argument: the entry),
            # where every execution of the point shows its value, if the value is live there; or
            # further on in its block, while the value stays, where the kernel emulates the hit.
            if c.kind in ("argument", "register", "difference") and (probe_at, probe_reg) in at:
                probe_at, emulated = probe_site(m, probe_at, probe_reg, at)
                if g.path not in elves:
                    try:
                        elves[g.path] = read_load_info(g.path)
                    except (OSError, CycleScopeError):
                        elves[g.path] = None
                elf = elves[g.path]
                vaddr = g.addresses[probe_at]
                file_offset = elf.file_offset(vaddr) if elf is not None else None
                if file_offset is not None:
                    point["probe"] = {"at": g.offsets.get(vaddr, vaddr), "reg": probe_reg, "path": g.path,
                                      "file_offset": file_offset, "build_id": g.build_id,
                                      "rate": round(rate * (report.rate_scale or 0.0), 3),
                                      "rate_confidence": m.confidence[probe_at], "emulated": emulated}
            points.append(point)
    doc = {"version": PLAN_VERSION, "counts": report.counts, "points": points}
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)
    return len(points)
