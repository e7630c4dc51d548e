"""Call stacks without the kernel: callchain parsing, aggregation, the stack files, the export formats."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from cyclescope.collect.stacks import StackAggregator, split_chain
from cyclescope.db.layout import Database
from cyclescope.db.stacks import StackArrays, compact_stacks, load_stack_arrays, load_stacks, stacks_dir, write_stacks
from cyclescope.errors import DataError
from cyclescope.perf.abi import PERF_CONTEXT_KERNEL, PERF_CONTEXT_USER
from cyclescope.report.export import SPEEDSCOPE_SCHEMA, collapsed, named_stacks, speedscope


def test_callchains_split_into_frames_with_return_addresses_marked() -> None:
    chain = (PERF_CONTEXT_KERNEL, 0xFFFF0010, 0xFFFF0020, PERF_CONTEXT_USER, 0x401000, 0x402005, 0x403009, 0)
    assert split_chain(chain, 0xFFFF0010) == [
        (0xFFFF0010, True, False), (0xFFFF0020, True, True),  # the kernel's PC, then a return address
        (0x401000, False, False),  # where user space was interrupted: a PC
        (0x402005, False, True), (0x403009, False, True),  # return addresses; the 0 that ends the chain goes
    ]
    assert split_chain((), 0x401000) == [(0x401000, False, False)]


class _Proc:
    def lookup(self, ips: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ips = ips.astype(np.uint64)
        inside = (ips >= 0x400000) & (ips < 0x500000)
        return np.where(inside, 1, -3).astype(np.int64), np.where(inside, ips - 0x400000, 0).astype(np.uint64)


class _Mapper:
    def __init__(self) -> None:
        self.procs = {7: _Proc()}

    def map_frames(self, pids: np.ndarray, addrs: np.ndarray, kernel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        img = np.zeros(len(addrs), np.int64)
        off = np.zeros(len(addrs), np.uint64)
        u = ~kernel
        i, o = self.procs[7].lookup(addrs[u])
        img[u], off[u] = np.where(i > 0, i, 0), np.where(i > 0, o, 0)
        img[kernel], off[kernel] = 2, addrs[kernel] - np.uint64(0xFFFF0000)
        return img, off


def test_stacks_are_mapped_with_return_addresses_at_their_call_and_counted() -> None:
    agg = StackAggregator()
    chain = (PERF_CONTEXT_USER, 0x401000, 0x402005, 0x403009)
    agg.add(_Mapper(), np.array([7, 7, 7]), np.array([0x401000] * 3, np.uint64), np.array([0, 0, 1]),
            [chain, chain, None])
    sc = agg.take()
    stacks, ev, n, comm = sc.rows()
    assert set(comm) == {-1}  # no commands given
    got = {(tuple(s), e): c for s, e, c in zip(stacks, ev, n, strict=True)}
    full = ((1, 0x1000), (1, 0x2004), (1, 0x3008))  # return addresses looked up one byte back
    assert got == {(full, 0): 2, (((1, 0x1000),), 1): 1}  # no callchain: the sampled ip alone
    assert len(agg.take()) == 0


def test_stack_files_round_trip_and_a_corrupt_one_is_skipped(tmp_path: Path) -> None:
    db = Database.create_or_open(tmp_path / "db")
    epoch = db.ensure_epoch()
    agg = StackAggregator()
    agg.add(_Mapper(), np.array([7]), np.array([0x401000], np.uint64), np.array([0]),
            [(PERF_CONTEXT_USER, 0x401000, 0x402005)])
    keys = ["[unknown]", "buildid-a", "kernel"]
    write_stacks(db, epoch, "h", agg.take(), keys, ["cpu-clock"], {"buildid-a": {"key": "buildid-a"}})
    agg.add(_Mapper(), np.array([7]), np.array([0x401000], np.uint64), np.array([0]),
            [(PERF_CONTEXT_USER, 0x401000, 0x402005)], [1])
    write_stacks(db, epoch, "h", agg.take(), keys, ["cpu-clock"], {}, ["[unknown]", "prog"])
    sel = load_stacks(db, [epoch])
    assert sel.files == 2 and sel.images == {"buildid-a": {"key": "buildid-a"}}
    stack = ("cpu-clock", (("buildid-a", 0x1000), ("buildid-a", 0x2004)))
    assert sel.counts == Counter({stack: 2})
    assert load_stacks(db, [epoch], images={"other"}).counts == Counter()
    # The command each stack was sampled in: the first file has none recorded, the second "prog".
    assert load_stacks(db, [epoch], processes={"prog"}).counts == Counter({stack: 1})
    assert load_stacks(db, [epoch], processes={"other"}).counts == Counter()
    (stacks_dir(db, epoch, "h") / "stk-00000009-00000009.parquet").write_bytes(b"PAR1 not really")
    sel = load_stacks(db, [epoch])
    assert sel.files == 2 and len(sel.corrupt) == 1 and sum(sel.counts.values()) == 2
    for f in stacks_dir(db, epoch, "h").iterdir():
        if f.name != "stk-00000009-00000009.parquet":
            f.unlink()
    with pytest.raises(DataError, match="corrupt"):
        load_stacks(db, [epoch])


def _as_counter(a: StackArrays) -> Counter[tuple[str, tuple[tuple[str, int], ...]]]:
    out: Counter[tuple[str, tuple[tuple[str, int], ...]]] = Counter()
    for r in range(len(a)):
        lo, hi = a.splits[r], a.splits[r + 1]
        frames = tuple((a.keys[int(i)], int(o)) for i, o in zip(a.image[lo:hi], a.offset[lo:hi], strict=True))
        out[(a.events[int(a.event[r])], frames)] += int(a.count[r])
    return out


def test_stacks_as_columns_hold_what_load_stacks_reads(tmp_path: Path) -> None:
    db = Database.create_or_open(tmp_path / "db")
    epoch = db.ensure_epoch()
    keys = ["[unknown]", "buildid-a", "kernel"]
    chains = [(PERF_CONTEXT_USER, 0x401000, 0x402005), (PERF_CONTEXT_USER, 0x401000, 0x403005, 0x402005),
              (PERF_CONTEXT_KERNEL, 0xFFFFFFFF81000000, PERF_CONTEXT_USER, 0x401000)]
    for i in range(3):
        agg = StackAggregator()
        for j, chain in enumerate(chains):
            n = i + j + 1
            agg.add(_Mapper(), np.array([7] * n), np.array([0x401000] * n, np.uint64), np.full(n, j % 2),
                    [chain] * n, [1 + (j == 2)] * n)
        write_stacks(db, epoch, "h", agg.take(), keys, ["cpu-clock", "page-faults"], {}, ["[unknown]", "prog", "sh"])
    (stacks_dir(db, epoch, "h") / "stk-00000009-00000009.parquet").write_bytes(b"PAR1 not really")
    for kw in ({}, {"images": {"buildid-a"}}, {"images": {"other"}}, {"processes": {"sh"}}):
        rows = load_stacks(db, [epoch], **kw)  # type: ignore[arg-type]
        cols = load_stack_arrays(db, [epoch], **kw)  # type: ignore[arg-type]
        assert _as_counter(cols) == rows.counts, kw
        assert bool(rows.counts) == (kw != {"images": {"other"}})
        assert cols.files == 3 and len(cols.corrupt) == 1
    only = load_stack_arrays(db, [epoch], events={"page-faults"})
    assert set(_as_counter(only)) == {k for k in load_stacks(db, [epoch]).counts if k[0] == "page-faults"}


def test_collapsed_and_speedscope_documents() -> None:
    stacks = Counter({("cpu-clock", (("a", 0x10), ("a", 0x20))): 5,  # leaf first
                      ("cpu-clock", (("a", 0x11), ("a", 0x20))): 2,
                      ("cpu-clock", (("a", 0x20),)): 1,
                      ("page-faults", (("a", 0x30),)): 4})
    name = {("a", 0x10): "leaf", ("a", 0x11): "leaf", ("a", 0x20): "main x", ("a", 0x30): "f;g"}.__getitem__
    cpu = named_stacks(stacks, name, "cpu-clock")
    assert cpu == Counter({("main x", "leaf"): 7, ("main x",): 1})  # offsets of one procedure merge
    assert collapsed(cpu) == "main_x;leaf 7\nmain_x 1\n"
    assert collapsed(named_stacks(stacks, name, "page-faults")) == "f:g 4\n"
    doc = speedscope({"cpu-clock": cpu}, "t")
    assert doc["$schema"] == SPEEDSCOPE_SCHEMA
    frames = [f["name"] for f in doc["shared"]["frames"]]
    (p,) = doc["profiles"]
    assert sorted(([frames[i] for i in s], w) for s, w in zip(p["samples"], p["weights"], strict=True)) == [
        (["main x"], 1), (["main x", "leaf"], 7)]
    assert p["endValue"] == 8 and json.loads(json.dumps(doc)) == doc


def test_pprof_document_has_mappings_locations_functions_and_values_per_event() -> None:
    import gzip

    from cyclescope.report.export import pprof
    from cyclescope.report.proto import profile_pb2 as pb

    stacks = Counter({("cpu-clock", (("lib", 0x10), ("exe", 0x20))): 3,
                      ("cpu-clock", (("exe", 0x30),)): 5,
                      ("page-faults", (("exe", 0x30),)): 2})
    images = {"exe": {"path": "/bin/exe", "build_id": "ab12", "size": 0x1000}, "lib": {"path": "/lib/l.so"}}
    names = {("lib", 0x10): ("f", "l.c", 7), ("exe", 0x20): ("main", "m.c", 3), ("exe", 0x30): ("main", "m.c", 4)}
    blob = pprof(stacks, ["cpu-clock", "page-faults"], images, names.__getitem__, period=("cpu-clock", 200000))
    p = pb.Profile()  # type: ignore[attr-defined]
    p.ParseFromString(gzip.decompress(blob))
    st = list(p.string_table)
    assert st[0] == "" and [st[t.type] for t in p.sample_type] == ["cpu-clock", "page-faults"]
    assert st[p.mapping[0].filename] == "/bin/exe" and st[p.mapping[0].build_id] == "ab12"  # most samples first
    assert p.period == 200000 and st[p.period_type.unit] == "nanoseconds"
    funcs = {f.id: st[f.name] for f in p.function}
    assert sorted(funcs.values()) == ["f", "main"]  # one function for main's two locations
    locs = {loc.id: loc for loc in p.location}
    got = {tuple((funcs[locs[i].line[0].function_id], locs[i].line[0].line) for i in s.location_id): list(s.value)
           for s in p.sample}
    assert got == {(("f", 7), ("main", 3)): [3, 0], (("main", 4),): [5, 2]}
    maps = {m.id: m for m in p.mapping}
    assert all(maps[loc.mapping_id].memory_start <= loc.address < maps[loc.mapping_id].memory_limit
               for loc in p.location)


def test_llvm_sample_text_follows_the_format() -> None:
    from cyclescope.report.llvm_sample import FunctionProfile, render

    f = FunctionProfile("main", head=10)
    f.add(2, 0, 100)
    f.add(2, 0, 80)  # the most any instruction at a line ran
    f.add(3, 1, 40)
    f.add(-1, 0, 999)  # before the function's first line: no valid offset
    f.add_call(4, 0, "leaf", 30)
    g = FunctionProfile("leaf", head=30)
    g.add(1, 0, 3000)
    cold = FunctionProfile("cold")
    assert render([f, g, cold]) == (
        "leaf:3000:30\n 1: 3000\n"
        "main:170:10\n 2: 100\n 3.1: 40\n 4: 30 leaf:30\n"
    )


def _llvm_encode(bd: int, df: int, ci: int) -> int:
    """LLVM's DILocation::encodeDiscriminator (base discriminator, duplication factor, copy id), as
    clang -fdebug-info-for-profiling writes discriminators into the line table."""

    def prefix(u: int) -> int:
        u &= 0xFFF
        return (((u & 0xFE0) << 1) | (u & 0x1F) | 0x20) if u > 0x1F else u

    ret, at, rest = 0, 0, bd + df + ci
    for c in (bd, df, ci):
        if rest <= 0:
            break
        rest -= c
        ret |= (1 if c == 0 else prefix(c) << 1) << at
        at += 1 if c == 0 else (14 if c > 0x1F else 7)
    return ret


def test_discriminators_decode_as_llvm_encodes_them() -> None:
    from cyclescope.report.llvm_sample import base_discriminator, duplication_factor

    for bd in (0, 1, 2, 5, 31, 32, 100, 4095):
        for df in (0, 1, 2, 4, 7, 8, 31, 32, 500):
            for ci in (0, 1, 3):
                d = _llvm_encode(bd, df, ci)
                assert base_discriminator(d) == bd, (bd, df, ci, d)
                assert duplication_factor(d) == max(df, 1), (bd, df, ci, d)
    assert (base_discriminator(1794), duplication_factor(1794)) == (1, 7)  # seen in clang-14's bzip2 line table
    assert (base_discriminator(2050), duplication_factor(2050)) == (1, 8)


def test_llvm_sample_nests_inlined_code_at_its_call_site() -> None:
    from cyclescope.images.dwarf import Scope
    from cyclescope.report.llvm_sample import Executed, function_profile, render

    # main declared at line 10 calls mix (declared at line 3, linkage _Z3mixmi) at line 14 with
    # base discriminator 2; mix's loop at line 5 was unrolled 4 times (duplication factor 4).
    mix = Scope(0, 0, 1, "mix", "m.c", 14, True, "_Z3mixmi", 3, _llvm_encode(2, 0, 0))
    unrolled = _llvm_encode(1, 4, 0)
    fp = function_profile("main", 10, [
        Executed(1, 11, 0),
        Executed(100, 13, 0, (), "_Z4leafm@plt"),  # a call through the PLT names the function itself
        Executed(250, 5, unrolled, (mix,)),
        Executed(240, 5, unrolled, (mix,)),  # the most any instruction at a location ran
        Executed(7, 6, 0, (mix,)),
        Executed(5, 9, 0),  # before main's first line: no valid offset, yet counted in the total
    ], head=1)
    assert render([fp]) == (
        "main:2073:1\n"
        " 1: 1\n"
        " 3: 100 _Z4leafm:100\n"
        " 4.2: _Z3mixmi:1967\n"
        "  2.1: 1000\n"
        "  3: 7\n"
    )


def test_stack_files_compact_into_one_that_counts_the_same(tmp_path: Path) -> None:
    db = Database.create_or_open(tmp_path / "db")
    epoch = db.ensure_epoch()
    keys = ["[unknown]", "buildid-a", "kernel"]
    chains = [(PERF_CONTEXT_USER, 0x401000, 0x402005), (PERF_CONTEXT_USER, 0x401000, 0x403005)]
    for i in range(5):  # five flushes of the same two stacks (i + 1 and i + 2 samples), in "prog"
        agg = StackAggregator()
        for j, chain in enumerate(chains):
            n = i + j + 1
            agg.add(_Mapper(), np.array([7] * n), np.array([0x401000] * n, np.uint64), np.zeros(n, np.int64),
                    [chain] * n, [1] * n)
        write_stacks(db, epoch, "h", agg.take(), keys, ["cpu-clock"], {f"img{i}": {"key": f"img{i}"}},
                     ["[unknown]", "prog"])
    d = stacks_dir(db, epoch, "h")

    def files() -> list[str]:
        return sorted(f.name for f in d.iterdir() if f.name.startswith("stk-"))

    full = load_stacks(db, [epoch])
    assert full.files == 5 and sum(full.counts.values()) == sum(2 * i + 3 for i in range(5))
    # A corrupt file at the third flush: compaction leaves it alone and never covers it.
    (d / "stk-00000003-00000003.parquet").rename(d / "keep")
    (d / "stk-00000003-00000003.parquet").write_bytes(b"PAR1 not really")
    before = load_stacks(db, [epoch])
    before_prog = load_stacks(db, [epoch], processes={"prog"}).counts
    assert before.files == 4 and len(before.corrupt) == 1 and before_prog == before.counts
    r = compact_stacks(db, epoch, "h")
    assert r is not None and r.merged == 2 and r.skipped_corrupt == ["stk-00000003-00000003.parquet"]
    assert r.rows_before == 4 and r.rows_after == 2  # two stacks in each of flushes 1 and 2, summed
    assert files() == ["stk-00000001-00000002.parquet", "stk-00000003-00000003.parquet",
                       "stk-00000004-00000004.parquet", "stk-00000005-00000005.parquet"]
    r = compact_stacks(db, epoch, "h")  # the run after the corrupt file
    assert r is not None and r.merged == 2
    assert files() == ["stk-00000001-00000002.parquet", "stk-00000003-00000003.parquet",
                       "stk-00000004-00000005.parquet"]
    after = load_stacks(db, [epoch])
    assert after.counts == before.counts and after.images == before.images
    assert load_stacks(db, [epoch], processes={"prog"}).counts == before_prog
    assert compact_stacks(db, epoch, "h") is None  # runs of one file around the corrupt one
    # The corrupt file mended; then a crash after a compacted file was linked but before its
    # inputs went (a copy stands in for an input): nothing counts twice, and the next compaction
    # deletes the covered file.
    (d / "keep").replace(d / "stk-00000003-00000003.parquet")
    assert load_stacks(db, [epoch]).counts == full.counts
    left = d / "stk-00000004-00000004.parquet"
    left.write_bytes((d / "stk-00000004-00000005.parquet").read_bytes())
    assert load_stacks(db, [epoch]).counts == full.counts
    r = compact_stacks(db, epoch, "h")
    assert r is not None and not left.exists()
    assert files() == ["stk-00000001-00000005.parquet"]
    assert load_stacks(db, [epoch]).counts == full.counts and load_stacks(db, [epoch]).images == full.images


def test_equal_stacks_are_summed_and_parts_with_their_own_codes_concatenate() -> None:
    rng = np.random.default_rng(5)
    shapes = [[], [(0, 16)], [(0, 16), (1, 32)], [(1, 32), (0, 16)], [(0, 16), (1, 32), (1, 48)], [(1, 16)]]
    parts, naive = [], Counter()
    for p in range(3):
        keys = ["a", "b"] if p != 1 else ["b", "a"]  # the second part codes its images the other way round
        events = ["cpu-clock", "page-faults"][:: 1 if p else -1]
        rows = [(int(rng.integers(len(shapes))), int(rng.integers(2)), float(rng.integers(1, 9))) for _ in range(40)]
        ev, count, lengths, image, offset = [], [], [], [], []
        for shape, e, c in rows:
            frames = [("ab"[i], o) for i, o in shapes[shape]]
            naive[(events[e], tuple(frames))] += int(c)
            ev.append(e)
            count.append(c)
            lengths.append(len(frames))
            image += [keys.index(k) for k, _ in frames]
            offset += [o for _, o in frames]
        parts.append(StackArrays.build(events, np.array(ev), np.array(count), np.array(lengths), keys,
                                       np.array(image, np.int32), np.array(offset, np.uint64)))
    whole = StackArrays.concat(parts)
    assert _as_counter(whole) == naive
    summed = whole.summed()
    assert _as_counter(summed) == naive and len(summed) == len(naive) < len(whole)
    assert summed.selection().counts == naive
    assert _as_counter(StackArrays.concat([]).summed()) == Counter()


def test_compaction_sums_equal_stacks_per_event_and_command_in_columns(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    db = Database.create_or_open(tmp_path / "db")
    epoch = db.ensure_epoch()
    d = db.ensure(stacks_dir(db, epoch, "h"))
    rng = np.random.default_rng(9)
    frames = [[], [("a", 16)], [("a", 16), ("b", 32)], [("b", 32), ("a", 16)], [("b", 16)]]
    naive: Counter[tuple[str, str | None, tuple[tuple[str, int], ...]]] = Counter()
    for f in range(1, 6):
        rows = [(str(rng.choice(["cpu-clock", "page-faults"])), str(rng.choice(["sh", "prog"])),
                 frames[int(rng.integers(len(frames)))], int(rng.integers(1, 9))) for _ in range(30)]
        cols: dict[str, object] = {
            "event": pa.array([r[0] for r in rows]).dictionary_encode(),
            "count": pa.array([r[3] for r in rows], pa.uint64()),
            "images": pa.array([[k for k, _ in r[2]] for r in rows], pa.list_(pa.string())),
            "offsets": pa.array([[o for _, o in r[2]] for r in rows], pa.list_(pa.uint64())),
        }
        if f != 2:  # the second file is from before commands were kept: none to sum by
            cols["process"] = pa.array([r[1] for r in rows]).dictionary_encode()
        pq.write_table(pa.table(cols), d / f"stk-{f:08d}-{f:08d}.parquet")
        for ev, pr, fr, n in rows:
            naive[(ev, pr if f != 2 else None, tuple(fr))] += n
    r = compact_stacks(db, epoch, "h")
    assert r is not None and r.merged == 5 and r.rows_after == len(naive)
    (out,) = [p for p in d.iterdir() if p.name.startswith("stk-")]
    t = pq.read_table(out)
    got: Counter[tuple[str, str | None, tuple[tuple[str, int], ...]]] = Counter()
    for ev, pr, n, im, of in zip(*(t.column(c).to_pylist() for c in ("event", "process", "count", "images",
                                                                      "offsets")), strict=True):
        got[(ev, pr, tuple(zip(im, of, strict=True)))] += n
    assert got == naive
    assert t.schema.field("images").type == pa.list_(pa.dictionary(pa.int32(), pa.string()))
