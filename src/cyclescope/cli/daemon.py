"""`cyclescope daemon` and the commands that talk to it: flush, epoch, status."""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from typing import Any

from cyclescope.cli.base import Command, add_db_option, db_path, eprint, finite_float, read_token, register
from cyclescope.cli.sampling import (
    add_count_options,
    add_sampling_options,
    add_value_options,
    bpf_collector,
    drain_interval,
    host_of,
    list_value_modules,
    make_events,
    open_session,
    processors,
    value_options,
)
from cyclescope.collect import control
from cyclescope.db.layout import Database
from cyclescope.errors import CycleScopeError, UsageError
from cyclescope.report.render import fmt_count

DEFAULT_DAEMON_HZ = 1000.0


def online_cpus() -> tuple[int, ...]:
    from cyclescope.collect.session import online_cpus as online

    return online()


def parse_cpus(text: str | None) -> tuple[int, ...]:
    online = online_cpus()
    if not text:
        return online
    from cyclescope.collect.session import parse_cpu_list

    try:
        cpus = parse_cpu_list(text)
    except ValueError:
        raise UsageError(f"--cpus: cannot parse '{text}' (e.g. 0-3,6)") from None
    bad = [c for c in cpus if c not in online]
    if bad:
        raise UsageError(f"--cpus: CPU(s) {', '.join(map(str, bad))} not online (online: {len(online)})")
    return tuple(sorted(set(cpus)))


@register
class Daemon(Command):
    name = "daemon"
    description = (
        "Sample every CPU (every process and the kernel) until stopped, merging counts into the\n"
        "database every --flush-interval seconds. Control it with 'cyclescope flush', 'cyclescope\n"
        "epoch' and 'cyclescope status'; SIGTERM or SIGINT flush and stop it, SIGHUP flushes."
    )
    epilog = (
        "example:\n"
        "  cyclescope daemon --db /var/lib/cyclescope -F 1000 &\n"
        "  cyclescope prof --db /var/lib/cyclescope"
    )

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        add_db_option(p)
        p.add_argument("--cpus", metavar="LIST", help="only these CPUs, e.g. 0-3,6 (default: all online)")
        p.add_argument("--flush-interval", type=finite_float, default=60.0, metavar="S",
                       help="merge into the database every S seconds (default: 60)")
        p.add_argument("--compact-after", type=int, default=8, metavar="N",
                       help="compact an epoch's segments once it has N (default: 8)")
        p.add_argument("-d", "--duration", type=finite_float, metavar="SECONDS", help="stop after this long")
        p.add_argument("--new-epoch", action="store_true", help="start a new epoch instead of continuing the latest")
        p.add_argument("--archive", choices=["symbols", "binaries", "none"], default="symbols",
                       help="what to keep of each profiled binary, by build-id: its symbol table (default; prof "
                            "then survives upgrades), the whole file (list and calc too), or nothing")
        p.add_argument("--ship-to", metavar="DEST",
                       help="after each flush, ship the sealed files to a shared database (a path, or the "
                            "http(s) URL of `serve --ingest`) and follow its epochs; see `cyclescope ship`")
        p.add_argument("--ship-token-file", metavar="FILE",
                       help="--ship-to an http(s) URL: the file holding its ingest token")
        add_sampling_options(p, DEFAULT_DAEMON_HZ)
        add_value_options(p, exact=False)
        add_count_options(p)

    def run(self, args: argparse.Namespace) -> int:
        # Before pyarrow is imported: Arrow allocates from the C library, whose freed memory each
        # flush gives back (malloc_trim), rather than from mimalloc, which kept 20-30 MiB after the
        # first flushes of a fork-storm soak. The daemon's children (compaction) are its own.
        os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
        from cyclescope.collect.daemon import Collector, CollectorConfig, peak_rss_kib
        from cyclescope.collect.flusher import Flusher
        from cyclescope.collect.session import SystemWide

        Flusher.return_large_frees()

        if args.values == "list":
            return list_value_modules()
        value_opts = value_options(args)
        events, rate = make_events(args)
        rate = rate if rate is not None or args.period is not None else DEFAULT_DAEMON_HZ
        if args.flush_interval <= 0:
            raise UsageError("--flush-interval must be positive")
        cpus = parse_cpus(args.cpus)
        ship_token = read_token(args.ship_token_file, "--ship-token-file") if args.ship_to else None
        if args.ship_to:  # a destination that cannot be used is said now, not at the first flush
            from cyclescope.fleet.ship import Offline, destination

            with contextlib.suppress(Offline):
                destination(args.ship_to, ship_token)
        procs = processors(args, value_opts, system_wide=True)
        bpf = bpf_collector(args, procs, rate, len(cpus), "daemon", system_wide=True)
        session, db = open_session(args, events, SystemWide(cpus), rate, value_opts, procs, bpf)
        cfg = CollectorConfig(host=host_of(args), flush_interval_s=args.flush_interval,
                              compact_after=args.compact_after, new_epoch=args.new_epoch, archive=args.archive,
                              follow_epochs=True, lean_memory=True, ship_to=args.ship_to,
                              ship_token=ship_token, rerandomize_s=args.redraw / 1000,
                              drain_s=drain_interval(value_opts), processors=procs, bpf=bpf)
        c = Collector(session, db, cfg)
        c.listen()
        try:
            c.start()
        except BaseException:
            c.close()
            raise
        c.install_signals()
        for w in session.warnings:
            eprint(f"cyclescope daemon: {w}")
        evs = ", ".join(s.label for s in session.events)
        eprint(f"cyclescope daemon: pid {os.getpid()} sampling {evs} at {rate:g} Hz on "
               f"{len(cpus)} CPU(s) into {db.root} (epoch {c.epoch}, host {cfg.host}; "
               f"{'counted in the kernel by eBPF' if bpf is not None else 'every sample read from the rings'})")
        t0 = time.monotonic()
        totals = c.run(duration_s=args.duration)
        lost = totals.lost_records + totals.lost_samples
        share = 100.0 * totals.unknown / totals.samples if totals.samples else 0.0
        eprint(f"cyclescope daemon: stopped after {time.monotonic() - t0:.1f} s: {fmt_count(totals.samples)} samples, "
               f"lost {fmt_count(lost)}, unknown {share:.2f}%, peak RSS {peak_rss_kib() / 1024:.1f} MiB")
        for line in c.summaries():
            eprint(f"cyclescope daemon: {line}")
        return 0


