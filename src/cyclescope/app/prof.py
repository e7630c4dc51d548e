"""Where the cycles went, per procedure or per image."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cyclescope.app.profile import Profile
    from cyclescope.report.prof import ProfReport


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
