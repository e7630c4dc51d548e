"""ELF reading, kallsyms, /proc parsing and the image resolver, on real compiled files."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from cyclescope.images.elf import (
    SymbolTable,
    build_id_from_notes,
    demangle_name,
    read_elf_info,
    read_load_info,
    read_symbols,
)
from cyclescope.images.kernel import KernelMap, kernel_ranges, kernel_symbols, parse_modules
from cyclescope.images.procfs import parse_maps, parse_perf_map
from cyclescope.images.registry import ImageResolver, ImageTable, Unknown

KALLSYMS = """\
ffffffff81000000 T _text
ffffffff81000000 T _stext
ffffffff81000000 T startup_64
ffffffff81000100 t do_one
ffffffff81000100 T do_one_alias
ffffffff81000180 T _do_two
ffffffff81000200 D some_data
ffffffff81001000 T _etext
ffffffff81002000 T init_fn
ffffffff81002100 T _einittext
ffffffffc0000000 t mod_fn\t[mymod]
"""


def test_kernel_ranges_and_symbols_from_kallsyms() -> None:
    (k,) = kernel_ranges(KALLSYMS, "", "kb")
    assert (k.start, k.end, k.base) == (0xFFFFFFFF81000000, 0xFFFFFFFF81002100, 0xFFFFFFFF81000000)
    t = kernel_symbols(KALLSYMS, k)
    assert "do_one" in t.names and "do_one_alias" not in t.names  # aliases: the shorter public name wins
    assert "some_data" not in t.names and "mod_fn" not in t.names
    idx = t.lookup(np.array([0x100, 0x17F, 0x180, 0x2050], np.uint64))
    assert [t.names[i] for i in idx] == ["do_one", "do_one", "_do_two", "init_fn"]
    km = KernelMap([k])
    i, off = km.lookup(np.array([0xFFFFFFFF81000104, 0xFFFFFFFFC0000000], np.uint64))
    assert i.tolist() == [0, -1] and off.tolist() == [0x104, 0]


def test_modules_parse() -> None:
    text = "ext4 1060864 1 - Live 0xffffffffc0100000\nbad line\n"
    assert parse_modules(text) == [("ext4", 0xFFFFFFFFC0100000, 1060864)]


def test_build_id_notes_and_symbol_tables(compile_c: Callable[..., Path]) -> None:
    exe = compile_c("hotcold")
    fast, full = read_load_info(str(exe)), read_elf_info(str(exe))
    assert fast.build_id and fast.build_id == full.build_id and len(fast.build_id) == 40
    assert fast.loads == full.loads and fast.elf_type == full.elf_type == "ET_DYN"
    assert full.has_symtab and full.has_debug_info
    syms = read_symbols(str(exe))
    hot = syms.names.index("hot")
    text = next(s for s in full.loads if s.executable)
    assert text.vaddr <= int(syms.starts[hot]) < text.vaddr + text.memsz
    out = subprocess.run(["nm", str(exe)], capture_output=True, text=True, check=True).stdout
    nm_hot = int(next(line.split()[0] for line in out.splitlines() if line.endswith(" hot")), 16)
    assert int(syms.starts[hot]) == nm_hot
    # A file offset in the text segment maps to its virtual address.
    assert full.vaddr_bias(text.offset) == text.vaddr - text.offset


def test_symbol_tables_read_as_arrays_match_pyelftools(compile_c: Callable[..., Path]) -> None:
    """The array read of .symtab and .dynsym gives pyelftools' symbols, in order, on a compiled
    program and on the C library (IFUNC resolvers included: libc's strcpy is one)."""
    import sys
    import sysconfig

    from elftools.elf.elffile import ELFFile

    from cyclescope.images.elf import _iter_func_symbols

    libc = next((p for p in ("/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib/x86_64-linux-gnu/libc.so.6")
                 if os.path.exists(p)), None)
    libpython = Path(sysconfig.get_config_var("LIBDIR") or "/", sysconfig.get_config_var("LDLIBRARY") or "-")
    paths = [str(compile_c("hotcold")), sys.executable, *([libc] if libc else []),
             *([str(libpython)] if libpython.is_file() else [])]
    for p in paths:
        with open(p, "rb") as f:
            elf = ELFFile(f)
            fast = _iter_func_symbols(elf, (".symtab", ".dynsym"))
            slow = _iter_func_symbols(elf, (".symtab", ".dynsym"), fast=False)
        assert fast == slow, p
        assert fast or p == sys.executable, p
    if libc:
        assert "strcpy" in read_symbols(libc).names  # an IFUNC: its resolver


def test_stripped_binaries_keep_their_dynamic_symbols(compile_c: Callable[..., Path], tmp_path: Path) -> None:
    exe = compile_c("hotcold", "-O2", "-g", "-rdynamic")
    stripped = tmp_path / "stripped"
    shutil.copy(exe, stripped)
    subprocess.run(["strip", "--strip-all", str(stripped)], check=True)
    info = read_elf_info(str(stripped))
    assert not info.has_symtab and info.build_id == read_elf_info(str(exe)).build_id
    assert "hot" in read_symbols(str(stripped)).names  # from .dynsym


def test_not_an_elf_file_is_a_clear_error(tmp_path: Path) -> None:
    from cyclescope.errors import DataError

    f = tmp_path / "x"
    f.write_text("hello")
    with pytest.raises(DataError, match="not an ELF file"):
        read_load_info(str(f))
    with pytest.raises(DataError, match="not a readable ELF"):
        read_elf_info(str(f))


def test_symbol_table_build_gives_zero_size_symbols_the_gap() -> None:
    t = SymbolTable.build([(0x10, 0, "a"), (0x30, 0x8, "b"), (0x10, 0, "_a_alias")], text_end=0x100)
    assert t.names == ("a", "b") and t.ends.tolist() == [0x30, 0x38]
    assert t.lookup(np.array([0x9, 0x10, 0x2F, 0x37, 0x38], np.uint64)).tolist() == [-1, 0, 0, 1, -1]
    v = SymbolTable.from_arrays(np.array([0x30, 0x10, 0x10], np.uint64), np.zeros(3, np.uint64),
                                ["b", "_a_alias", "a"], text_end=0x100)
    assert v.names == ("a", "b") and v.ends.tolist() == [0x30, 0x100]


def test_demangling() -> None:
    assert demangle_name("_ZN2ns1W3runEl") == "ns::W::run(long)"
    assert demangle_name("main") == "main"
    assert demangle_name("_Znot_valid_at_all") == "_Znot_valid_at_all"
    assert demangle_name("_ZN2ns1W3runEl@@V1") == "ns::W::run(long)@@V1"


def test_notes_parsing() -> None:
    head = (4).to_bytes(4, "little") + (3).to_bytes(4, "little") + (3).to_bytes(4, "little")
    note = head + b"GNU\0" + b"\xab\xcd\xef\0"
    assert build_id_from_notes(note) == "abcdef"
    assert build_id_from_notes(b"") is None


def test_proc_maps_and_perf_maps_parse() -> None:
    maps = parse_maps(
        "55d0c0000000-55d0c0001000 r-xp 00001000 08:01 123  /usr/bin/x\n"
        "7f0000000000-7f0000001000 rwxp 00000000 00:00 0 \n"
        "garbage\n"
    )
    assert [(m.start, m.end, m.offset, m.path, m.executable) for m in maps] == [
        (0x55D0C0000000, 0x55D0C0001000, 0x1000, "/usr/bin/x", True), (0x7F0000000000, 0x7F0000001000, 0, "", True)]
    assert parse_perf_map("7f00 10 jitted fn name\nbad\n") == [(0x7F00, 0x10, "jitted fn name")]


def test_resolver_names_images_by_build_id_and_computes_vaddrs(compile_c: Callable[..., Path]) -> None:
    exe = compile_c("hotcold")
    info = read_elf_info(str(exe))
    text = next(s for s in info.loads if s.executable)
    table = ImageTable()
    r = ImageResolver(table)
    start = 0x555500000000 + text.offset
    res = r.resolve(os.getpid(), start, start + 0x1000, text.offset, str(exe), None)
    assert table[res.image].key == info.build_id and table[res.image].offsets == "vaddr"
    assert start + 0x40 - res.bias == text.vaddr + 0x40
    # The same image through a build-id from the kernel: cached, same index.
    again = r.resolve(os.getpid(), start, start + 0x1000, text.offset, str(exe), bytes.fromhex(info.build_id or ""))
    assert again.image == res.image
    anon = r.resolve(os.getpid(), 0x1000, 0x2000, 0, "//anon", None)
    assert anon.image == -int(Unknown.ANON) - 1
    gone = r.resolve(999999, 0x1000, 0x2000, 0, "/nonexistent/lib.so", None)
    assert table[gone.image].offsets == "file" and gone.bias == 0x1000


def test_a_perf_map_older_than_its_process_is_another_processs() -> None:
    """Perf maps stay in /tmp after their process (hundreds here, from the tests' CPython -X perf
    runs), and pids come round again (at 32,768 here): a map written before the process started is
    not its map. This test once failed in a run of the suite, its own pid's stale map naming an
    anonymous mapping of its process."""
    import time

    from cyclescope.images.procfs import started_at

    before = time.time()
    child = subprocess.Popen(["sleep", "30"])
    after = time.time()
    path = Path(f"/tmp/perf-{child.pid}.map")
    try:
        started = started_at(child.pid)
        assert started is not None and before - 0.02 <= started <= after + 0.02, (before, started, after)
        path.write_text("1000 10 f\n")
        os.utime(path, (started - 5, started - 5))  # a stale map of an earlier process of this pid
        assert ImageResolver(ImageTable()).jit_image(child.pid) is None
        os.utime(path)  # written by this process
        table = ImageTable()
        idx = ImageResolver(table).jit_image(child.pid)
        assert idx is not None and table[idx].kind == "jit"
    finally:
        child.kill()
        child.wait()
        path.unlink(missing_ok=True)
    assert started_at(child.pid) is None  # gone


def test_archived_symbols_outlive_the_binary(compile_c: Callable[..., Path], tmp_path: Path) -> None:
    from cyclescope.binaries.symbolize import Symbolizer
    from cyclescope.db import symbols as symstore
    from cyclescope.db.layout import Database
    from cyclescope.images.registry import ImageInfo

    exe = tmp_path / "prog"
    shutil.copy(compile_c("hotcold"), exe)
    bid = read_elf_info(str(exe)).build_id or ""
    db = Database.create_or_open(tmp_path / "db")
    assert symstore.archive_symbols(db, bid, str(exe), bid)
    exe.unlink()
    info = ImageInfo(bid, str(exe), "elf", bid)
    sym = Symbolizer(db)
    assert "hot" in sym.table(info).names and info.key not in sym.problems
    assert not symstore.archive_symbols(db, "other", str(exe), "other")  # the file is gone


def test_a_daemon_archives_symbols_in_a_child(compile_c: Callable[..., Path], tmp_path: Path) -> None:
    """`python -m cyclescope.db.symbols DB KEY PATH BUILD_ID...` (what the flusher runs): the
    matching binary's symbols are kept; a triple whose build-id does not match is skipped, and the
    others still go in."""
    import subprocess
    import sys

    from cyclescope.db import symbols as symstore
    from cyclescope.db.layout import Database

    exe = tmp_path / "prog"
    shutil.copy(compile_c("hotcold"), exe)
    bid = read_elf_info(str(exe)).build_id or ""
    db = Database.create_or_open(tmp_path / "db")
    wrong = "0" * 40
    r = subprocess.run([sys.executable, "-m", "cyclescope.db.symbols", str(db.root), wrong, str(exe), wrong,
                        bid, str(exe), bid], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert symstore.has_symbols(db, bid) and not symstore.has_symbols(db, wrong)
    assert "hot" in (symstore.read_symbols(db, bid) or symstore.SymbolTable.build([])).names
    bad = subprocess.run([sys.executable, "-m", "cyclescope.db.symbols", str(db.root), bid], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr
