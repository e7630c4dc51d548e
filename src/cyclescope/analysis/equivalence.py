"""Frequency equivalence classes of blocks and edges: cycle equivalence (DCPI 6.1.2).

Johnson, Pearson and Pingali (PLDI 1994): add an edge EXIT -> ENTRY so the
CFG is strongly connected; then two edges execute the same number of times
in every run iff they are *cycle equivalent*, which in a strongly connected
graph equals cycle equivalence in its undirected version, where it is
decided by *bracket sets*: take a DFS spanning tree; the brackets of a tree
edge are the non-tree edges with one end inside the subtree below it and one
outside; two tree edges are equivalent iff their bracket sets are equal, and
a non-tree edge is equivalent to the tree edges whose only bracket it is.
Blocks are split into an in-node and an out-node joined by an edge, and a
block's class is that edge's class.

Instead of JPP's bracket lists with size and "recent class" bookkeeping,
each non-tree edge gets a random 64-bit label and a bracket set is
represented by the XOR of its labels: the XOR over a subtree of the labels
incident to its nodes cancels the edges with both ends inside. This is
linear time and decides equality of bracket sets up to a 2^-64 chance of a
collision per pair (the tests check it against circulations on random
graphs).

DCPI's extension for infinite loops: blocks that cannot reach EXIT get
virtual edges to EXIT (one from each sink strongly connected component),
standing for leaving by a signal or an exit in a callee. When the CFG is
missing edges, every block and edge is its own class.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from cyclescope.analysis.cfg import CFG, ENTRY, EXIT


@dataclass(frozen=True)
class Classes:
    block: list[int]  # class id per block (-1 for unreachable blocks)
    edge: list[int]  # class id per CFG edge
    count: int
    virtual_exits: list[int]  # blocks given a virtual edge to EXIT (infinite loops)

    def members(self) -> dict[int, tuple[list[int], list[int]]]:
        """class id -> (blocks, edges)."""
        out: dict[int, tuple[list[int], list[int]]] = {}
        for b, c in enumerate(self.block):
            if c >= 0:
                out.setdefault(c, ([], []))[0].append(b)
        for e, c in enumerate(self.edge):
            if c >= 0:
                out.setdefault(c, ([], []))[1].append(e)
        return out


def _node_in(b: int) -> int:
    return 2 + 2 * b


def _node_out(b: int) -> int:
    return 3 + 2 * b


def _graph_node(x: int, out: bool) -> int:
    if x == ENTRY:
        return 0
    if x == EXIT:
        return 1
    return _node_out(x) if out else _node_in(x)


def infinite_loop_exits(cfg: CFG) -> list[int]:
    """Blocks that get a virtual edge to EXIT: one per sink SCC of the blocks that cannot reach EXIT."""
    n = len(cfg.blocks)
    reach_exit = set()
    preds: dict[int, list[int]] = {b: [] for b in range(n)}
    stack = []
    for e in cfg.edges:
        if e.src >= 0 and e.dst >= 0:
            preds[e.dst].append(e.src)
        if e.dst == EXIT and e.src >= 0:
            stack.append(e.src)
    while stack:
        b = stack.pop()
        if b in reach_exit:
            continue
        reach_exit.add(b)
        stack.extend(p for p in preds[b] if p not in reach_exit)
    stuck = [b for b in range(n) if b not in reach_exit and b not in cfg.unreachable]
    if not stuck:
        return []
    comp = _sccs(stuck, _successors(cfg))
    sinks = []
    for members in comp:
        ms = set(members)
        leaves = any(cfg.edges[i].dst >= 0 and cfg.edges[i].dst not in ms and cfg.edges[i].dst in set(stuck)
                     for b in members for i in cfg.blocks[b].succs)
        if not leaves:
            sinks.append(max(members))  # the last block of the loop: usually its back-edge source
    return sorted(sinks)


def _successors(cfg: CFG) -> Callable[[int], list[int]]:
    """A block's successor blocks (EXIT left out), as _sccs takes them."""
    return lambda b: [cfg.edges[i].dst for i in cfg.blocks[b].succs if cfg.edges[i].dst >= 0]


def cyclic_blocks(cfg: CFG) -> set[int]:
    """The blocks on some cycle of the CFG (in a strongly connected component with an edge inside)."""
    succ = _successors(cfg)
    return {b for comp in _sccs(list(range(len(cfg.blocks))), succ) for b in comp
            if len(comp) > 1 or b in succ(b)}


