"""Values over a profile: the hotlists of the selection with the modules that format them, and the
value column of a listing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cyclescope.errors import NotFoundError, UsageError

if TYPE_CHECKING:
    from cyclescope.app.profile import Profile
    from cyclescope.db.values import ValueSelection
    from cyclescope.values.api import ValueModule


def open_values(p: Profile, uid: int | None = None, modules: list[str] | None = None
                ) -> tuple[ValueSelection, list[ValueModule]]:
    """The selection's value hotlists (of ``uid``'s processes only, if given) and the modules that
    format them: ``modules``, else those that captured them (the built-ins if one is gone)."""
    from cyclescope.values.modules import DEFAULT_MODULES, load_modules

    vs = p.values(uid)
    if not vs.files:
        hint = ""
        if vs.unreadable:
            hint = f" ({vs.unreadable} value file(s) of other users are not readable by you)"
        raise NotFoundError(f"no value samples in epoch(s) {','.join(map(str, p.ps.epochs))}{hint}; record with "
                            "--values to capture them")
    names = modules or list(vs.meta.modules if vs.meta else DEFAULT_MODULES)
    try:
        return vs, load_modules(names)
    except UsageError:
        return vs, load_modules(DEFAULT_MODULES)  # a module that is gone: format with the built-ins


def listing_values(p: Profile, image_key: str, start: int, end: int, kinds: list[str] | None = None
                   ) -> tuple[list[str], dict[int, list[str]], list[str]]:
    """`list --values`: the value columns of the instructions in [start, end) of an image, their
    cells per address, and notes on the selection's value files."""
    from cyclescope.report.values import Namer, selection_notes
    from cyclescope.report.values import listing_values as columns
    from cyclescope.values.modules import DEFAULT_MODULES, load_modules

    vs = p.values()
    if not vs.files:
        return [], {}, ["no value samples in this selection (record with --values)", *selection_notes(vs)]
    modules = load_modules(list(vs.meta.modules if vs.meta else DEFAULT_MODULES))
    namer = Namer(p.ps, p.sym, vs.hotlists.images)
    cols, cells = columns(vs.hotlists, modules, namer, image_key, start, end, kinds or None)
    return cols, cells, selection_notes(vs)
