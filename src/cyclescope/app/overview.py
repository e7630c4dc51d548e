"""What a database holds, at a glance: its epochs and hosts over time, and the selection's hottest
procedures and images with its lost and unknown shares (the web UI's first page)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cyclescope.app.profile import Profile
    from cyclescope.db.layout import Database
    from cyclescope.report.prof import ProfReport


@dataclass
class Period:
    """The samples of one segment: the finest grain of time the database keeps (a flush of the
    daemon, or a compacted run of them)."""

    epoch: int
    host: str
    start: float
    end: float
    samples: int


@dataclass
class EpochInfo:
    epoch: int
    name: str
    hosts: list[str]


@dataclass
class Overview:
    epochs: list[EpochInfo]
    timeline: list[Period]  # of the selection's epochs and hosts, in time order
    procedures: ProfReport
    images: ProfReport
    has_stacks: bool
    notes: list[str] = field(default_factory=list)

    def to_json(self, limit: int | None = None) -> dict[str, Any]:
        procs = self.procedures.to_json()
        if limit is not None:
            procs["not_shown"] = max(0, len(procs["rows"]) - limit)
            procs["rows"] = procs["rows"][:limit]
        return {
            "epochs": [vars(e) for e in self.epochs],
            "timeline": [vars(t) for t in self.timeline],
            "procedures": procs, "images": self.images.to_json(), "has_stacks": self.has_stacks,
            "notes": self.notes,
        }


def epochs_of(db: Database) -> list[EpochInfo]:
    """Every epoch of the database, oldest first, with its name (if given) and hosts."""
    out = []
    for e in db.epochs():
        name = db.epoch_info(e).get("name")
        out.append(EpochInfo(e, name if isinstance(name, str) else "", db.hosts(e)))
    return out


def overview(p: Profile) -> Overview:
    """The selection at a glance."""
    from cyclescope.app.prof import prof_report
    from cyclescope.db.stacks import stack_files

    tl = sorted((Period(s.epoch, s.host, s.meta.start_time, s.meta.end_time, s.meta.total_samples)
                 for s in p.profile_set.segments), key=lambda t: (t.start, t.epoch, t.host))
    profile_set = p.profile_set
    has = any(stack_files(p.db, e, h) for e in profile_set.epochs for h in (profile_set.hosts or []))
    return Overview(epochs_of(p.db), tl, prof_report(p), prof_report(p, by_image=True), has, list(profile_set.warnings))
