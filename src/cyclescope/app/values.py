"""Values over a profile: the hotlists of the selection with the modules that format them, and the
value column of a listing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cyclescope.errors import NotFoundError, UsageError

if TYPE_CHECKING:
    from cyclescope.app.profile import Profile
    from cyclescope.db.query import ProfileSet
    from cyclescope.db.values import ValueSelection
    from cyclescope.report.values import InvariantsReport
    from cyclescope.values.api import ValueModule


def open_values(p: Profile, uid: int | None = None, modules: list[str] | None = None
                ) -> tuple[ValueSelection, list[ValueModule]]:
    """The selection's value hotlists (of ``uid``'s processes only, if given) and the modules that
    format them: ``modules``, else those that captured them (the built-ins if one is gone)."""
    from cyclescope.values.modules import DEFAULT_MODULES, load_modules

    vs = p.values(uid)
    if not vs.files:
        hint = ""
        if vs.unreadable:
            hint = f" ({vs.unreadable} value file(s) of other users are not readable by you)"
        epochs = ",".join(map(str, p.profile_set.epochs))
        raise NotFoundError(f"no value samples in epoch(s) {epochs}{hint}; record with "
                            "--values to capture them")
    names = modules or list(vs.meta.modules if vs.meta else DEFAULT_MODULES)
    try:
        return vs, load_modules(names)
    except UsageError:
        return vs, load_modules(DEFAULT_MODULES)  # a module that is gone: format with the built-ins


def listing_values(p: Profile, image_key: str, start: int, end: int, kinds: list[str] | None = None
                   ) -> tuple[list[str], dict[int, list[str]], list[str]]:
    """`list --values`: the value columns of the instructions in [start, end) of an image, their
    cells per address, and notes on the selection's value files."""
    from cyclescope.report.values import Namer, selection_notes
    from cyclescope.report.values import listing_values as columns
    from cyclescope.values.modules import DEFAULT_MODULES, load_modules

    vs = p.values()
    if not vs.files:
        return [], {}, ["no value samples in this selection (record with --values)", *selection_notes(vs)]
    modules = load_modules(list(vs.meta.modules if vs.meta else DEFAULT_MODULES))
    namer = Namer(p.profile_set, p.sym, vs.hotlists.images)
    cols, cells = columns(vs.hotlists, modules, namer, image_key, start, end, kinds or None)
    return cols, cells, selection_notes(vs)


def image_filter(profile_set: ProfileSet, patterns: list[str]) -> set[str] | None:
    """The image keys matching ``patterns`` (None: no patterns, every image); NotFoundError when none."""
    from cyclescope.db.query import match_images

    if not patterns:
        return None
    keys = set(match_images(profile_set, patterns))
    if not keys:
        raise NotFoundError(f"no image matching {', '.join(patterns)} in the selection")
    return keys


def invariants_report(p: Profile, vs: ValueSelection, modules: list[ValueModule], image_patterns: list[str],
                      min_prob: float, min_vtot: int, min_share: float, limit: int) -> InvariantsReport:
    """`invariants`: instructions in procedures with at least ``min_share`` of the samples whose
    hotlists of at least ``min_vtot`` values have a top value of probability ``min_prob`` or more."""
    from dataclasses import replace

    import numpy as np

    from cyclescope.app.invariants import find_invariants
    from cyclescope.db.hotlist import HotlistSet
    from cyclescope.report.summary import summarize
    from cyclescope.report.values import InvariantsReport, Namer, selection_notes

    profile_set, sym = p.profile_set, p.sym
    named = vs.hotlists
    allowed = image_filter(profile_set, image_patterns)
    if allowed is not None:
        lists = named.lists
        keep = np.array([k in allowed for k in named.images], bool)[lists.keys["image"]]
        idx = np.flatnonzero(keep)
        remap = np.full(len(lists), -1, np.int64)
        remap[idx] = np.arange(len(idx))
        rows = remap[lists.hot] >= 0
        # A copy: the profile's hotlists stay whole for its other reports.
        named = replace(named, lists=HotlistSet(lists.keys[idx], lists.p[idx], lists.total[idx], remap[lists.hot[rows]],
                                                lists.values[rows], lists.counts[rows]))
    namer = Namer(profile_set, sym, named.images)
    items = find_invariants(named, modules, namer, profile_set, min_prob, min_vtot, min_share, limit)
    totals = {e: int(m.samples) for e, m in profile_set.events.items()}
    crit = (f"procedures with >= {100 * min_share:g}% of the samples, hotlists of >= {min_vtot} values, "
            f"top value >= {100 * min_prob:.0f}%")
    return InvariantsReport(items, vs.meta, summarize(profile_set, totals), crit, selection_notes(vs))