def _need_daemon(args: argparse.Namespace, cmd: str, **kw: Any) -> dict[str, Any]:
    db = Database.open(db_path(args))
    r = control.request(db.root, cmd, **kw)
    if r is None:
        raise CycleScopeError(f"no daemon is running on {db.root}")
    if not r.get("ok"):
        raise CycleScopeError(f"the daemon refused '{cmd}': {str(r.get('error'))[:300]}")
    return r


@register
class Flush(Command):
    name = "flush"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        add_db_option(p)

    def run(self, args: argparse.Namespace) -> int:
        r = _need_daemon(args, "flush")
        samples, rows = control.field_of(r, "samples", int), control.field_of(r, "rows", int)
        epoch, secs = control.field_of(r, "epoch", int), control.field_of(r, "seconds", (int, float))
        print(f"flushed {fmt_count(samples)} samples ({fmt_count(rows)} rows) into epoch {epoch} in {secs} s")
        return 0


@register
class Epoch(Command):
    name = "epoch"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        add_db_option(p)
        p.add_argument("--name", help="a name for the new epoch")
        p.add_argument("--list", action="store_true", help="list the epochs instead")

    def run(self, args: argparse.Namespace) -> int:
        if args.list:
            db = Database.open(db_path(args))
            for e in db.epochs():
                info = db.epoch_info(e)
                created = info.get("created")
                when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(str(created)))) if created else "?"
                hosts = ", ".join(db.hosts(e)) or "-"
                name = f"  {info.get('name')}" if info.get("name") else ""
                print(f"{e:6d}  {when}  hosts: {hosts}{name}")
            return 0
        db = Database.create_or_open(db_path(args))
        r = control.request(db.root, "epoch", name=args.name or "")
        if r is None:
            e = db.new_epoch(args.name, owner="cyclescope epoch")
            print(f"epoch {e} started (no daemon running on {db.root})")
            return 0
        if not r.get("ok"):
            raise CycleScopeError(f"the daemon refused 'epoch': {r.get('error')}")
        epoch, samples = control.field_of(r, "epoch", int), control.field_of(r, "samples", int)
        print(f"epoch {epoch} started; {fmt_count(samples)} samples flushed into epoch "
              f"{control.field_of(r, 'flushed_into', int)}")
        return 0


@register
class Status(Command):
    name = "status"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        add_db_option(p)
        p.add_argument("--json", action="store_true", help="write JSON")

    def run(self, args: argparse.Namespace) -> int:
        r = _need_daemon(args, "status")
        if args.json:
            import json

            print(json.dumps(r, indent=1))
            return 0
        f = control.field_of
        n = f(r, "samples", int)
        unk = 100.0 * f(r, "unknown", int) / n if n else 0.0
        events = [str(e) for e in f(r, "events", list)]
        print(f"daemon pid {f(r, 'pid', int)} on {f(r, 'host', str)}, up {f(r, 'uptime_s', (int, float))} s, "
              f"epoch {f(r, 'epoch', int)}, events {', '.join(events)}")
        lost = f(r, "lost_records", int) + f(r, "lost_samples", int)
        print(f"samples {fmt_count(n)}, lost {fmt_count(lost)}, unknown {unk:.2f}%, {f(r, 'flushes', int)} flushes, "
              f"{f(r, 'pending_rows', int)} rows pending")
        print(f"tracking {f(r, 'processes', int)} processes and {f(r, 'images', int)} images; "
              f"RSS {f(r, 'rss_kib', int) / 1024:.1f} MiB")
        ship = r.get("ship")
        if isinstance(ship, dict):
            print(f"shipping to {ship.get('to')}: {ship.get('stored')} file(s) stored"
                  + (f"; last pass stopped: {ship['offline']}" if ship.get("offline") else ""))
        return 0
