"""A symbolic checker for Plans: runs the plans of every rank of one call together, with no
tensors, and fails on anything that could give a wrong answer or hang.

Each buffer cell carries a symbolic value instead of a number: "A[row, col]" for inputs, or
"rows of A times b_j over this set of K columns" for products. Ops are simulated queue by
queue, honouring Record/Wait, joint barriers and collectives; a happens-before relation is
built alongside (queue order, events, barriers, collectives). The checks:

1. every op's inputs were written before it in happens-before order (a dropped ``after=``
   fails even when the simulated order happened to be right), and no two unordered ops touch
   the same cell when one of them writes it;
2. every ``out`` cell ends as the full product of its own row of A with b_j: first written
   with ``accumulate=False``, then accumulated over disjoint K blocks covering [0, K)
   exactly once (1d: one GEMM over all of K; 2d: one GEMM per non-empty column chunk, or one
   full-K GEMM for a hetero schedule's local shard);
3. every copy moves a rectangle of one peer's shard to the same place of this rank's buffer,
   and every remote cell of ``gathered`` is received exactly once (``gathered`` ends complete);
4. no op names an empty block;
5. nothing deadlocks (a Wait on an event recorded later on the same queue, a barrier or
   collective that not every rank reaches in the same order);
6. with ``dma``, every pull from a peer happens before the plan's last barrier, so no peer
   reuses a buffer still being read.

Row-wise fp8 scaling (``Problem.scaling == "row"``) adds the row-scale buffers: every GEMM
also reads the scales of the rows it multiplies (so rule 1 says they arrived before it, from
the same rows), scale copies and collectives move a peer's scales to the same rows, and every
remote row's scale is received exactly once.

For ``matmul_reduce_scatter`` a product cell also carries the set of ranks whose partials it
sums, and rules 2 and 3 become: every ``out`` cell of rank r ends as row ``block(r)`` of
``sum over all W ranks of a_q @ b_j`` at its own column, each rank's partial added exactly
once (sets added must be disjoint), initialised once and, for ``avg``, scaled exactly once
after the last partial arrived; a pull takes a rectangle of this rank's block from a peer's
``partial`` into that peer's slot of ``recv``. Rule 1 then also says that no partial is read
before it landed and none is overwritten before it was reduced.

Usage::

    check_plans([schedule.plan(replace(problem, rank=r), "dma") for r in range(world)])
    check_plan(plan)   # builds the other ranks' plans from the registry
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

import numpy as np

from ficco.plan import (
    SCALE_OF,
    SYMMETRIC_BUFFERS,
    AllGather,
    AllReduce,
    AllToAll,
    Barrier,
    Block,
    Copy,
    Gemm,
    Plan,
    Record,
    Reduce,
    ReduceScatter,
    SendRecv,
    Wait,
    buffer_shapes,
    source_of,
)

SCALES = tuple(SCALE_OF.values())

# Fields of a cell: its symbolic value (the first VALUE), then bookkeeping. P_RANKS: bit q set
# when rank q's partial is in the sum (reduce-scatter); P_SCALED: times ``avg`` scaled it.
A_ROW, A_COL, P_ROW, P_B, P_K, P_PARTS, P_COL, P_RANKS, P_SCALED = range(9)
VALUE = 9
WRITER, INITS, RECEIVED, READS = range(VALUE, VALUE + 4)
PRECONDITION = -2   # writer id of the caller's input: valid before every op


class PlanCheckError(AssertionError):
    pass


@dataclass
class _Buffer:
    """One rank's buffer. Per cell: the symbolic value, the node that wrote it last, how many
    times it was initialised (written other than by accumulation) and received from another
    rank, and how many reads are still unchecked against later writes (those in ``reads``)."""

    cells: np.ndarray
    reads: list = field(default_factory=list)

    @classmethod
    def empty(cls, rows: int, cols: int) -> _Buffer:
        cells = np.zeros((rows, cols, VALUE + 4), dtype=np.int64)
        cells[..., [A_ROW, A_COL, P_ROW, P_B, P_COL, WRITER]] = -1
        return cls(cells)


def _rect(blk: Block):
    return slice(blk.row0, blk.row0 + blk.rows), slice(blk.col0, blk.col0 + blk.cols)


def _equally_spaced(blocks) -> bool:
    first = blocks[0]
    spacing = blocks[1].row0 - first.row0 if len(blocks) > 1 else first.rows
    return spacing >= first.rows and all(
        (b.buf, b.peer, b.index, b.rows, b.col0, b.cols)
        == (first.buf, first.peer, first.index, first.rows, first.col0, first.cols)
        and b.row0 == first.row0 + i * spacing for i, b in enumerate(blocks))


class _Checker:
    #: collectives: every rank's op runs at once, by this method
    JOINT: ClassVar[dict] = {AllGather: "run_all_gather", AllToAll: "run_all_to_all",
                             ReduceScatter: "run_reduce_scatter", SendRecv: "run_send_recv",
                             AllReduce: "run_all_reduce"}
    #: the buffers a Reduce may write, and a GEMM of partial products
    REDUCE_INTO: tuple[str, ...] = ("out",)
    GEMM_INTO: tuple[str, ...] = ("partial", "out")

    def first_row(self, rank: int, buf: str) -> int:
        """Which row of the M rows row 0 of ``buf`` holds on ``rank`` (the reduce-scatter's
        ``out`` is the rank's block)."""
        return self.p.block(rank)[0] if buf == "out" else 0

    def __init__(self, plans: list[Plan]):
        self.plans = plans
        self.p = plans[0].problem
        p = self.p
        if p.k > 62:
            raise PlanCheckError(f"the checker tracks K in a 62-bit mask; use k <= 62, got {p.k}")
        if len(plans) != p.world or [pl.problem.rank for pl in plans] != list(range(p.world)):
            raise PlanCheckError("check_plans needs the plans of ranks 0..W-1, in rank order; "
                                 f"got ranks {[pl.problem.rank for pl in plans]} for W={p.world}")
        for pl in plans:
            same_call = (replace(pl.problem, rank=0), pl.schedule, pl.transport) \
                == (replace(p, rank=0), plans[0].schedule, plans[0].transport)
            if not same_call:
                raise PlanCheckError("all ranks' plans must be of one schedule, transport and "
                                     f"problem; got {pl.schedule}/{pl.transport}/{pl.problem}")
        self.node_of: list[tuple] = []   # node -> (rank, op index, op), for messages
        self.hb: list[int] = []        # node -> bitset of the nodes that happen before it
        self.buffers = [self._rank_buffers(pl) for pl in plans]
        self.remote_reads: list[int] = []
        self.barrier_nodes: dict[int, list[int]] = {}

    def _rank_buffers(self, plan: Plan) -> dict:
        p = plan.problem
        bufs = {source: _Buffer.empty(*shape) for source, shape in buffer_shapes(p).items()}
        inp = bufs[("input",)].cells
        inp[..., A_ROW] = (0 if p.reduces else p.shard_row0(p.rank)) + np.arange(p.m)[:, None]
        inp[..., A_COL] = np.arange(p.k)[None, :]
        inp[..., WRITER] = PRECONDITION
        if ("input_scale",) in bufs:   # the scale of each of the input's rows
            scale = bufs[("input_scale",)].cells
            scale[..., A_ROW] = inp[:, :1, A_ROW]
            scale[..., A_COL] = 0
            scale[..., WRITER] = PRECONDITION
        return bufs

    def read_scales(self, rank: int, a_blk: Block, rows: np.ndarray, node: int) -> None:
        """Row-wise fp8: a GEMM reads the scales of the rows it multiplies."""
        if self.p.scaling != "row":
            return
        blk = Block(SCALE_OF[a_blk.buf], a_blk.row0, a_blk.rows, 0, 1, a_blk.peer)
        got = self.read(rank, blk, node)[:, 0, A_ROW]
        if not np.array_equal(got, rows.reshape(-1)):
            self.fail(f"{self.label(node)} multiplies rows {rows.reshape(-1)[:4]}.. by the "
                      f"scales of rows {got[:4]}..")

    # -- reporting ----------------------------------------------------------------------------
    def fail(self, msg: str):
        pl = self.plans[0]
        raise PlanCheckError(f"{pl.schedule} over {pl.transport}, {self.p}: {msg}")

    # -- happens-before -----------------------------------------------------------------------
    def label(self, node: int) -> str:
        r, i, op = self.node_of[node]
        return f"rank {r} op {i} ({op.kind} on {op.queue}, step {getattr(op, 'step', '-')})"

    def new_node(self, who: tuple, preds) -> int:
        bits = 0
        for pr in preds:
            if pr is not None:
                bits |= self.hb[pr] | (1 << pr)
        self.hb.append(bits)
        self.node_of.append(who)
        return len(self.hb) - 1

    def before(self, a: int, b: int) -> bool:
        return a == PRECONDITION or a == b or bool((self.hb[b] >> a) & 1)

    # -- buffer access ------------------------------------------------------------------------
    def buffer(self, rank: int, blk: Block) -> tuple[int, _Buffer]:
        owner = rank if blk.peer is None else blk.peer
        if not 0 <= owner < self.p.world:
            self.fail(f"block names peer {blk.peer}, outside the group: {blk}")
        if blk.peer is not None and blk.buf not in SYMMETRIC_BUFFERS:
            self.fail(f"only {SYMMETRIC_BUFFERS} are symmetric; a peer's {blk.buf!r} cannot be "
                      f"read: {blk}")
        buf = self.buffers[owner].get(source_of(blk))
        if buf is None:
            self.fail(f"rank {rank}: block names a buffer that does not exist: {blk}")
        rows, cols = buf.cells.shape[:2]
        if blk.rows <= 0 or blk.cols <= 0:
            self.fail(f"rank {rank}: op names an empty block {blk}")
        if blk.row0 + blk.rows > rows or blk.col0 + blk.cols > cols:
            self.fail(f"rank {rank}: block {blk} lies outside its {rows} x {cols} buffer")
        return owner, buf

    def read(self, rank: int, blk: Block, node: int) -> np.ndarray:
        owner, buf = self.buffer(rank, blk)
        cells = buf.cells[_rect(blk)]
        for w in set(cells[..., WRITER].ravel().tolist()):
            if w == -1:
                self.fail(f"{self.label(node)} reads cells of {blk} that nothing wrote")
            if not self.before(w, node):
                self.fail(f"{self.label(node)} reads {blk}, written by "
                          f"{self.label(w)}, with no dependency between them")
        cells[..., READS] += 1
        buf.reads.append((blk, node))
        if owner != rank:
            self.remote_reads.append(node)
        return cells[..., :VALUE]        # a view: callers copy before changing it

    def write(self, rank: int, blk: Block, node: int, value: np.ndarray, *, init: bool,
              received: bool = False) -> None:
        _, buf = self.buffer(rank, blk)
        cells = buf.cells[_rect(blk)]
        for w in set(cells[..., WRITER].ravel().tolist()):
            if w >= 0 and not self.before(w, node):
                self.fail(f"{self.label(node)} and {self.label(w)} both write "
                          f"{blk} with no order between them")
        if cells[..., READS].any():
            kept = []
            for other, reader in buf.reads:
                if not _overlap(other, blk):
                    kept.append((other, reader))
                    continue
                if reader != node and not self.before(reader, node):
                    self.fail(f"{self.label(node)} overwrites {blk} while "
                              f"{self.label(reader)} may still read it (no dependency)")
                if _inside(other, blk):
                    # Every later writer of these cells must come after this one (checked
                    # above), hence after this reader too: no need to look at it again.
                    buf.cells[_rect(other)][..., READS] -= 1
                else:
                    kept.append((other, reader))
            buf.reads = kept
        cells[..., :VALUE] = value
        cells[..., WRITER] = node
        cells[..., INITS] += init
        cells[..., RECEIVED] += received

    # -- ops ----------------------------------------------------------------------------------
    def run_copy(self, rank: int, op: Copy, node: int) -> None:
        p, src, dst = self.p, op.src, op.dst
        if p.reduces:
            return self.run_pull_partial(rank, op, node)
        if src.buf in SCALES:   # a row's scale, moving with the row
            return self.run_scale_copy(rank, op, node)
        if src.buf == "input":
            expect = Block("gathered", p.shard_row0(rank) + src.row0, src.rows, src.col0, src.cols)
        elif src.buf == "gathered" and src.peer is not None and src.peer != rank:
            m = max(p.m, 1)
            owner_first, owner_last = src.row0 // m, (src.row0 + src.rows - 1) // m
            if owner_first != src.peer or owner_last != src.peer:
                self.fail(f"{self.label(node)} pulls rows of shards "
                          f"{owner_first}..{owner_last} from peer {src.peer}")
            expect = replace(src, peer=None)
        else:
            self.fail(f"{self.label(node)}: a copy must publish input or pull a peer's shard")
        if dst != expect:
            self.fail(f"{self.label(node)} lands in {dst}, expected {expect}")
        if op.two_d != (src.cols != p.k):
            self.fail(f"{self.label(node)}: two_d={op.two_d} but it moves {src.cols} of "
                      f"{p.k} columns")
        value = self.read(rank, src, node).copy()   # src may be dst's own buffer
        self.write(rank, dst, node, value, init=True, received=src.buf != "input")

    def run_scale_copy(self, rank: int, op: Copy, node: int) -> None:
        p, src = self.p, op.src
        if src.buf == "input_scale":
            expect = Block("gathered_scale", p.shard_row0(rank) + src.row0, src.rows, 0, 1)
        elif src.peer is not None and src.peer != rank \
                and p.shard_row0(src.peer) <= src.row0 \
                and src.row0 + src.rows <= p.shard_row0(src.peer) + p.m:
            expect = replace(src, peer=None)
        else:
            self.fail(f"{self.label(node)}: a scale copy must publish input_scale or pull "
                      f"the scales of a peer's shard rows; got {src}")
        if op.dst != expect or op.two_d or (src.col0, src.cols) != (0, 1):
            self.fail(f"{self.label(node)} moves scales {src} to {op.dst}, expected {expect}")
        self.write(rank, op.dst, node, self.read(rank, src, node).copy(), init=True,
                   received=src.buf != "input_scale")

    def run_pull_partial(self, rank: int, op: Copy, node: int) -> None:
        p, src = self.p, op.src
        row0, rows = p.block(rank)
        if src.buf != "partial" or src.peer in (None, rank) \
                or not row0 <= src.row0 <= src.row0 + src.rows <= row0 + rows:
            self.fail(f"{self.label(node)}: a copy must pull rows of this rank's block from a "
                      f"peer's partial; got {src}")
        expect = Block("recv", src.peer * rows + src.row0 - row0, src.rows, src.col0, src.cols,
                       index=src.index)
        if op.dst != expect:
            self.fail(f"{self.label(node)} lands in {op.dst}, expected {expect}")
        if op.two_d != (src.cols != p.ns[src.index]):
            self.fail(f"{self.label(node)}: two_d={op.two_d} but it moves {src.cols} of "
                      f"{p.ns[src.index]} columns")
        self.write(rank, op.dst, node, self.read(rank, src, node).copy(), init=True,
                   received=True)

    def run_gemm_rs(self, rank: int, op: Gemm, node: int) -> None:
        """Reduce-scatter GEMM: rows of this rank's ``a`` (all of K) times columns of b_j,
        into ``partial`` or (this rank's own block) ``out``; accumulating adds its rank."""
        p, label = self.p, self.label(node)
        if not op.a or len(op.a) != len(op.out) or (op.k0, op.kc) != (0, p.k) \
                or not 0 <= op.b < len(p.ns):
            self.fail(f"{label}: malformed GEMM (reduce-scatter GEMMs take all of K)")
        if not (_equally_spaced(op.a) and _equally_spaced(op.out)):
            self.fail(f"{label}: a fused GEMM needs same-shape, equally spaced blocks")
        for a_blk, o_blk in zip(op.a, op.out):
            if a_blk.buf != "input" or (a_blk.col0, a_blk.cols) != (0, p.k) \
                    or a_blk.rows != o_blk.rows or o_blk.index != op.b \
                    or o_blk.buf not in self.GEMM_INTO or o_blk.peer is not None:
                self.fail(f"{label}: block shapes do not match ({a_blk} -> {o_blk})")
            rows = self.read(rank, a_blk, node)[:, :1, A_ROW]
            self.read_scales(rank, a_blk, rows, node)
            # The output row a GEMM writes must be the row of a it multiplies.
            where = o_blk.row0 + self.first_row(rank, o_blk.buf)
            if not np.array_equal(rows[:, 0], np.arange(where, where + o_blk.rows)):
                self.fail(f"{label} writes the product of a rows {rows[0, 0]}.. into {o_blk}")
            value = np.full((o_blk.rows, o_blk.cols, VALUE), -1, dtype=np.int64)
            value[..., P_ROW], value[..., P_B] = rows, op.b
            value[..., P_COL] = o_blk.col0 + np.arange(o_blk.cols)[None, :]
            value[..., P_K], value[..., P_PARTS] = (1 << p.k) - 1, 1
            value[..., P_RANKS], value[..., P_SCALED] = 1 << rank, 0
            if op.accumulate:
                value = self.add(label, [self.read(rank, o_blk, node).copy(), value])
            self.write(rank, o_blk, node, value, init=not op.accumulate)

    def add(self, label: str, values: list[np.ndarray]) -> np.ndarray:
        """The symbolic sum of partial products: same row, b and column everywhere, disjoint
        rank sets, nothing scaled yet."""
        first = values[0]
        for v in values:
            if not ((v[..., P_ROW] == first[..., P_ROW]).all() and (v[..., P_B] == first[..., P_B]).all()
                    and (v[..., P_COL] == first[..., P_COL]).all() and (v[..., P_ROW] >= 0).all()):
                self.fail(f"{label} adds partials of different rows, b or columns")
            if (v[..., P_K] != (1 << self.p.k) - 1).any() or v[..., P_SCALED].any():
                self.fail(f"{label} adds a partial that is incomplete in K or already scaled")
        total = first.copy()
        for v in values[1:]:
            if (total[..., P_RANKS] & v[..., P_RANKS]).any():
                self.fail(f"{label} adds some rank's partial twice")
            total[..., P_RANKS] |= v[..., P_RANKS]
            total[..., P_PARTS] += v[..., P_PARTS]
        return total

    def scaled(self, label: str, value: np.ndarray, scale) -> np.ndarray:
        if scale is not None:
            if scale != 1.0 / self.p.world or self.p.reduce_op != "avg" \
                    or (value[..., P_RANKS] != (1 << self.p.world) - 1).any():
                self.fail(f"{label} scales by {scale} before every partial is in, or not for "
                          f"avg over W={self.p.world}")
            value = value.copy()
            value[..., P_SCALED] += 1
        return value

    def run_reduce(self, rank: int, op: Reduce, node: int) -> None:
        label = self.label(node)
        if op.dst.buf not in self.REDUCE_INTO or (not op.srcs and not op.accumulate) \
                or any((s.rows, s.cols) != (op.dst.rows, op.dst.cols) for s in op.srcs):
            self.fail(f"{label}: a Reduce sums same-shape blocks into {self.REDUCE_INTO}")
        values = [self.read(rank, s, node).copy() for s in op.srcs]
        if op.accumulate:
            values.insert(0, self.read(rank, op.dst, node).copy())
        self.write(rank, op.dst, node, self.scaled(label, self.add(label, values), op.scale),
                   init=not op.accumulate)

    def run_gemm(self, rank: int, op: Gemm, node: int) -> None:
        p = self.p
        if p.reduces:
            return self.run_gemm_rs(rank, op, node)
        label = self.label(node)
        if not op.a or len(op.a) != len(op.out) or op.kc <= 0 or op.k0 < 0 \
                or op.k0 + op.kc > p.k or not 0 <= op.b < len(p.ns):
            self.fail(f"{label}: malformed GEMM (blocks, b or K range)")
        if not (_equally_spaced(op.a) and _equally_spaced(op.out)):
            self.fail(f"{label}: a fused GEMM needs same-shape, equally spaced blocks")
        mask = ((1 << op.kc) - 1) << op.k0
        for a_blk, o_blk in zip(op.a, op.out):
            if a_blk.rows != o_blk.rows or a_blk.cols != op.kc or o_blk.col0 != 0 \
                    or o_blk.cols != p.ns[op.b] or (o_blk.buf == "out" and o_blk.index != op.b) \
                    or o_blk.buf not in ("out", "stage"):
                self.fail(f"{label}: block shapes do not match ({a_blk} -> {o_blk}, "
                          f"kc={op.kc}, n={p.ns[op.b]})")
            a = self.read(rank, a_blk, node)
            rows = a[:, :1, A_ROW]
            if not (np.array_equal(a[..., A_COL], np.broadcast_to(
                    np.arange(op.k0, op.k0 + op.kc), a.shape[:2]))
                    and (a[..., A_ROW] == rows).all() and rows.min() >= 0):
                self.fail(f"{label} reads {a_blk}, which does not hold A[:, {op.k0}:"
                          f"{op.k0 + op.kc}] rows")
            self.read_scales(rank, a_blk, rows, node)
            if op.accumulate:
                out = self.read(rank, o_blk, node).copy()
                if not ((out[..., P_ROW] == rows).all() and (out[..., P_B] == op.b).all()
                        and not (out[..., P_K] & mask).any()):
                    self.fail(f"{label} accumulates into {o_blk}, which holds another row or "
                              f"b, or already has some of K[{op.k0}:{op.k0 + op.kc}]")
                out[..., P_K] |= mask
                out[..., P_PARTS] += 1
            else:
                out = np.full((o_blk.rows, o_blk.cols, VALUE), -1, dtype=np.int64)
                out[..., P_ROW], out[..., P_B] = rows, op.b
                out[..., P_K], out[..., P_PARTS] = mask, 1
            self.write(rank, o_blk, node, out, init=not op.accumulate)

    # -- joint ops ----------------------------------------------------------------------------
    def run_all_gather(self, heads: list[tuple[AllGather, int]]) -> None:
        first = heads[0][0]
        shapes = {(op.src.rows, op.src.cols, len(op.dsts)) for op, _ in heads}
        if len(shapes) != 1 or len(first.dsts) != self.p.world:
            self.fail(f"ranks disagree on an all-gather's shape or it has not W destinations: "
                      f"{sorted(shapes)}")
        values = [self.read(r, op.src, node).copy() for r, (op, node) in enumerate(heads)]
        for r, (op, node) in enumerate(heads):
            for q, d in enumerate(op.dsts):
                expect_row0 = self.p.shard_row0(q) + op.src.row0 - self.p.shard_row0(r) \
                    if op.src.buf == "gathered" else self.p.shard_row0(q) + op.src.row0
                if op.src.buf in SCALES:
                    expect_row0 = self.p.shard_row0(q) + op.src.row0 - (
                        self.p.shard_row0(r) if op.src.buf == "gathered_scale" else 0)
                want = "gathered_scale" if op.src.buf in SCALES else "gathered"
                if (d.buf, d.peer, d.row0, d.rows, d.col0, d.cols) != (
                        want, None, expect_row0, op.src.rows, op.src.col0, op.src.cols):
                    self.fail(f"{self.label(node)}: destination {q} is {d}, not the "
                              f"same rectangle of shard {q}")
                self.write(r, d, node, values[q], init=True, received=q != r)

    def run_all_to_all(self, heads: list[tuple[AllToAll, int]]) -> None:
        world = self.p.world
        for r, (op, node) in enumerate(heads):
            if len(op.srcs) != world or len(op.dsts) != world or op.srcs[r] or op.dsts[r]:
                self.fail(f"{self.label(node)}: an all-to-all has W entries and none to itself")
            for q in range(world):
                other = heads[q][0].dsts[r]
                mine = op.srcs[q]
                if (mine is None) != (other is None) or (mine is not None and (
                        mine.rows, mine.cols) != (other.rows, other.cols)):
                    self.fail(f"{self.label(node)} sends {mine} to rank {q}, which expects "
                              f"{other}")
        values = {(r, q): self.read(r, op.srcs[q], node).copy()
                  for r, (op, node) in enumerate(heads) for q in range(world) if op.srcs[q]}
        for r, (op, node) in enumerate(heads):
            for q, d in enumerate(op.dsts):
                if d is not None:
                    self.write(r, d, node, values[(q, r)], init=True, received=True)

    def run_reduce_scatter(self, heads: list[tuple[ReduceScatter, int]]) -> None:
        world = self.p.world
        for r, (op, node) in enumerate(heads):
            for q in range(world):
                mine, theirs = op.srcs[q], heads[q][0].dst
                if (mine is None) != (theirs is None) or (mine is not None and (
                        mine.rows, mine.cols) != (theirs.rows, theirs.cols)):
                    self.fail(f"{self.label(node)}: its piece for rank {q} is {mine}, rank "
                              f"{q} receives {theirs}")
        sums = {}
        for q in range(world):
            if heads[q][0].dst is not None:
                label = self.label(heads[q][1])
                parts = [self.read(r, op.srcs[q], node).copy() for r, (op, node) in
                         enumerate(heads)]
                sums[q] = self.scaled(label, self.add(label, parts), heads[q][0].scale)
        for q, (op, node) in enumerate(heads):
            if op.dst is not None:
                self.write(q, op.dst, node, sums[q], init=True, received=True)

    def run_all_reduce(self, heads: list[tuple[AllReduce, int]]) -> None:
        shapes = {(op.src.rows, op.src.cols, op.dst.rows, op.dst.cols) for op, _ in heads}
        if len(shapes) != 1 or len({(op.src.row0, op.dst.row0) for op, _ in heads}) != 1:
            self.fail(f"ranks disagree on an all-reduce's rectangles: {sorted(shapes)}")
        label = self.label(heads[0][1])
        parts = [self.read(r, op.src, node).copy() for r, (op, node) in enumerate(heads)]
        total = self.scaled(label, self.add(label, parts), heads[0][0].scale)
        for r, (op, node) in enumerate(heads):
            self.write(r, op.dst, node, total, init=True, received=True)

    def run_send_recv(self, heads: list[tuple[SendRecv, int]]) -> None:
        for r, (op, node) in enumerate(heads):
            if op.send is not None:
                peer, peer_node = heads[op.send_to]
                if peer.recv_from != r or peer.recv is None \
                        or (peer.recv.rows, peer.recv.cols) != (op.send.rows, op.send.cols):
                    self.fail(f"{self.label(node)} sends to rank {op.send_to}, whose "
                              f"matching op {self.label(peer_node)} does not receive it")
        values = {r: self.read(r, op.send, node).copy() for r, (op, node) in enumerate(heads)
                  if op.send is not None}
        for r, (op, node) in enumerate(heads):
            if op.recv is not None:
                if op.recv_from not in values:
                    self.fail(f"{self.label(node)} waits for rank {op.recv_from}, which "
                              "sends nothing")
                self.write(r, op.recv, node, values[op.recv_from], init=True, received=True)

    # -- the simulation -----------------------------------------------------------------------
    def simulate(self) -> None:
        queues = [{q: [i for i, op in enumerate(pl.ops) if op.queue == q] for q in pl.queues}
                  for pl in self.plans]
        for r, pl in enumerate(self.plans):
            extra = {op.queue for op in pl.ops} - set(pl.queues)
            if extra:
                self.fail(f"rank {r}: ops on queues {sorted(extra)} missing from Plan.queues")
        pos = [{q: 0 for q in qs} for qs in queues]
        last = [{q: None for q in qs} for qs in queues]
        recorded = [{} for _ in self.plans]

        def head(r, q):
            i = pos[r][q]
            return (queues[r][q][i], self.plans[r].ops[queues[r][q][i]]) \
                if i < len(queues[r][q]) else (None, None)

        def advance(r, q, node):
            last[r][q] = node
            pos[r][q] += 1

        progress = True
        while progress:
            progress = False
            for r, pl in enumerate(self.plans):
                for q in queues[r]:
                    while True:
                        i, op = head(r, q)
                        if op is None or isinstance(op, (Barrier, *self.JOINT)):
                            break
                        if isinstance(op, Wait) and op.event not in recorded[r]:
                            break
                        preds = [last[r][q]]
                        if isinstance(op, Wait):
                            preds.append(recorded[r][op.event])
                        node = self.new_node((r, i, op), preds)
                        if isinstance(op, Record):
                            if op.event in recorded[r]:
                                self.fail(f"rank {r}: event {op.event} is recorded twice")
                            recorded[r][op.event] = node
                        elif isinstance(op, Copy):
                            self.run_copy(r, op, node)
                        elif isinstance(op, Gemm):
                            self.run_gemm(r, op, node)
                        elif isinstance(op, Reduce):
                            self.run_reduce(r, op, node)
                        advance(r, q, node)
                        progress = True
            progress |= self.joint_step(queues, head, last, advance)
        stuck = [f"rank {r} {q}: {head(r, q)[1]}" for r in range(len(self.plans))
                 for q in queues[r] if head(r, q)[1] is not None]
        if stuck:
            self.fail("deadlock: these queue heads can never run: " + "; ".join(stuck[:6]))

    def joint_step(self, queues, head, last, advance) -> bool:
        """Run one barrier or collective that every rank has reached, if any."""
        world = len(self.plans)
        barrier_heads = [{} for _ in range(world)]
        comm_heads = []
        for r in range(world):
            for q in queues[r]:
                i, op = head(r, q)
                if isinstance(op, Barrier):
                    barrier_heads[r][op.channel] = (q, i, op)
            comm_heads.append(head(r, "comm") if "comm" in queues[r] else (None, None))
        for channel in barrier_heads[0]:
            if all(channel in bh for bh in barrier_heads):
                parts = [bh[channel] for bh in barrier_heads]
                preds = [last[r][q] for r, (q, _, _) in enumerate(parts)]
                nodes = [self.new_node((r, i, op), preds) for r, (_, i, op) in enumerate(parts)]
                for r, (q, _, _) in enumerate(parts):
                    advance(r, q, nodes[r])
                self.barrier_nodes[channel] = nodes
                return True
        kinds = {type(op) for _, op in comm_heads}
        if len(kinds) == 1 and next(iter(kinds)) in self.JOINT:
            preds = [last[r]["comm"] for r in range(world)]
            heads = [(op, self.new_node((r, i, op), preds))
                     for r, (i, op) in enumerate(comm_heads)]
            getattr(self, self.JOINT[next(iter(kinds))])(heads)
            for r, (_, node) in enumerate(heads):
                advance(r, "comm", node)
            return True
        return False

    # -- final state --------------------------------------------------------------------------
    def check_results_rs(self) -> None:
        p = self.p
        for r, bufs in enumerate(self.buffers):
            row0, _ = p.block(r)
            for j in range(len(p.ns)):
                v = bufs[("out", j)].cells
                inits = v[..., INITS]
                if not (inits == 1).all():
                    self.fail(f"rank {r}: out[{j}] cells are initialised "
                              f"{sorted(set(inits.ravel().tolist()))} times, expected once")
                self.check_sums(r, j, v, row0)

    def check_sums(self, r: int, j: int, v: np.ndarray, row0: int) -> None:
        """Rank ``r``'s ``out[j]`` cells ``v``, first row ``row0`` of the M rows: each is its
        own row and column of the sum over all W ranks' partials, scaled once for avg."""
        p = self.p
        everyone = (1 << p.world) - 1
        scaled = 1 if p.reduce_op == "avg" and p.world > 1 else 0
        good = ((v[..., P_ROW] == row0 + np.arange(v.shape[0])[:, None]) & (v[..., P_B] == j)
                & (v[..., P_COL] == np.arange(p.ns[j])[None, :]))
        if not good.all():
            bad = np.argwhere(~good)[0]
            self.fail(f"rank {r}: out[{j}] cell {tuple(bad)} holds row "
                      f"{v[tuple(bad) + (P_ROW,)]} col {v[tuple(bad) + (P_COL,)]}")
        if not (v[..., P_RANKS] == everyone).all():
            missing = sorted(set(v[..., P_RANKS].ravel().tolist()))
            self.fail(f"rank {r}: out[{j}] is not reduced over all {p.world} partials "
                      f"(rank sets {missing})")
        if not (v[..., P_SCALED] == scaled).all():
            self.fail(f"rank {r}: out[{j}] scaled {sorted(set(v[..., P_SCALED].ravel()))}"
                      f" times for {p.reduce_op}, expected {scaled}")

    def check_results(self) -> None:
        p, name = self.p, self.plans[0].schedule
        if p.reduces:
            self.check_results_rs()
            self.check_closing_barrier()
            return
        chunks_k = sum(1 for _, kc in p.col_chunks() if kc)
        full = (1 << p.k) - 1
        for r, bufs in enumerate(self.buffers):
            rows = np.arange(p.big_m)[:, None]
            for j in range(len(p.ns)):
                out = bufs[("out", j)]
                v, inits = out.cells, out.cells[..., INITS]
                if not (inits == 1).all():
                    bad = np.argwhere(inits != 1)[0]
                    self.fail(f"rank {r}: out[{j}] row {bad[0]} is initialised "
                              f"{inits[tuple(bad)]} times, expected once")
                if not ((v[..., P_ROW] == rows).all() and (v[..., P_B] == j).all()
                        and (v[..., P_K] == full).all()):
                    bad = np.argwhere((v[..., P_ROW] != rows) | (v[..., P_K] != full))
                    where = f" (first bad row {bad[0][0]})" if len(bad) else ""
                    self.fail(f"rank {r}: out[{j}] is not A @ b_{j} over all of K{where}")
                expect = np.ones(p.big_m, dtype=np.int64)
                if name.endswith("-2d"):
                    expect[:] = chunks_k
                    if name.startswith("hetero"):
                        expect[p.shard_row0(r): p.shard_row0(r) + p.m] = 1
                if not (v[..., P_PARTS] == expect[:, None]).all():
                    self.fail(f"rank {r}: out[{j}] rows are summed from "
                              f"{sorted(set(v[..., P_PARTS].ravel().tolist()))} K blocks, "
                              f"expected {sorted(set(expect.tolist()))}")
            if p.world > 1:
                g = bufs[("gathered",)]
                if not ((g.cells[..., A_ROW] == rows).all()
                        and (g.cells[..., A_COL] == np.arange(p.k)[None, :]).all()):
                    self.fail(f"rank {r}: gathered does not end as the full A")
                remote = np.ones(p.big_m, dtype=bool)
                remote[p.shard_row0(r): p.shard_row0(r) + p.m] = False
                received = g.cells[..., RECEIVED][remote]
                if not (received == 1).all():
                    self.fail(f"rank {r}: remote cells of gathered are received "
                              f"{sorted(set(received.ravel().tolist()))} times, "
                              "expected exactly once")
                if p.scaling == "row":
                    sc = bufs[("gathered_scale",)].cells
                    if not ((sc[..., A_ROW] == rows).all()
                            and (sc[..., RECEIVED][remote] == 1).all()):
                        self.fail(f"rank {r}: gathered_scale does not end as every row's "
                                  f"scale, each remote one received exactly once")
        self.check_closing_barrier()

    def check_closing_barrier(self) -> None:
        if self.remote_reads:
            closing = self.barrier_nodes.get(max(self.barrier_nodes, default=-1))
            if closing is None or not all(self.before(n, closing[0]) for n in self.remote_reads):
                self.fail("a pull from a peer is not followed by a closing barrier: the peer "
                          "could reuse its buffer while it is still being read")


def _inside(a: Block, b: Block) -> bool:
    return (b.row0 <= a.row0 and a.row0 + a.rows <= b.row0 + b.rows
            and b.col0 <= a.col0 and a.col0 + a.cols <= b.col0 + b.cols)


def _overlap(a: Block, b: Block) -> bool:
    return (a.row0 < b.row0 + b.rows and b.row0 < a.row0 + a.rows
            and a.col0 < b.col0 + b.cols and b.col0 < a.col0 + a.cols)


def check_plans(plans: list[Plan], checker_class: type[_Checker] = _Checker) -> None:
    """Check the plans of every rank of one call (``plans[r]`` is rank r's); raises
    :class:`PlanCheckError` naming the schedule, problem, rank and op that break a rule.
    ``checker_class``: the checker of the op's rules (the all-reduce's is in
    ``tests/ar_plan_checks.py``).

    >>> from ficco.schedules import get
    >>> from ficco.plan.problem import Problem
    >>> check_plans([get("ring").plan(Problem(4, 8, (8,), "float32", 2, r)) for r in (0, 1)])
    """
    checker = checker_class(list(plans))
    checker.simulate()
    checker.check_results()
    for plan in plans:
        channels = [op.channel for op in plan.ops if isinstance(op, Barrier)]
        if channels != [i % 2 for i in range(len(channels))] or len(channels) % 2:
            raise PlanCheckError(
                f"{plan.schedule} over {plan.transport}, rank {plan.problem.rank}: barrier "
                f"channels {channels} must alternate 0, 1, … and end on 1 (flag protocol)")



def all_ranks(schedule, problem, transport, copy_engines=None) -> list[Plan]:
    """``schedule``'s plans of ``problem`` for every rank, in rank order."""
    return [schedule.plan(replace(problem, rank=r), transport, copy_engines)
            for r in range(problem.world)]


def check_plan(plan: Plan) -> None:
    """Check one rank's plan against its peers' plans, rebuilt from the schedule registry
    with the same transport and as many copy queues as ``plan`` uses."""
    from ficco.schedules import get

    p = plan.problem
    engines = len([q for q in plan.queues if q.startswith("copy")]) or None
    schedule = get(plan.schedule, op=p.op)
    plans = [plan if r == p.rank else
             schedule.plan(replace(p, rank=r), plan.transport, copy_engines=engines)
             for r in range(p.world)]
    check_plans(plans)
