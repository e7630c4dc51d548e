"""Where the cycles went, per procedure or per image."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cyclescope.app.profile import Profile
    from cyclescope.images.registry import ImageInfo
    from cyclescope.report.prof import ProfReport, StackProfReport


def prof_report(p: Profile, by_image: bool = False) -> ProfReport:
    """DCPI's dcpiprof: samples per procedure (or per image), hottest first, with the selection's
    summary and the images whose symbols could not be read."""
    from cyclescope.db.query import query_counts
    from cyclescope.report.prof import build_prof, counts_by_image
    from cyclescope.report.summary import summarize

    profile_set, sym = p.profile_set, p.sym
    counts = query_counts(profile_set)
    per_image = counts_by_image(counts)
    report = build_prof(profile_set.event_names, per_image, profile_set.images, sym.table, sym.offsets_to_vaddr,
                        by_image=by_image)
    report.summary = summarize(profile_set, dict(zip(report.events, report.totals, strict=True)))
    report.problems = {k: v for k, v in sym.problems.items()}
    return report


def stack_prof_report(p: Profile, lines: bool = False, by_self: bool = False) -> StackProfReport:
    """Samples per function from the selection's call stacks: in it or in what it called (total),
    and in it alone (self), hottest first (by total, or ``by_self``); Python frames (``py::``) by
    line with ``lines``. Where no stacks were recorded, each sample is a one-frame stack (total =
    self)."""
    from cyclescope.app.stacks import frame_namer, select_stacks
    from cyclescope.report.prof import build_stack_prof
    from cyclescope.report.summary import summarize

    sel = select_stacks(p)
    name = frame_namer(p, sel.infos, python_lines=lines)
    events = list(p.profile_set.event_names)
    report = build_stack_prof(events, sel.stacks, name, lambda key: _image_label(sel.infos, key), by_self)
    report.flat = sel.flat
    report.summary = summarize(p.profile_set, dict(zip(report.events, report.totals, strict=True)))
    report.problems = dict(p.sym.problems)
    if sel.corrupt:
        report.problems["stacks"] = f"unreadable stack files left out: {', '.join(sel.corrupt)}"
    return report


def _image_label(infos: dict[str, ImageInfo], key: str) -> str:
    info = infos.get(key)
    return info.path if info is not None and info.path else key[:12]
