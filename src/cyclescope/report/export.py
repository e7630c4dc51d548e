"""Call-stack profiles in the formats other tools read: collapsed stacks (FlameGraph) and speedscope.

Pure: stacks of (image key, offset) frames, leaf first, with their counts per event, and a
function that names a frame, in; a document out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

Frame = tuple[str, int]  # (image key, offset)
Stacks = Counter[tuple[str, tuple[Frame, ...]]]  # (event, stack leaf first) -> samples
SPEEDSCOPE_SCHEMA = "https://www.speedscope.app/file-format-schema.json"


def named_stacks(stacks: Stacks, name: Callable[[Frame], str], event: str | None = None
                 ) -> Counter[tuple[str, ...]]:
    """Stacks as names, root first, summed over frames that name the same (offsets within one
    procedure become one frame). ``event``: only that event's samples."""
    out: Counter[tuple[str, ...]] = Counter()
    for (ev, stack), n in stacks.items():
        if event is not None and ev != event:
            continue
        out[tuple(name(f) for f in reversed(stack))] += n
    return out


def collapsed(named: Counter[tuple[str, ...]]) -> str:
    """Brendan Gregg's folded format: 'root;caller;leaf count' per line, heaviest first."""
    lines = []
    for frames, n in sorted(named.items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(";".join(f.replace(";", ":").replace(" ", "_") for f in frames) + f" {n}")
    return "\n".join(lines) + ("\n" if lines else "")


def speedscope(per_event: dict[str, Counter[tuple[str, ...]]], title: str,
               where: Callable[[str], tuple[str | None, int | None]] | None = None) -> dict[str, Any]:
    """A speedscope file (its published JSON schema): one 'sampled' profile per event, frames shared."""
    frames: list[dict[str, Any]] = []
    index: dict[str, int] = {}

    def fid(nm: str) -> int:
        i = index.get(nm)
        if i is None:
            i = len(frames)
            index[nm] = i
            fr: dict[str, Any] = {"name": nm}
            if where is not None:
                file, line = where(nm)
                if file:
                    fr["file"] = file
                if line:
                    fr["line"] = line
            frames.append(fr)
        return i

    profiles = []
    for ev, named in per_event.items():
        samples, weights = [], []
        for stack, n in sorted(named.items(), key=lambda kv: kv[0]):
            samples.append([fid(f) for f in stack])
            weights.append(n)
        total = sum(weights)
        profiles.append({"type": "sampled", "name": f"{title} ({ev})", "unit": "none", "startValue": 0,
                         "endValue": total, "samples": samples, "weights": weights})
    return {"$schema": SPEEDSCOPE_SCHEMA, "shared": {"frames": frames}, "profiles": profiles,
            "name": title, "activeProfileIndex": 0, "exporter": "cyclescope"}


# --- pprof ---------------------------------------------------------------------------------------

def pprof(stacks: Stacks, events: list[str], images: dict[str, dict[str, Any]],
          name: Callable[[Frame], tuple[str, str | None, int | None]], time_ns: int = 0, duration_ns: int = 0,
          period: tuple[str, int] | None = None) -> bytes:
    """A gzip-compressed profile.proto (pprof's format). ``images``: image key -> {"path", "build_id",
    "size"}; ``name(frame)`` -> (function, source file, line). One value per event (sample counts).
    Each image gets its own address range (mapping i starts at i << 40), so that locations are
    unique and fall inside their mapping; the location address is that base plus the image offset
    cyclescope stores, and functions and lines are filled in (pprof need not symbolize)."""
    import gzip

    from cyclescope.report.proto import profile_pb2 as pb

    strings: dict[str, int] = {"": 0}

    def s(x: str) -> int:
        i = strings.get(x)
        if i is None:
            i = len(strings)
            strings[x] = i
        return i

    p = pb.Profile()  # type: ignore[attr-defined]
    for ev in events:
        p.sample_type.add(type=s(ev), unit=s("count"))
    if period is not None:
        p.period_type.type = s(period[0])
        p.period_type.unit = s("nanoseconds")
        p.period = period[1]
    p.time_nanos = time_ns
    p.duration_nanos = duration_ns
    mapping_ids: dict[str, int] = {}
    location_ids: dict[Frame, int] = {}
    function_ids: dict[tuple[str, str], int] = {}
    extent: dict[str, int] = {}
    leaf_samples: Counter[str] = Counter()
    for (_, stack), n in stacks.items():
        if stack:
            leaf_samples[stack[0][0]] += n
        for key, off in stack:
            extent[key] = max(extent.get(key, 0), off + 1)
    # mapping[0] is the main binary to pprof: the image with the most samples.
    for key in sorted(extent, key=lambda k: (k == "[unknown]", -leaf_samples[k], k)):
        info = images.get(key, {})
        mid = len(mapping_ids) + 1
        mapping_ids[key] = mid
        base = mid << 40
        size = max(int(info.get("size") or 0), extent[key])
        m = p.mapping.add(id=mid, memory_start=base, memory_limit=base + size, file_offset=0,
                          filename=s(str(info.get("path") or key)), build_id=s(str(info.get("build_id") or "")))
        m.has_functions = True
        m.has_filenames = True
        m.has_line_numbers = True

    def location(f: Frame) -> int:
        lid = location_ids.get(f)
        if lid is None:
            lid = len(location_ids) + 1
            location_ids[f] = lid
            fn, file, line = name(f)
            fk = (fn, file or "")
            fid = function_ids.get(fk)
            if fid is None:
                fid = len(function_ids) + 1
                function_ids[fk] = fid
                p.function.add(id=fid, name=s(fn), system_name=s(fn), filename=s(file or ""))
            mid = mapping_ids[f[0]]
            loc = p.location.add(id=lid, mapping_id=mid, address=(mid << 40) + f[1])
            loc.line.add(function_id=fid, line=line or 0)
        return lid

    index = {ev: i for i, ev in enumerate(events)}
    merged: dict[tuple[Frame, ...], list[int]] = {}
    for (ev, stack), n in stacks.items():
        if ev not in index:
            continue
        vals = merged.setdefault(stack, [0] * len(events))
        vals[index[ev]] += n
    for stack, vals in merged.items():
        p.sample.add(location_id=[location(f) for f in stack], value=vals)
    p.string_table.extend(strings)  # dicts keep insertion order: the indices handed out above
    return gzip.compress(p.SerializeToString(), mtime=0)
