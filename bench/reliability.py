"""Reliability and attack suite: kill -9 at random moments, readers and compaction running, attacks.

Parts (--parts, all by default):

- daemon: the daemon (system-wide, 1 kHz, flushing every 0.5 s) killed with -9 at a random
  moment --kills times, restarted each time, while a reader runs `prof` in a loop and another
  runs `db compact` in a loop, both CPUs busy. Counted: corrupt files after all kills, reader
  failures, and per kill the samples lost (sampled time before the kill that no segment holds),
  in flush intervals.
- record: pairs of `record` runs of two different programs into one database at once, one of them
  killed with -9 at a random moment, --kills times. Counted: corrupt files, epochs holding another
  run's samples, commands that outlived their killed record.
- attack: a root daemon capturing values for the user nobody, attacked as nobody (links planted in
  every directory of the database, the control socket's name squatted) and, as the one user the
  control socket admits, with a client trickling bytes and garbage requests: files outside the
  database changed, whether the daemon is alive, flushes per second with and without the attack.
- fuzz: the generators of tests/unit/test_fuzz.py run for --fuzz examples each (random options of
  every report, of record and daemon; damaged databases under every report): inputs tried and
  crashes (an internal error or a traceback).

Usage: python bench/reliability.py [--kills 100] [--fuzz 2000] [--parts daemon,record,attack,fuzz]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import ROOT, cyclescope_cmd, machine, save

sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

RATE = 1000
FLUSH = 0.5


def build_spinners(d: Path) -> dict[str, Path]:
    src = ROOT / "tests" / "programs" / "spin_for.c"
    out = {}
    for name in ("spin_a", "spin_b", "busy"):
        exe = d / name
        subprocess.run(["gcc", "-O1", "-o", str(exe), str(src)], check=True)
        exe.chmod(0o755)
        out[name] = exe
    return out


def corrupt_files(db: Path) -> list[str]:
    """Every Parquet file of the database that does not read whole."""
    import pyarrow.parquet as pq

    bad = []
    for p in db.rglob("*.parquet"):
        if p.name.startswith(".tmp-"):
            continue
        try:
            pq.ParquetFile(p).read()
        except Exception as e:  # any failure to read is what is counted
            bad.append(f"{p.relative_to(db)}: {e}")
    return bad


def db_samples(db: Path) -> tuple[int, list[tuple[float, float, int]]]:
    """Total samples and (start, end, samples) per live segment, from the segments' metadata."""
    from cyclescope.db.layout import Database
    from cyclescope.db.segment import read_meta

    d = Database.open(db)
    total, segs = 0, []
    for _ep, _h, s in d.all_segment_files():
        try:
            m = read_meta(s.path)
        except Exception:
            continue
        n = sum(e.samples for e in m.events.values())
        total += n
        segs.append((m.start_time, m.end_time, n))
    return total, segs


class Loop(threading.Thread):
    """Runs a command over and over until stopped; counts runs and failures."""

    def __init__(self, argv: list[str], ok: tuple[int, ...] = (0,)) -> None:
        super().__init__(daemon=True)
        self.argv, self.ok = argv, ok
        self.runs = self.failures = 0
        self.errors: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            p = subprocess.run(self.argv, capture_output=True, text=True)
            self.runs += 1
            if p.returncode not in self.ok or "Traceback" in p.stderr:
                self.failures += 1
                self.errors.append(p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"exit {p.returncode}")
            time.sleep(0.05)


def wait_status(db: Path, timeout: float = 30) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if subprocess.run(cyclescope_cmd("status", "--db", str(db)), capture_output=True).returncode == 0:
            return time.time()
        time.sleep(0.1)
    return None


def _status_samples(db: Path) -> int | None:
    from cyclescope.collect.control import request

    try:
        r = request(db, "status", timeout_s=10)
    except Exception:
        return None
    return int(r["samples"]) if r and r.get("ok") else None


