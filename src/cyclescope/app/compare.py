"""The sample sets `stats` and `diff` compare: counts per procedure, image or instruction."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from cyclescope.errors import NotFoundError

if TYPE_CHECKING:
    from cyclescope.app.profile import Profile
    from cyclescope.db.layout import Database
    from cyclescope.db.query import Selection
    from cyclescope.report.compare import Key


def set_counts(p: Profile, event: str | None, by_image: bool) -> tuple[str, dict[Key, int]]:
    """One set's samples of ``event`` (default: its first) per procedure or image."""
    from cyclescope.app.prof import prof_report

    profile_set = p.profile_set
    if not profile_set.segments:
        return event or "", {}
    ev = event or profile_set.event_names[0]
    if ev not in profile_set.events:
        raise NotFoundError(f"no samples of event {ev} in {','.join(map(str, profile_set.epochs))}; "
                            f"recorded: {', '.join(profile_set.events)}")
    report = prof_report(p.with_event(ev), by_image)
    i = report.events.index(ev)
    return ev, {(r.procedure, r.image): r.counts[i] for r in report.rows if r.counts[i]}


def insn_counts(p: Profile, proc: str, event: str | None, images: list[str]) -> tuple[str, dict[Key, int]]:
    """One set's samples of ``event`` (default: the first) per instruction of the procedure ``proc``."""
    from cyclescope.app.procedures import make_listing, resolve_target

    target, _ = resolve_target(p, proc, images)
    profile_set = p.profile_set
    if not profile_set.event_names:
        raise NotFoundError("no samples in the selection")
    ev = event or profile_set.event_names[0]
    if ev not in profile_set.events:
        raise NotFoundError(f"no samples of event {ev} in {','.join(map(str, profile_set.epochs))}; "
                            f"recorded: {', '.join(profile_set.events)}")
    lst = make_listing(p.with_event(ev), target, [], False, [])
    i = lst.events.index(ev)
    key_img = f"{target.info.path} ({(target.info.build_id or target.info.key)[:12]})"
    return ev, {(f"{r.address:x} {r.text}", key_img): r.counts[i] for r in lst.rows
                if r.kind == "insn" and r.address is not None}


def sample_sets(dbs: list[Database], epoch_spec: str, by: str, hosts: list[str], base: Selection
                ) -> list[tuple[str, Database, Selection]]:
    """The sets `stats` compares: one per epoch, host or database (``by``) of ``dbs``' epochs
    ``epoch_spec``, each ``base`` narrowed to it (and to ``hosts``, if given)."""
    from cyclescope.db.query import parse_epochs

    sets: list[tuple[str, Database, Selection]] = []
    for db in dbs:
        epochs = parse_epochs(epoch_spec, db.epochs())
        spec = ",".join(map(str, epochs))
        if by == "db":
            sets.append((str(db.root), db, replace(base, epochs=spec, hosts=tuple(hosts))))
        elif by == "epoch":
            for e in epochs:
                name = f"{db.root}:{e}" if len(dbs) > 1 else f"epoch {e}"
                sets.append((name, db, replace(base, epochs=str(e), hosts=tuple(hosts))))
        else:
            found = sorted({h for e in epochs for h in db.hosts(e)})
            for h in found:
                if not hosts or h in hosts:
                    sets.append((f"host {h}", db, replace(base, epochs=spec, hosts=(h,))))
    return sets
