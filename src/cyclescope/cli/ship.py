"""`cyclescope ship`: send this host's profiles to a shared database (a path, or `serve --ingest`)."""

from __future__ import annotations

import argparse
import sys
import time

from cyclescope.cli.base import Command, add_db_option, eprint, open_db, read_token, register, stderr_tty
from cyclescope.errors import UsageError
from cyclescope.report.render import write_json


@register
class Ship(Command):
    name = "ship"
    description = (
        "Send this database's sealed files (segments, call stacks, tallies, symbol tables, archived\n"
        "binaries) to a shared database: a path (local disk, NFS, a mounted bucket) or the URL of\n"
        "`cyclescope serve --ingest`. Each host's epochs land in the destination's epoch of the same\n"
        "time, filed under the host's name; what was sent before is not sent again, an interrupted or\n"
        "repeated pass duplicates nothing, and a host that was offline catches up at its next pass.\n"
        "Value hotlists stay on the host (they are the sampled processes' data). The daemon ships on\n"
        "its own with `cyclescope daemon --ship-to DEST`."
    )
    epilog = (
        "examples:\n"
        "  cyclescope ship --to /mnt/profiles/fleet\n"
        "  cyclescope ship --to http://central:8765 --token-file /etc/cyclescope/ingest-token\n"
        "  cyclescope ship --to /mnt/profiles/fleet --every 300     # until stopped"
    )

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        add_db_option(p)
        p.add_argument("--to", required=True, metavar="DEST",
                       help="the shared database: a path, or http(s)://HOST:PORT of `serve --ingest`")
        p.add_argument("--token-file", metavar="FILE",
                       help="the ingest token for an http(s) destination (default: $CYCLESCOPE_INGEST_TOKEN)")
        p.add_argument("--follow-epochs", action="store_true",
                       help="when the destination has begun a newer epoch, begin one here (a daemon "
                            "writing here then files its next samples under it)")
        p.add_argument("--every", type=float, metavar="SECONDS",
                       help="ship again every SECONDS until interrupted (default: once)")
        p.add_argument("--json", action="store_true", help="write what each pass did as JSON")
        p.add_argument("--quiet", "-q", action="store_true", help="print nothing unless something goes wrong")

    def run(self, args: argparse.Namespace) -> int:
        from cyclescope.fleet.ship import Offline, destination, ship

        if args.every is not None and not args.every > 0:
            raise UsageError("--every must be a positive number of seconds")
        local = open_db(args)
        try:
            dest = destination(args.to, read_token(args.token_file, "--token-file"))
        except Offline as e:
            raise UsageError(f"cannot reach {args.to}: {e}") from None
        tty = stderr_tty() and not args.quiet and not args.json
        status = 0
        while True:
            def progress(n: int, rel: str) -> None:
                if tty and n % 25 == 0:
                    print(f"\rshipping: {n} files ({rel})\033[K", end="", file=sys.stderr, flush=True)

            report = ship(local, dest, follow=args.follow_epochs, progress=progress)
            if tty:
                print("\r\033[K", end="", file=sys.stderr, flush=True)
            for r in report.rejected:
                eprint(f"cyclescope ship: rejected by {dest.name}: {r}")
            if report.offline:
                eprint(f"cyclescope ship: stopped: {report.offline} (the rest goes at the next pass)")
            if args.json:
                write_json({"destination": dest.name, "stored": report.stored, "duplicate": report.duplicate,
                            "superseded": report.superseded, "side_files": report.side, "bytes": report.bytes,
                            "rejected": report.rejected, "offline": report.offline, "new_epoch": report.new_epoch,
                            "seconds": round(report.seconds, 3)})
            elif not args.quiet:
                print(f"{dest.name}: {report.stored} file(s) and {report.side} symbol table(s) or binaries stored "
                      f"({report.bytes / 1e6:.1f} MB), {report.duplicate} already there, "
                      f"{report.superseded} superseded, "
                      f"{len(report.rejected)} rejected in {report.seconds:.2f} s"
                      + (f"; began epoch {report.new_epoch} to follow the destination" if report.new_epoch else ""))
            status = 1 if report.rejected or report.offline else 0
            if args.every is None:
                return status
            sys.stdout.flush()
            time.sleep(args.every)
