"""Real programs for the accuracy benchmark: Debian sources built with -O2 -g, plus our own kernels.

Debian packages come from `apt-get source` (a deb-src entry for the
configured suites is added when missing). Each is built statically so that
its hot code lives in one image. Nothing built here is committed.

    python bench/suite.py            # fetch and build everything into bench/out/suite/
    python bench/suite.py lua sqlite # also (or only) Lua 5.4 and SQLite's shell (bench/optimize.py)
    python bench/suite.py zstd lzip  # zstd (C) and lzip (C++)
"""

from __future__ import annotations

import glob
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from common import OUT, ROOT

SUITE = OUT / "suite"
SRC = SUITE / "src"
BIN = SUITE / "bin"
CFLAGS = "-O2 -g"
DEB_SRC = Path("/etc/apt/sources.list.d/cyclescope-deb-src.sources")


@dataclass
class Program:
    name: str
    exe: Path
    args: list[str]  # {input} is replaced by the input file
    image: str  # file name of the image whose procedures are analyzed


def sh(cmd: str, cwd: Path | None = None) -> None:
    r = subprocess.run(cmd, shell=True, cwd=cwd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"suite: '{cmd}' failed in {cwd}:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")


def ensure_deb_src() -> None:
    if DEB_SRC.exists():
        return
    text = (
        "Types: deb-src\nURIs: http://deb.debian.org/debian\nSuites: bookworm bookworm-updates\n"
        "Components: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
    )
    DEB_SRC.write_text(text)
    sh("apt-get update -qq")


def fetch(pkg: str) -> Path:
    SRC.mkdir(parents=True, exist_ok=True)
    found = [Path(p) for p in glob.glob(str(SRC / f"{pkg}-*")) if Path(p).is_dir()]
    if found:
        return found[0]
    ensure_deb_src()
    sh(f"apt-get source -qq {pkg}", cwd=SRC)
    found = [Path(p) for p in glob.glob(str(SRC / f"{pkg}-*")) if Path(p).is_dir()]
    if not found:
        raise SystemExit(f"suite: apt-get source {pkg} produced no directory")
    return found[0]


def build_bzip2() -> Path:
    out = BIN / "bzip2"
    if not out.exists():
        src = fetch("bzip2")
        # Debian's Makefile links the program against the shared libbz2: compile it whole instead.
        files = "blocksort.c huffman.c crctable.c randtable.c compress.c decompress.c bzlib.c bzip2.c"
        sh(f"gcc {CFLAGS} -D_FILE_OFFSET_BITS=64 -o {out} {files}", cwd=src)
    return out


def build_autotools(pkg: str, binary: str, extra: str = "") -> Path:
    out = BIN / binary.rsplit("/", 1)[-1]
    if not out.exists():
        src = fetch(pkg)
        # Debian's patches touch configure.ac: tell make not to regenerate the build system.
        noregen = "ACLOCAL=: AUTOCONF=: AUTOMAKE=: AUTOHEADER=: MAKEINFO=: AUTOPOINT=:"
        sh(f"./configure -q CFLAGS='{CFLAGS}' --disable-shared {extra} >/dev/null", cwd=src)
        sh(f"make -s -j2 {noregen} >/dev/null", cwd=src)
        shutil.copy(src / binary, out)
    return out


def prepare_lua() -> Path:
    """Lua 5.4's source tree, with the header Debian's rules generate (its luaconf.h includes it)."""
    src = fetch("lua5.4")
    header = src / "src" / "lua5.4-deb-multiarch.h"
    if not header.exists():
        header.write_text('#ifndef _LUA_DEB_MULTIARCH_\n#define _LUA_DEB_MULTIARCH_\n'
                          '#define DEB_HOST_MULTIARCH "x86_64-linux-gnu"\n#endif\n')
    return src


def prepare_sqlite() -> Path:
    """SQLite's source tree with its amalgamation (sqlite3.c, shell.c) generated: the form most
    programs embed it in (building it needs tclsh)."""
    src = fetch("sqlite3")
    if not (src / "sqlite3.c").exists() or not (src / "shell.c").exists():
        sh("./configure -q --disable-tcl >/dev/null && make -s sqlite3.c shell.c >/dev/null", cwd=src)
    return src


LUA_SOURCES = [f"{n}.c" for n in (
    "lapi", "lauxlib", "lbaselib", "lcode", "lcorolib", "lctype", "ldblib", "ldebug", "ldo", "ldump", "lfunc", "lgc",
    "linit", "liolib", "llex", "lmathlib", "lmem", "loadlib", "lobject", "lopcodes", "loslib", "lparser", "lstate",
    "lstring", "lstrlib", "ltable", "ltablib", "ltm", "lua", "lundump", "lutf8lib", "lvm", "lzio")]  # not luac.c
# With -ldl. A fixed string-hash seed: Lua 5.4 mixes the time and the addresses of a stack and a heap
# variable into it, and the run's work changes with the seed (table collisions). Measured under
# cachegrind, one binary's cycle estimate moved by 1.2% between paths of different lengths and by
# about 2.4% between seconds, a third of instrumented PGO's gain on this workload; seeded, the same
# path gives the same estimate and path lengths move it by 0.13% (docs/benchmarks.md).
LUA_FLAGS = ["-DLUA_USE_LINUX", "-Dluai_makeseed(L)=0x2545f491u"]
SQLITE_FLAGS = ["-DSQLITE_THREADSAFE=0", "-DSQLITE_OMIT_LOAD_EXTENSION"]  # one thread, no -ldl/-lpthread