def part_daemon(tmp: Path, kills: int, exes: dict[str, Path]) -> dict[str, Any]:
    db = tmp / "daemon.db"
    busy = [subprocess.Popen([str(exes["busy"])]) for _ in range(os.cpu_count() or 1)]
    subprocess.run(cyclescope_cmd("record", "--db", str(db), "-q", "--", "true"), check=True)
    reader = Loop(cyclescope_cmd("prof", "--db", str(db), "-E", "all", "--json"), ok=(0, 4))
    compactor = Loop(cyclescope_cmd("db", "compact", "--db", str(db)))
    reader.start()
    compactor.start()
    losses: list[float] = []
    rng = random.Random(1)
    try:
        for k in range(kills):
            before, _ = db_samples(db)
            d = subprocess.Popen(cyclescope_cmd("daemon", "--db", str(db), "-F", str(RATE), "--flush-interval",
                                                str(FLUSH), "--compact-after", "3"),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            t_up = wait_status(db)
            s0 = _status_samples(db)
            time.sleep(rng.uniform(0.3, 3.0))
            s1 = _status_samples(db)  # what the daemon has taken so far...
            t1 = time.time()
            d.kill()  # ...and then dies at once
            d.wait()
            after, _ = db_samples(db)
            if t_up is None or s0 is None or s1 is None:
                continue
            rate = (s1 - s0) / max(1e-3, t1 - t_up)
            # Samples taken before the kill that no segment holds, in flush intervals' worth.
            losses.append(max(0, s1 - (after - before)) / max(1.0, rate * FLUSH))
            print(f"\rdaemon kills: {k + 1}/{kills}, samples {after - before:,} this run", end="", flush=True)
    finally:
        reader.stop.set()
        compactor.stop.set()
        for b in busy:
            b.kill()
            b.wait()
        reader.join()
        compactor.join()
    print()
    bad = corrupt_files(db)
    return {"kills": kills, "corrupt_files": len(bad), "corrupt": bad[:5], "reader_runs": reader.runs,
            "reader_failures": reader.failures, "reader_errors": reader.errors[:5], "compactions": compactor.runs,
            "compaction_failures": compactor.failures, "compaction_errors": compactor.errors[:5],
            "lost_flush_intervals": {"max": round(max(losses, default=0.0), 2),
                                     "median": round(sorted(losses)[len(losses) // 2], 2) if losses else 0.0,
                                     "over_one": sum(x > 1.0 for x in losses), "measured": len(losses)}}


def part_record(tmp: Path, kills: int, exes: dict[str, Path]) -> dict[str, Any]:
    from cyclescope.db.layout import Database
    from cyclescope.db.segment import read_meta

    db = tmp / "record.db"
    rng = random.Random(2)
    survived = 0
    for k in range(kills):
        a = subprocess.Popen(cyclescope_cmd("record", "--db", str(db), "-q", "-F", str(RATE), "--flush-interval",
                                            str(FLUSH), "--", str(exes["spin_a"]), "3"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        b = subprocess.Popen(cyclescope_cmd("record", "--db", str(db), "-q", "-F", str(RATE), "--flush-interval",
                                            str(FLUSH), "--", str(exes["spin_b"]), "2"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.2, 2.5))
        victim = a if k % 2 == 0 else b
        kids = _children(victim.pid)
        victim.kill()
        victim.wait()
        (b if victim is a else a).wait(timeout=120)
        time.sleep(0.2)
        survived += sum(1 for pid in kids if _alive(pid))
        for pid in kids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        print(f"\rrecord kills: {k + 1}/{kills}", end="", flush=True)
    print()
    d = Database.open(db)
    mixed = []
    epochs_seen = 0
    for ep in d.epochs():
        procs: set[str] = set()
        for h in d.hosts(ep):
            for s in d.segments(ep, h):
                try:
                    procs |= set(read_meta(s.path).processes)
                except Exception:
                    continue
        if procs:
            epochs_seen += 1
        if len(procs & {"spin_a", "spin_b"}) > 1:
            mixed.append(ep)
    bad = corrupt_files(db)
    return {"kills": kills, "epochs": len(d.epochs()), "epochs_with_samples": epochs_seen,
            "epochs_mixed": len(mixed), "corrupt_files": len(bad), "corrupt": bad[:5],
            "commands_outliving_record": survived}


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for t in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{t}/children") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def flushes_per_s(db: Path, seconds: float) -> float:
    from cyclescope.collect.control import request

    r0 = request(db, "status")
    time.sleep(seconds)
    r1 = request(db, "status")
    assert r0 and r1
    return (int(r1["flushes"]) - int(r0["flushes"])) / seconds


def part_attack(tmp: Path, exes: dict[str, Path]) -> dict[str, Any]:
    from tests.system.test_security import ATTACK, NOBODY

    shared = Path(tempfile.mkdtemp(prefix="cs-attack-"))
    shared.chmod(0o755)
    db = shared / "db"
    targets = [shared / "target", Path("/etc/passwd"), Path("/etc/shadow")]
    targets[0].write_text("root's\n")
    before = {str(t): (t.stat().st_uid, t.stat().st_mode, t.read_bytes()) for t in targets if t.exists()}
    attack = shared / "attack.py"
    attack.write_text(ATTACK)
    spin = shared / "spin"
    shutil.copy(exes["spin_a"], spin)
    spin.chmod(0o755)
    d = subprocess.Popen(cyclescope_cmd("daemon", "--db", str(db), "-F", str(RATE), "--flush-interval", "0.25",
                                        "--values", "operands", "--values-users", "nobody"),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    out: dict[str, Any] = {}
    try:
        wait_status(db)

        def drop() -> None:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)

        work = subprocess.Popen([str(spin), "30"], preexec_fn=drop)
        time.sleep(1)
        quiet = flushes_per_s(db, 5)
        # As the one user the socket admits: clients trickling a byte every 0.3 s, and garbage.
        stop = threading.Event()
        garbage_sent = [0, 0]

        def slowloris() -> None:
            while not stop.is_set():
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.connect(str(db / "control" / "daemon.sock"))
                    while not stop.is_set():
                        s.sendall(b"{")
                        time.sleep(0.3)
                except OSError:
                    pass
                finally:
                    s.close()

        def garbage() -> None:
            rng = random.Random(3)
            while not stop.is_set():
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.connect(str(db / "control" / "daemon.sock"))
                    s.sendall(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 6000))) + b"\n")
                    s.settimeout(3)
                    reply = json.loads(s.recv(65536) or b"{}")
                    garbage_sent[0] += 1
                    garbage_sent[1] += reply.get("ok") is False
                except (OSError, ValueError):
                    pass
                finally:
                    s.close()
                time.sleep(0.01)

        threads = [threading.Thread(target=slowloris, daemon=True) for _ in range(4)]
        threads.append(threading.Thread(target=garbage, daemon=True))
        for t in threads:
            t.start()
        attacked = flushes_per_s(db, 5)
        stop.set()
        # As nobody: links planted in every directory of the database, the socket's name squatted.
        thieves = [subprocess.Popen(["python3", str(attack), str(db), str(t), "8"], preexec_fn=drop,
                                    stderr=subprocess.PIPE, text=True) for t in targets]
        squatter = ("import socket, sys\nn = 0\nfor p in (sys.argv[1] + '/control/daemon.sock', "
                    "sys.argv[1] + '/control/x'):\n    try:\n        s = socket.socket(socket.AF_UNIX)\n"
                    "        s.bind(p)\n        n += 1\n    except OSError:\n        pass\nprint(n)")
        squat = subprocess.run(["python3", "-c", squatter, str(db)], preexec_fn=drop, capture_output=True, text=True)
        time.sleep(1)
        busy = flushes_per_s(db, 5)
        stop.set()
        tried = refused = 0
        for th in thieves:
            _, err = th.communicate(timeout=60)
            a, b = (int(x) for x in err.split()[-2:])
            tried, refused = tried + a, refused + b
        work.kill()
        work.wait(timeout=60)
        out = {"link_attempts": tried, "link_attempts_refused": refused, "sockets_squatted": int(squat.stdout or 0),
               "garbage_requests": garbage_sent[0], "garbage_answered_with_error": garbage_sent[1],
               "flushes_per_s_quiet": round(quiet, 2), "flushes_per_s_control_attacks": round(attacked, 2),
               "flushes_per_s_link_attacks": round(busy, 2), "daemon_alive": d.poll() is None}
    finally:
        d.send_signal(signal.SIGTERM)
        _, err = d.communicate(timeout=60)
    after = {str(t): (t.stat().st_uid, t.stat().st_mode, t.read_bytes()) for t in targets if t.exists()}
    out["files_outside_changed"] = sum(before[k] != after.get(k) for k in before)
    out["daemon_exit"] = d.returncode
    shutil.rmtree(shared, ignore_errors=True)
    return out


def part_fuzz(n: int) -> dict[str, Any]:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from tests.unit import test_fuzz as tf

    root = Path(tempfile.mkdtemp(prefix="cs-fuzz-"))
    pristine = tf.make_db(root / "db").root
    counts = {"report_options": [0, 0], "record_options": [0, 0], "damaged": [0, 0]}
    crashes: list[str] = []

    def note(kind: str, args: list[str], code: int, err: str) -> None:
        counts[kind][0] += 1
        if code == tf.INTERNAL_ERROR or "Traceback" in err:
            counts[kind][1] += 1
            crashes.append(f"{args}: {err.strip().splitlines()[-1] if err.strip() else code}")

    quiet = settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck), database=None)

    @quiet
    @given(data=st.data())
    def reports(data: st.DataObject) -> None:
        a = data.draw(tf.report_args(pristine))
        note("report_options", a, *tf.run_cli(a))

    @quiet
    @given(opts=st.lists(st.tuples(st.sampled_from(tf.RECORD_OPTS), st.sampled_from(tf.RECORD_VALUES)), max_size=4))
    def records(opts: list[tuple[str, str]]) -> None:
        flat = [x for o, v in opts for x in (o, v)]
        a = ["record", "--db", str(root / "rec"), *flat, "--", "/nonexistent/cyclescope-fuzz"]
        note("record_options", a, *tf.run_cli(a))

    @quiet
    @given(which=st.integers(0, 1000), how=st.sampled_from(tf.DAMAGE), at=st.floats(0, 1),
           cmd=st.sampled_from([["prof"], ["list", "work"], ["calc", "work"], ["stats", "--epoch", "all"],
                                ["diff", "1", "2"], ["export", "collapsed"], ["export", "pprof"], ["db", "inspect"],
                                ["db", "compact"], ["values"], ["calc", "--image", "inl"]]))
    def damaged(which: int, how: str, at: float, cmd: list[str]) -> None:
        d = Path(tempfile.mkdtemp(dir=root)) / "db"
        shutil.copytree(pristine, d)
        what = tf.damage(d, which, how, at)
        a = [*cmd, "--db", str(d)] + (["-o", str(d.parent / "o")] if cmd[0] == "export" else [])
        note("damaged", [what, *a], *tf.run_cli(a))
        shutil.rmtree(d.parent, ignore_errors=True)

    for f in (reports, records, damaged):
        f()
    # And systematically: one byte flipped at ~100 places of every file, under several reports.
    counts["byte_flips"] = [0, 0]
    cmds = [["calc", "--image", "inl"], ["prof"], ["list", "work"], ["export", "pprof"], ["stats", "--epoch", "all"],
            ["db", "compact"], ["diff", "1", "2"]]
    for f in sorted(p for p in pristine.rglob("*") if p.is_file()):
        data = f.read_bytes()
        for i in range(0, len(data), max(1, len(data) // 100)):
            d = Path(tempfile.mkdtemp(dir=root)) / "db"
            shutil.copytree(pristine, d)
            g = d / f.relative_to(pristine)
            b = g.read_bytes()
            g.write_bytes(b[:i] + bytes([b[i] ^ 0xFF]) + b[i + 1:])
            for cmd in cmds:
                a = [*cmd, "--db", str(d)] + (["-o", str(d.parent / "o")] if cmd[0] == "export" else [])
                note("byte_flips", [f"flip byte {i} of {f.relative_to(pristine)}", *a], *tf.run_cli(a))
            shutil.rmtree(d.parent, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    return {k: {"tried": v[0], "crashed": v[1]} for k, v in counts.items()} | {"crashes": crashes[:10]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=100)
    ap.add_argument("--fuzz", type=int, default=2000)
    ap.add_argument("--parts", default="daemon,record,attack,fuzz")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("reliability: run as root (the daemon samples every CPU; the attacks run as nobody)")
    tmp = Path(tempfile.mkdtemp(prefix="cs-rel-"))
    tmp.chmod(0o755)
    exes = build_spinners(tmp)
    result: dict[str, Any] = {"machine": machine(), "args": vars(args)}
    parts = args.parts.split(",")
    if "daemon" in parts:
        result["daemon"] = part_daemon(tmp, args.kills, exes)
        print("daemon:", json.dumps(result["daemon"]))
    if "record" in parts:
        result["record"] = part_record(tmp, args.kills, exes)
        print("record:", json.dumps(result["record"]))
    if "attack" in parts:
        result["attack"] = part_attack(tmp, exes)
        print("attack:", json.dumps(result["attack"]))
    if "fuzz" in parts:
        result["fuzz"] = part_fuzz(args.fuzz)
        print("fuzz:", json.dumps(result["fuzz"]))
    print(f"raw data: {save('reliability', result)}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