def _sccs(nodes: list[int], succ_fn: Callable[[int], list[int]]) -> list[list[int]]:
    """Tarjan's strongly connected components, iterative (procedures can have 10^4 blocks)."""
    allowed = set(nodes)
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    on: set[int] = set()
    st: list[int] = []
    out: list[list[int]] = []
    counter = 0
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter([s for s in succ_fn(root) if s in allowed]))]
        index[root] = low[root] = counter
        counter += 1
        st.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    st.append(w)
                    on.add(w)
                    work.append((w, iter([s for s in succ_fn(w) if s in allowed])))
                    advanced = True
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = st.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(comp)
    return out


def cycle_equivalence(cfg: CFG, seed: int = 0x5EED) -> Classes:
    nb = len(cfg.blocks)
    if cfg.missing_edges:
        blocks = [b if b not in cfg.unreachable else -1 for b in range(nb)]
        return Classes(blocks, [nb + i for i in range(len(cfg.edges))], nb + len(cfg.edges), [])
    virtual = infinite_loop_exits(cfg)
    # Undirected multigraph: (u, v) per edge; refs say what each graph edge stands for.
    gu: list[int] = []
    gv: list[int] = []
    ref: list[tuple[str, int]] = []
    for e in cfg.edges:
        if (e.src >= 0 and e.src in cfg.unreachable) or (e.dst >= 0 and e.dst in cfg.unreachable):
            continue
        gu.append(_graph_node(e.src, True))
        gv.append(_graph_node(e.dst, False))
        ref.append(("edge", e.id))
    for b in range(nb):
        if b in cfg.unreachable:
            continue
        gu.append(_node_in(b))
        gv.append(_node_out(b))
        ref.append(("block", b))
    for b in virtual:
        gu.append(_node_out(b))
        gv.append(1)
        ref.append(("virtual", b))
    gu.append(1)
    gv.append(0)
    ref.append(("return", 0))
    nn = 2 + 2 * nb
    adj: list[list[int]] = [[] for _ in range(nn)]
    for i, (u, v) in enumerate(zip(gu, gv, strict=True)):
        adj[u].append(i)
        adj[v].append(i)
    # Iterative DFS from ENTRY: parent edge per node, pre-order.
    parent_edge = [-1] * nn
    seen = [False] * nn
    order: list[int] = []
    tree = [False] * len(gu)
    stack = [(0, -1)]
    while stack:
        x, pe = stack.pop()
        if seen[x]:
            continue
        seen[x] = True
        parent_edge[x] = pe
        if pe >= 0:
            tree[pe] = True
        order.append(x)
        for ei in adj[x]:
            y = gv[ei] if gu[ei] == x else gu[ei]
            if not seen[y]:
                stack.append((y, ei))
    rng = random.Random(seed)
    label = [0] * len(gu)
    w = [0] * nn
    for i in range(len(gu)):
        if not tree[i]:
            label[i] = rng.getrandbits(64) or 1
            w[gu[i]] ^= label[i]
            w[gv[i]] ^= label[i]
    # Subtree XORs in reverse pre-order give each tree edge its bracket-set hash.
    h = [0] * len(gu)
    acc = list(w)
    for x in reversed(order):
        pe = parent_edge[x]
        if pe >= 0:
            h[pe] = acc[x]
            p = gu[pe] if gv[pe] == x else gv[pe]
            acc[p] ^= acc[x]
    for i in range(len(gu)):
        if not tree[i]:
            h[i] = label[i]
    ids: dict[int, int] = {}

    def cls(hv: int) -> int:
        if hv == 0:  # a bridge: in no cycle (cannot happen once EXIT -> ENTRY is added and all reach EXIT)
            return -1
        c = ids.get(hv)
        if c is None:
            c = ids[hv] = len(ids)
        return c

    block_cls = [-1] * nb
    edge_cls = [-1] * len(cfg.edges)
    for i, (kind, r) in enumerate(ref):
        if kind == "edge":
            edge_cls[r] = cls(h[i])
        elif kind == "block":
            block_cls[r] = cls(h[i])
    return Classes(block_cls, edge_cls, len(ids), virtual)
