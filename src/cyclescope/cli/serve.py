"""`cyclescope serve`: the web UI over a profile database."""

from __future__ import annotations

import argparse
import contextlib
import errno
import ipaddress
import secrets
import socket
import sys

from cyclescope.cli.base import (
    Command,
    add_db_option,
    add_engine_options,
    engine,
    eprint,
    open_db,
    read_token,
    register,
)
from cyclescope.errors import UsageError

DEFAULT_PORT = 8765


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port; port 0 (or the default one, when taken): any free port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for attempt in (port, 0) if port == DEFAULT_PORT else (port,):
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host.strip("[]"), attempt))
        except OSError as e:
            s.close()
            if e.errno == errno.EADDRINUSE and attempt == DEFAULT_PORT:
                continue
            raise UsageError(f"cannot listen on {host}:{attempt}: {e.strerror}") from None
        s.listen(128)
        s.set_inheritable(True)
        return s
    raise UsageError(f"cannot listen on {host}")  # not reached


@register
class Serve(Command):
    name = "serve"
    description = (
        "A web UI over the database, in your browser: the samples over time, the hottest procedures\n"
        "and images, flame and icicle graphs of the recorded stacks (search, zoom, callers and callees\n"
        "of one function, and a differential graph between two selections), each procedure's annotated\n"
        "listing with calc's counts, CPI and stall culprits and its control-flow graph, value hotlists,\n"
        "invariants and specialization opportunities, and the stats table across epochs or hosts.\n"
        "Every view has a URL to share or reload and a download of what it shows. Epochs the daemon\n"
        "writes while the server runs appear without a restart.\n\n"
        "Secure by default: it listens on loopback only and refuses every request without the random\n"
        "access token it prints at start (in the URL to open); value hotlists are read with your own\n"
        "permissions. --host listens elsewhere, with a warning."
    )
    epilog = (
        "examples:\n"
        "  cyclescope serve                        # open the printed http://127.0.0.1:8765/?token=... URL\n"
        "  cyclescope serve --db /var/lib/cyclescope --port 9000\n"
        "  ssh -L 8765:127.0.0.1:8765 host         # then the URL on your own machine"
    )

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        add_db_option(p)
        p.add_argument("--port", type=int, default=DEFAULT_PORT, metavar="N",
                       help=f"port to listen on (default: {DEFAULT_PORT}, another free one if taken; 0: any)")
        p.add_argument("--host", default="127.0.0.1", metavar="ADDR",
                       help="address to listen on (default: 127.0.0.1; anything else is reachable by others "
                            "and warns)")
        p.add_argument("--token", metavar="TOKEN", default=None,
                       help="the access token (default: a random one; also $CYCLESCOPE_TOKEN)")
        p.add_argument("--ingest", action="store_true",
                       help="also accept files shipped by hosts (`cyclescope ship`, `daemon --ship-to`) into the "
                            "database, with the ingest token (--ingest-token-file, $CYCLESCOPE_INGEST_TOKEN, or a "
                            "random one printed at start); the database is created if need be")
        p.add_argument("--ingest-token-file", metavar="FILE",
                       help="--ingest: the token shipping hosts present (first line of FILE)")
        add_engine_options(p)

    def run(self, args: argparse.Namespace) -> int:
        import os

        import uvicorn

        from cyclescope.web.server import Site, make_app

        if not 0 <= args.port <= 65535:
            raise UsageError("--port must be between 0 and 65535")
        token = args.token or os.environ.get("CYCLESCOPE_TOKEN") or secrets.token_urlsafe(24)
        if len(token) < 16:
            raise UsageError("--token must be at least 16 characters")
        ingest_token = None
        if args.ingest:
            from cyclescope.cli.base import db_path
            from cyclescope.db.layout import Database

            ingest_token = read_token(args.ingest_token_file, "--ingest-token-file") or secrets.token_urlsafe(24)
            db = Database.create_or_open(db_path(args))
        else:
            db = open_db(args)
        loopback = is_loopback(args.host)
        sock = bind(args.host, args.port)
        port = sock.getsockname()[1]
        site = Site(db, token, loopback=loopback, port=port, ingest_token=ingest_token, engine=engine(args))
        if not loopback:
            eprint(f"cyclescope serve: warning: listening on {args.host}, not loopback: anyone who can reach it "
                   "and has the token reads these profiles, over plain HTTP (prefer an SSH tunnel)")
        shown = args.host if loopback and args.host != "0.0.0.0" else socket.gethostname()
        if ":" in shown:
            shown = f"[{shown.strip('[]')}]"
        print(f"http://{shown}:{port}/?token={token}", flush=True)
        if ingest_token is not None and not (args.ingest_token_file or os.environ.get("CYCLESCOPE_INGEST_TOKEN")):
            print(f"ingest token: {ingest_token}", flush=True)
        if sys.stderr.isatty():
            eprint(f"cyclescope serve: {db.root}, open the URL above; Ctrl-C stops")
        config = uvicorn.Config(make_app(site), log_level="warning", access_log=False, lifespan="off")
        server = uvicorn.Server(config)
        with contextlib.suppress(KeyboardInterrupt):
            server.run(sockets=[sock])
        return 0
