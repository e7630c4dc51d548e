"""A selection of the database opened for analysis: its flat counts and their metadata (db.query's
ProfileSet), the symbols and code of its images (binaries.Symbolizer), and on demand the loop
counters' tallies, the value hotlists and the call stacks of the same epochs and hosts: one type
for the three kinds of data a front end shows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from cyclescope.errors import DataError

if TYPE_CHECKING:
    import pyarrow as pa

    from cyclescope.analysis.anchors import AnchorStats
    from cyclescope.analysis.loopcount import LoopStats
    from cyclescope.analysis.progress import ProgressStats
    from cyclescope.analysis.trips import ScaleStats
    from cyclescope.binaries.symbolize import Symbolizer
    from cyclescope.db.layout import Database
    from cyclescope.db.query import Engine, ProfileSet, Selection
    from cyclescope.db.stacks import StackArrays, StackSelection
    from cyclescope.db.tallies import TallyKind
    from cyclescope.db.values import ValueSelection
    from cyclescope.images.registry import ImageInfo


def _ignore(_: str) -> None:
    pass


@dataclass
class Profile:
    profile_set: ProfileSet
    sym: Symbolizer
    warn: Callable[[str], None] = _ignore  # what goes wrong on the way without stopping it, one line each
    _values: dict[int | None, ValueSelection] = field(default_factory=dict, repr=False)
    _outcomes: dict[str, dict[int, dict[int, float]]] = field(default_factory=dict, repr=False)
    _sums: tuple[dict[str, int], dict[str, int]] | None = field(default=None, repr=False)

    @property
    def db(self) -> Database:
        return self.profile_set.db

    @property
    def images(self) -> dict[str, ImageInfo]:
        return self.profile_set.images

    @property
    def event_names(self) -> list[str]:
        return self.profile_set.event_names

    def with_event(self, event: str) -> Profile:
        """The same selection narrowed to one event (its counts are queried again)."""
        from cyclescope.db.query import ProfileSet

        selection = replace(self.profile_set.selection, events=(event,))
        profile_set = ProfileSet(**{**vars(self.profile_set), "selection": selection, "memo": {}})
        return Profile(profile_set, self.sym, self.warn)

    def image_totals(self) -> dict[str, int]:
        """Samples per image key, every event together."""
        return self._totals()[0]

    def event_totals(self) -> dict[str, int]:
        """Samples per event, every image together."""
        return self._totals()[1]

    def _totals(self) -> tuple[dict[str, int], dict[str, int]]:
        if self._sums is None:
            from cyclescope.db.query import query_counts

            t = query_counts(self.profile_set)
            images: dict[str, int] = {}
            events: dict[str, int] = {}
            for img, ev, c in zip(t.column("image").to_pylist(), t.column("event").to_pylist(),
                                  t.column("count").to_pylist(), strict=True):
                images[img] = images.get(img, 0) + int(c)
                events[ev] = events.get(ev, 0) + int(c)
            self._sums = (images, events)
        return self._sums

    def _tally(self, kind: TallyKind, image_key: str, what: str) -> pa.Table:
        """The selection's ``kind`` tallies of one image, summed (once per selection); corrupt files
        are left out with a warning that ``what`` from them is missing."""
        from cyclescope.db.tallies import load_tally

        profile_set = self.profile_set
        key = (False, (kind.name, image_key))
        memo = profile_set.memo.get(key)
        if memo is None:
            sel = load_tally(profile_set.db, kind, profile_set.epochs, profile_set.hosts or None, {image_key})
            for c in sel.corrupt:
                if f"skipping {c}" not in profile_set.warnings:
                    profile_set.warnings.append(f"skipping {c}")
                    self.warn(f"skipping {c} ({what} from it are left out)")
            memo = profile_set.memo[key] = sel.table
        return memo

    def loop_stats(self, image_key: str, start: int, end: int) -> dict[int, LoopStats]:
        """The loop counters' tallies of the selection for the loops headed in [start, end)."""
        from cyclescope.analysis.loopcount import LoopStats
        from cyclescope.db.tallies import LOOPS

        d = self._tally(LOOPS, image_key, "loop counts").to_pydict()
        out = {}
        for i, h in enumerate(d["header"]):
            if start <= h < end:
                out[int(h)] = LoopStats(
                    own=int(d["own"][i]), own_period=float(d["own_period"][i]), followed=int(d["followed"][i]),
                    next_own=int(d["next_own"][i]), pairs=int(d["pairs"][i]),
                    iterations=float(d["iterations"][i]), pair_period=float(d["pair_period"][i]),
                    mismatched=int(d["mismatched"][i]), rejected=int(d["rejected"][i]),
                    trip_samples=int(d["trip_samples"][i]), inv_trip=float(d["inv_trip"][i]))
        return out

    def anchor_stats(self, image_key: str, entry: int) -> AnchorStats | None:
        """The anchors' tallies of the selection for the procedure entered at ``entry``."""
        from cyclescope.db.tallies import ANCHORS

        d = self._tally(ANCHORS, image_key, "entry counts").to_pydict()
        return next((_anchor_row(d, i) for i, e in enumerate(d["entry"]) if e == entry), None)

    def scale_points(self, image_key: str, start: int, end: int) -> dict[int, tuple[AnchorStats, ScaleStats]]:
        """The scale points of the procedure in [start, end) (analysis/trips.py, "Scale windows"):
        point -> (its anchor's tallies, the scale windows'); only points with both."""
        from cyclescope.analysis.trips import ScaleStats
        from cyclescope.db.tallies import ANCHORS, SCALE

        sc = self._tally(SCALE, image_key, "scale windows").to_pydict()
        ratio = {int(sc["point"][i]): ScaleStats(**{n: sc[n][i] for n in SCALE.sum_names})
                 for i, e in enumerate(sc["entry"]) if e == start}
        if not ratio:
            return {}
        d = self._tally(ANCHORS, image_key, "entry counts").to_pydict()
        return {int(e): (_anchor_row(d, i), ratio[int(e)]) for i, e in enumerate(d["entry"])
                if start < e < end and int(e) in ratio}

    def trip_counts(self, image_key: str, entry: int) -> dict[int, tuple[int, int, int]]:
        """The trip windows' tallies of the selection for the procedure entered at ``entry``: point
        (the entry, a loop header or a hot block's start) -> (hits, windows, the entry's hits in
        those windows: 0 in tallies older than them), counted together (analysis/trips.py)."""
        from cyclescope.db.tallies import TRIPS

        d = self._tally(TRIPS, image_key, "trip windows").to_pydict()
        return {int(p): (int(h), int(w), int(eh)) for e, p, h, w, eh in
                zip(d["entry"], d["point"], d["hits"], d["windows"], d["entry_hits"], strict=True) if e == entry}

    def progress_stats(self, image_key: str, entry: int) -> dict[int, ProgressStats]:
        """The moving arguments' tallies of the selection for the procedure entered at ``entry``:
        value (0-5: the arguments rdi, rsi, rdx, rcx, r8, r9; 6-21: a register at the progress
        point, analysis/progress.value_name) -> its sums (analysis/progress.py)."""
        from cyclescope.analysis.progress import ProgressStats
        from cyclescope.db.tallies import PROGRESS

        d = self._tally(PROGRESS, image_key, "entry counts from moving arguments").to_pydict()
        return {int(d["arg"][i]): ProgressStats(**{n: d[n][i] for n in PROGRESS.sum_names})
                for i, e in enumerate(d["entry"]) if e == entry}

    def branch_outcomes(self, info: ImageInfo) -> dict[int, dict[int, float]]:
        """Branch (ELF address) -> {where control went (ELF address): how often}, observed on the
        selection's sampled paths in the image ``info`` (the value hotlists' ``edge`` module where
        this user may read them); memoized."""
        from cyclescope.analysis.paths import edge_outcomes

        memo = self._outcomes.get(info.key)
        if memo is None:
            memo = self._outcomes[info.key] = self.outcomes_at_addresses(info, edge_outcomes(self.values(), info.key))
        return memo

    def outcomes_at_addresses(self, info: ImageInfo, obs: dict[int, dict[int, float]]) -> dict[int, dict[int, float]]:
        """Branch outcomes keyed by image offsets (``obs``) keyed by the ELF addresses of ``info``."""
        import numpy as np

        offs = sorted({o for o in obs} | {t for d in obs.values() for t in d})
        va = dict(zip(offs, self.sym.offsets_to_vaddr(info, np.array(offs, np.uint64)).tolist(), strict=True))
        return {int(va[o]): {int(va[t]): n for t, n in d.items()} for o, d in obs.items()}

    def values(self, uid: int | None = None) -> ValueSelection:
        """The value hotlists of the selection's epochs and hosts (of ``uid``'s processes only, if
        given) that this user may read."""
        vs = self._values.get(uid)
        if vs is None:
            import numpy as np

            from cyclescope.db.values import load_values

            hosts = list(self.profile_set.selection.hosts) or None
            # Merging thins at random: the same seed gives the same hotlists every time.
            vs = self._values[uid] = load_values(self.db, self.profile_set.epochs, hosts, uid=uid,
                                                 rng=np.random.default_rng(0))
        return vs


    def stacks(self, images: set[str] | None = None) -> StackSelection:
        """The call stacks of the selection's epochs, hosts and processes (of stacks whose leaf is
        in ``images``, if given), summed."""
        return self.stack_arrays(images).selection()

    def stack_arrays(self, images: set[str] | None = None) -> StackArrays:
        """stacks() as columns, equal stacks summed: what flame graphs fold. Corrupt files are
        left out (``corrupt``); DataError when every file is."""
        from cyclescope.db.stacks import load_stack_arrays, stack_paths

        sel = self.profile_set.selection
        hosts, processes = list(sel.hosts) or None, set(sel.processes) or None
        if self.profile_set.engine is None:
            return load_stack_arrays(self.db, self.profile_set.epochs, hosts, images, processes)
        paths = stack_paths(self.db, self.profile_set.epochs, hosts)
        out = self.profile_set.engine.stack_arrays(paths, images, processes)
        if not out.files and out.corrupt:
            raise DataError(f"every stack file is corrupt: {out.corrupt[0]}")
        return out


