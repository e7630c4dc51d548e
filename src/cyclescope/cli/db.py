"""`cyclescope db`: look inside the database and compact it."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from cyclescope.cli.base import Command, add_db_option, eprint, open_db, register, stderr_tty
from cyclescope.errors import DataError
from cyclescope.report.render import Col, Table, fmt_count, write_json, write_table

if TYPE_CHECKING:
    from cyclescope.db.layout import Database


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


@register
class Db(Command):
    name = "db"
    description = (
        "inspect: epochs, hosts, segments, samples and sizes (--verbose: each segment's metadata).\n"
        "compact: merge each epoch's segments, stack files, tallies and value files per host (the daemon also\n"
        "does this on its own).\n"
        "retain: merge the epochs older than --older-than into one per day (or week) by addition, value\n"
        "hotlists by thinning; then, over --max-size, drop the oldest epochs. Readers see the old epochs or\n"
        "the merged one, never both; an interrupted run is finished by the next. For a long-running fleet:\n"
        "run it from cron."
    )
    epilog = (
        "examples:\n"
        "  cyclescope db inspect\n"
        "  cyclescope db retain --db /srv/fleet --older-than 2d --by day --max-size 200G\n"
        "  cyclescope db retain --db /srv/fleet --older-than 30d --by week --dry-run"
    )

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("action", choices=["inspect", "compact", "retain"], help="what to do")
        add_db_option(p)
        p.add_argument("--epoch", "-E", default="all", metavar="SPEC", help="epochs (default: all)")
        p.add_argument("--host", metavar="HOST", action="append", default=[], help="only these hosts")
        p.add_argument("--verbose", "-v", action="store_true", help="inspect: show each segment's metadata")
        p.add_argument("--json", action="store_true", help="inspect, retain: write JSON")
        p.add_argument("--older-than", default="7d", metavar="AGE",
                       help="retain: merge epochs begun longer ago than AGE (default: 7d; also h, m, w)")
        p.add_argument("--by", choices=["day", "week"], default="day", help="retain: one epoch per day or week")
        p.add_argument("--max-size", metavar="SIZE", help="retain: then drop the oldest epochs while the "
                                                           "database is larger than SIZE (e.g. 50G)")
        p.add_argument("--dry-run", action="store_true", help="retain: say what would be merged, change nothing")

    def run(self, args: argparse.Namespace) -> int:
        from cyclescope.db.compact import CompactResult, compact
        from cyclescope.db.query import parse_epochs
        from cyclescope.db.stacks import compact_stacks
        from cyclescope.db.tallies import KINDS as TALLY_KINDS
        from cyclescope.db.tallies import compact_tallies
        from cyclescope.db.values import compact_values
        from cyclescope.db.values import uids as value_uids

        db = open_db(args)
        if args.action == "retain":
            return self._retain(db, args)
        epochs = parse_epochs(args.epoch, db.epochs())
        if args.action == "compact":
            n = 0
            for ep in epochs:
                for h in db.hosts(ep):
                    if args.host and h not in args.host:
                        continue
                    for uid in value_uids(db, ep, h):
                        out = compact_values(db, ep, h, uid)
                        if out is not None:
                            n += 1
                            print(f"epoch {ep} host {h}: value files of uid {uid} -> {out.name}")
                    jobs: list[tuple[str, Callable[[Database, int, str], CompactResult | None]]] = [
                        ("segments", compact), ("stack files", compact_stacks)]
                    jobs += [(f"{k.name} tallies", partial(compact_tallies, kind=k)) for k in TALLY_KINDS.values()]
                    for what, fn in jobs:
                        r = fn(db, ep, h)
                        if r is None:
                            continue
                        n += 1
                        print(f"epoch {ep} host {h}: {r.merged} {what}, {fmt_count(r.rows_before)} rows "
                              f"{_size(r.bytes_before)} -> {fmt_count(r.rows_after)} rows {_size(r.bytes_after)}")
                        for c in r.skipped_corrupt:
                            print(f"  left corrupt file {c} untouched")
            if not n:
                print("nothing to compact")
            return 0
        return self._inspect(db, epochs, args)

    def _retain(self, db: Database, args: argparse.Namespace) -> int:
        from cyclescope.fleet.retain import parse_duration, parse_size, plan, retain

        older = parse_duration(args.older_than)
        budget = parse_size(args.max_size) if args.max_size else None
        if args.dry_run:
            groups = plan(db, older, args.by)
            for g in groups:
                print(f"would merge epochs {','.join(map(str, g))} into epoch {g[0]} (one {args.by})")
            if not groups:
                print("nothing to merge")
            return 0
        quiet = args.json or not stderr_tty()
        report = retain(db, older, args.by, budget, None if quiet else eprint)
        if args.json:
            write_json({"merged": [vars(m) for m in report.merged], "dropped": report.dropped,
                        "cleaned": report.cleaned, "bytes_before": report.size_before,
                        "bytes_after": report.size_after})
            return 0
        for m in report.merged:
            print(f"epochs {','.join(map(str, m.epochs))} -> epoch {m.epochs[0]}: "
                  f"{_size(m.bytes_before)} -> {_size(m.bytes_after)}")
        for e in report.dropped:
            print(f"dropped epoch {e} (over --max-size)")
        if report.cleaned:
            print(f"removed {report.cleaned} leftover(s) of an interrupted run")
        print(f"database: {_size(report.size_before)} -> {_size(report.size_after)}")
        return 0

    def _inspect(self, db: Database, epochs: list[int], args: argparse.Namespace) -> int:
        from cyclescope.db.segment import read_meta

        rows = []
        out = []
        for ep in epochs:
            info = db.epoch_info(ep)
            for h in db.hosts(ep):
                for s in db.segments(ep, h):
                    size = s.path.stat().st_size
                    try:
                        m = read_meta(s.path)
                    except DataError as e:
                        rows.append([str(ep), h, s.name, "CORRUPT", "", "", _size(size), str(e)])
                        out.append({"epoch": ep, "host": h, "segment": s.name, "error": str(e)})
                        continue
                    samples = sum(e.samples for e in m.events.values())
                    lost = m.lost_records + m.lost_samples
                    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.start_time)) if m.start_time else "?"
                    rows.append([str(ep), h, s.name, fmt_count(samples), fmt_count(m.rows), fmt_count(lost),
                                 _size(size), when])
                    d = {"epoch": ep, "epoch_name": info.get("name"), "host": h, "segment": s.name,
                         "bytes": size, "rows": m.rows, "samples": samples, "lost": lost,
                         "events": {k: vars(v) for k, v in m.events.items()}, "images": len(m.images),
                         "start_time": m.start_time, "end_time": m.end_time, "unknown": m.unknown}
                    out.append(d)
                    if args.verbose and not args.json:
                        from cyclescope.db.values import uids as value_uids
                        from cyclescope.db.values import value_files

                        for uid in value_uids(db, ep, h):
                            files = value_files(db, ep, h, uid)
                            rows.append(["", "", f"  values uid={uid}", f"{len(files)} file(s)", "", "",
                                         _size(sum(f.path.stat().st_size for f in files)), ""])
                        rows.append(["", "", "  events", ", ".join(f"{k}={v.samples}" for k, v in m.events.items()),
                                     "", "", "", f"{len(m.images)} images"])
        if args.json:
            write_json({"db": str(db.root), "segments": out})
            return 0
        cols = [Col("epoch"), Col("host", "left"), Col("segment", "left"), Col("samples"), Col("rows"), Col("lost"),
                Col("size"), Col("start", "left")]
        total = sum(s.path.stat().st_size for _, _, s in db.all_segment_files())
        pre = [f"cyclescope db: {db.root}: {len(db.epochs())} epoch(s), {_size(total)} of segments"]
        write_table(Table(cols, rows, preamble=pre))
        return 0