def build_lua() -> Path:
    out = BIN / "lua"
    if not out.exists():
        src = prepare_lua() / "src"
        sh(f"gcc {CFLAGS} {shlex.join(LUA_FLAGS)} -o {out} {' '.join(LUA_SOURCES)} -lm -ldl", cwd=src)
    return out


def build_sqlite() -> Path:
    out = BIN / "sqlite3"
    if not out.exists():
        src = prepare_sqlite()
        sh(f"gcc {CFLAGS} {' '.join(SQLITE_FLAGS)} -I. -o {out} sqlite3.c shell.c -lm", cwd=src)
    return out


def build_zlib() -> Path:
    out = BIN / "minigzip"
    if not out.exists():
        src = fetch("zlib")
        sh(f"CFLAGS='{CFLAGS}' ./configure --static >/dev/null && make -s minigzip >/dev/null", cwd=src)
        shutil.copy(src / "minigzip", out)
    return out


def build_zstd() -> Path:
    """zstd's command-line program with the library compiled in, single-threaded, without its
    hand-written assembly (a decoder loop in .S: no CFG a compiler made)."""
    out = BIN / "zstd"
    if not out.exists():
        src = fetch("libzstd")
        sh(f"make -s -C programs zstd CFLAGS='{CFLAGS} -DZSTD_DISABLE_ASM' HAVE_THREAD=0 HAVE_ZLIB=0 "
           "HAVE_LZMA=0 HAVE_LZ4=0 >/dev/null", cwd=src)
        shutil.copy(src / "programs" / "zstd", out)
    return out


def build_lzip() -> Path:
    """lzip, an LZMA compressor in C++."""
    out = BIN / "lzip"
    if not out.exists():
        src = fetch("lzip")
        sh(f"./configure CXXFLAGS='{CFLAGS}' >/dev/null && make -s >/dev/null", cwd=src)
        shutil.copy(src / "lzip", out)
    return out


def build_own() -> tuple[Path, Path]:
    demo = BIN / "demo"
    skid = BIN / "kernels"
    if not demo.exists():
        sh(f"gcc {CFLAGS} -o {demo} {ROOT / 'src/cyclescope/demo/workload.c'}")
    if not skid.exists():
        sh(f"gcc {CFLAGS} -o {skid} {ROOT / 'tests/programs/kernels.c'}")
    return demo, skid


def make_input() -> Path:
    """About 6 MB of real text: Python's standard library sources, in a fixed order."""
    f = SUITE / "input.txt"
    if f.exists():
        return f
    import sysconfig

    lib = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    size = 0
    for p in sorted(lib.rglob("*.py")):
        try:
            b = p.read_bytes()
        except OSError:
            continue
        parts.append(b)
        size += len(b)
        if size > 6 << 20:
            break
    f.write_bytes(b"".join(parts))
    return f


def repeated_input(times: int) -> Path:
    """The suite's input ``times`` over (runs long enough for anchors: bench/anchorlong.py,
    bench/accuracy.py --repeat)."""
    f = make_input()
    if times <= 1:
        return f
    big = SUITE / f"input-x{times}.txt"
    if not big.exists():
        big.write_bytes(f.read_bytes() * times)
    return big


def programs(names: list[str] | None = None) -> tuple[list[Program], Path]:
    BIN.mkdir(parents=True, exist_ok=True)
    inp = make_input()
    out: list[Program] = []
    want = set(names or ["kernels", "demo", "bzip2", "gzip", "xz", "zlib"])
    demo, kernels = build_own()
    if "kernels" in want:
        out.append(Program("kernels", kernels, ["all"], "kernels"))
    if "demo" in want:
        out.append(Program("demo", demo, ["0.25"], "demo"))
    if "bzip2" in want:
        out.append(Program("bzip2", build_bzip2(), ["-c", "-9", "{input}"], "bzip2"))
    if "gzip" in want:
        out.append(Program("gzip", build_autotools("gzip", "gzip"), ["-c", "-6", "{input}"], "gzip"))
    if "xz" in want:
        exe = build_autotools("xz-utils", "src/xz/xz", "--disable-nls --disable-doc")
        out.append(Program("xz", exe, ["-c", "-3", "-T1", "{input}"], "xz"))
    if "zlib" in want:
        out.append(Program("zlib", build_zlib(), ["-c", "-6", "{input}"], "minigzip"))
    # Not in the default set (the accuracy figures were measured without them); bench/optimize.py uses them.
    if "lua" in want:
        out.append(Program("lua", build_lua(), [str(ROOT / "bench" / "programs" / "workload.lua")], "lua"))
    if "zstd" in want:
        out.append(Program("zstd", build_zstd(), ["-c", "-15", "--single-thread", "{input}"], "zstd"))
    if "lzip" in want:
        out.append(Program("lzip", build_lzip(), ["-c", "-3", "{input}"], "lzip"))
    if "sqlite" in want:
        out.append(Program("sqlite", build_sqlite(),
                           [":memory:", f".read {ROOT / 'bench' / 'programs' / 'workload.sql'}"], "sqlite3"))
    return out, inp


if __name__ == "__main__":
    progs, inp = programs(sys.argv[1:] or None)
    for p in progs:
        print(f"{p.name}: {p.exe} ({os.path.getsize(p.exe):,} B)")
    print(f"input: {inp} ({os.path.getsize(inp):,} B)")
