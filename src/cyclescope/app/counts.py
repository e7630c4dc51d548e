"""Execution counts per instruction of one binary over a profile, for the profiles compilers
read (export llvm-sample and bolt-fdata, optimize): samples, calc's estimates, and calc's estimates
shaped by the branch outcomes of sampled paths (analysis/paths.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from cyclescope.errors import NotFoundError, UsageError

if TYPE_CHECKING:
    from cyclescope.app.profile import Profile
    from cyclescope.binaries.symbolize import BinaryLookup
    from cyclescope.images.registry import ImageInfo
    from cyclescope.report.prof import ProfReport


def one_binary(p: Profile, report: ProfReport, image_patterns: list[str], what: str
               ) -> tuple[str, ImageInfo, BinaryLookup]:
    """The one ELF image a per-binary profile describes (``what``: for the messages): the one
    ``image_patterns`` match, or the one with the most samples; its key, ImageInfo and the binary
    found on disk or in the archive."""
    from cyclescope.db.query import match_images

    profile_set, sym = p.profile_set, p.sym
    if image_patterns:
        keys = set(match_images(profile_set, image_patterns))
    else:
        images = profile_set.images
        elf_rows = [r for r in report.rows if r.image_key in images and images[r.image_key].kind == "elf"]
        keys = {elf_rows[0].image_key} if elf_rows else set()
    if not keys:
        raise NotFoundError("no executable image with samples in the selection (give --image)")
    if len(keys) > 1:
        raise UsageError(f"{what} describes one binary: --image matches " + ", ".join(sorted(keys)))
    (key,) = keys
    info = profile_set.images[key]
    b = sym.binary(info)
    if b.path is None:
        raise NotFoundError(b.problem or f"{info.path}: the binary is not available")
    return key, info, b


def event_counts(p: Profile, key: str, ev: str) -> tuple[np.ndarray, np.ndarray]:
    """Offsets and sample counts of event ``ev`` in the image ``key``, over the selection."""
    from cyclescope.db.query import query_counts

    t = query_counts(p.profile_set, images=[key])
    sel = np.array(t.column("event").to_pylist(), dtype=object) == ev
    return (np.array(t.column("offset").to_pylist(), np.uint64)[sel],
            np.array(t.column("count").to_pylist(), np.int64)[sel])


def sample_counts(p: Profile, info: ImageInfo, ev: str) -> dict[int, int]:
    """Samples of ``ev`` per instruction (ELF address) of the image ``info``."""
    offs, cnt = event_counts(p, info.key, ev)
    out: dict[int, int] = {}
    for a, c in zip(p.sym.offsets_to_vaddr(info, offs).tolist(), cnt.tolist(), strict=True):
        out[int(a)] = out.get(int(a), 0) + int(c)
    return out


def branch_outcomes(p: Profile, info: ImageInfo, edges_from: str | None = None) -> dict[int, dict[int, float]] | None:
    """Branch (ELF address) -> outcomes observed on sampled paths, from the database ``edges_from``
    or the selection's own value files; None when there are none (an error from ``edges_from``)."""
    from cyclescope.analysis.paths import edge_outcomes
    from cyclescope.db.layout import Database
    from cyclescope.db.values import load_values

    if not edges_from:
        return p.branch_outcomes(info) or None
    db = Database.open(edges_from)
    obs = edge_outcomes(load_values(db, db.epochs(), rng=np.random.default_rng(0)), info.key)
    if not obs:
        raise NotFoundError(f"{edges_from}: no branch outcomes of {info.path} (record them with "
                            "`record --values edges --exact interpret --interpret 32 -- CMD`)")
    return p.outcomes_at_addresses(info, obs)


def calc_counts(p: Profile, info: ImageInfo, ev: str, report: ProfReport, estimator: str = "dcpi",
                 edges: dict[int, dict[int, float]] | None = None, kept: list[tuple[str, int, int]] | None = None
                 ) -> tuple[dict[int, dict[int, int]], dict[int, int], list[str]]:
    """calc's execution estimates per instruction, for each function with samples (shaped by the
    branch outcomes ``edges`` where given: analysis/paths.py); entry counts. For each function with
    outcomes, ``kept`` gets (name, calc's count that stayed calc's, calc's count)."""
    from cyclescope.analysis.calc import path_blocks
    from cyclescope.analysis.paths import observed, shape_counts
    from cyclescope.app.calc import calc_target
    from cyclescope.app.procedures import procedure_target
    from cyclescope.errors import CycleScopeError

    col = report.events.index(ev)
    per_fn: dict[int, dict[int, int]] = {}
    heads: dict[int, int] = {}
    skipped: list[str] = []
    for r in report.rows:
        if r.image_key != info.key or r.start is None or r.counts[col] <= 0:
            continue
        target = procedure_target(p, info.key, r.procedure)
        if target is None:
            continue
        start = target.start
        try:
            # Shaped below by shape_counts, over every branch: calc's own paths step would shape twice.
            c = calc_target(p, target, ev, None, estimator, paths=False)
        except CycleScopeError as e:
            skipped.append(f"{r.procedure}: {e}")
            continue
        got: dict[int, int] = {}
        for idx, ins in enumerate(c.cfg.insns):
            bi = c.cfg.block_of[idx]
            execs = c.executions(bi) if bi >= 0 else None
            if execs is not None and round(execs) > 0:
                got[ins.address] = round(execs)
        if edges:
            blocks = path_blocks(c.cfg, c.freq)
            shaped = shape_counts(blocks, got, edges)
            if kept is not None and got and observed(blocks, edges):
                kept.append((r.procedure, shaped.kept, sum(got.values())))
            got = shaped.counts
        if got:
            per_fn[start] = got
            entry = c.cfg.block_of[0] if c.cfg.insns else -1
            head = c.executions(entry) if entry >= 0 else None
            heads[start] = round(head) if head else 0
    return per_fn, heads, skipped