def open_profile(db: Database, sel: Selection, warn: Callable[[str], None] = _ignore,
                 sym: Symbolizer | None = None, engine: Engine | None = None) -> Profile:
    """The selection's profile, its warnings given to ``warn`` (corrupt segments left out, epochs a
    range named that do not exist); DataError when every segment it covers is unreadable. ``sym``:
    the symbol tables of an earlier profile of the same database, to use again (a server's);
    ``engine``: where its counts and stacks are summed (None: the embedded DuckDB)."""
    from cyclescope.binaries.symbolize import Symbolizer
    from cyclescope.db.query import open_profile as open_set

    profile_set = open_set(db, sel, engine)
    for w in profile_set.warnings:
        warn(w)
    if not profile_set.segments and any(w.startswith("skipping") for w in profile_set.warnings):
        raise DataError(f"no readable segment in the selection "
                        f"({sum(w.startswith('skipping') for w in profile_set.warnings)} unreadable)")
    return Profile(profile_set, sym if sym is not None else Symbolizer(db), warn)


def _anchor_row(d: dict[str, list[Any]], i: int) -> AnchorStats:
    """Row ``i`` of an ANCHORS tally (as columns) as an AnchorStats."""
    from cyclescope.analysis.anchors import AnchorStats

    return AnchorStats(hits=int(d["hits"][i]), samples=int(d["samples"][i]), counted_s=float(d["counted_s"][i]),
                       windows=int(d["windows"][i]), near=int(d["near"][i]))
