"""Which CTA barriers of a PTX kernel sit under control flow that a per-thread value decides.

A CTA barrier (``bar.sync``, ``barrier.sync``, ``bar.red``, and every ``.aligned`` collective
such as ``wgmma.*.sync.aligned``) must be reached by every thread of the CTA (warpgroup) the
same number of times. When a branch around one (an ``if``, or a loop's exit) is decided by a
value that differs between threads, warps reach different barrier instances: a hang, or a
barrier that pairs one warp's first iteration with another's second (shared-memory tiles read
half-written).

The analysis is a divergence analysis on the PTX text:

- *per-thread sources*: the special registers ``%tid``, ``%laneid``, ``%warpid``, the clocks
  (``%globaltimer``, ``%clock``, ``%clock64``); loads whose value may change while the kernel
  runs (``ld.volatile``, ``ld.*.acquire``/``.relaxed``), atomics, shuffles, votes and
  ``mbarrier`` tests; any instruction executed under a per-thread guard (``@%p``: the other
  threads keep the register's old value);
- a result is per-thread when an operand is, and every register written in a region that
  a per-thread branch decides (the blocks reachable from the branch before its immediate
  post-dominator) is per-thread after it;
- loads of shared memory at a CTA-uniform address (Triton's broadcast: one thread stores, a
  barrier, every thread loads the same word) and plain global loads at a uniform address
  (tables that do not change) are uniform.

:func:`divergent_barriers` lists the barriers in such a region or under a per-thread guard.
The analysis knows nothing of values, so it is conservative: a branch on a shuffle's result
counts as per-thread even where the shuffles made it warp-uniform.
"""
from __future__ import annotations

import re

_REG = re.compile(r"%[a-z]+\d+")
_SPECIAL = re.compile(r"%(tid|laneid|warpid|globaltimer|clock|clock64)\b")
_LABEL = re.compile(r"^(\$?[\w.$]+):")
_BARRIER = re.compile(r"^(bar\.(sync|red|arrive)|barrier\.(sync|red|arrive|cta))|\.aligned\b")
_PER_THREAD_OPS = re.compile(
    r"^(atom|shfl|vote|match|activemask|mbarrier\.(try_wait|test_wait)|elect)\b")
_NO_DEST = re.compile(r"^(st|red|bar|barrier|bra|ret|exit|fence|membar|cp\.async|prefetch|"
                      r"wgmma\.(fence|commit_group|wait_group)|mbarrier\.(init|arrive|expect)|"
                      r"cp\.reduce|trap|brkpt|griddepcontrol|setmaxnreg|stmatrix|tensormap|"
                      r"discard)\b")


class Instr:
    def __init__(self, index: int, text: str):
        self.index, self.text = index, text
        guard = re.match(r"^@(!?)(%\w+)\s+", text)
        self.guard = guard.group(2) if guard else None
        body = text[guard.end():] if guard else text
        self.op, _, rest = body.partition(" ")
        self.op = self.op.strip()
        operands = _split_operands(rest.strip())
        if _NO_DEST.match(self.op) or not operands:
            self.dests: list[str] = []
            self.srcs = _REG.findall(rest)
        else:
            self.dests = _REG.findall(operands[0])
            self.srcs = [r for o in operands[1:] for r in _REG.findall(o)]
            if self.op.startswith("wgmma.mma_async"):
                self.srcs += self.dests          # accumulates into its outputs
        self.special = bool(_SPECIAL.search(rest))
        self.target = None
        if self.op.startswith("bra"):
            self.target = rest.strip().rstrip(";").strip()

    @property
    def barrier(self) -> bool:
        return bool(_BARRIER.search(self.op))

    def __repr__(self) -> str:
        return f"{self.index}: {self.text}"


def _split_operands(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur)
    return out


def _statements(ptx: str, function: str | None = None) -> list[str | tuple[str]]:
    """The body of the first ``.entry`` (or ``function``): instructions, and labels as 1-tuples."""
    start = ptx.find(".entry " + function) if function else ptx.find(".entry ")
    body = ptx[ptx.index("{", ptx.index(")", start)) + 1:]
    out: list[str | tuple[str]] = []
    for raw in body.splitlines():
        line = raw.split("//")[0].strip()
        if not line:
            continue
        label = _LABEL.match(line)
        if label:
            out.append((label.group(1),))
            line = line[label.end():].strip()
        for stmt in line.split(";"):
            stmt = stmt.strip().strip("{}").strip()
            if not stmt or stmt.startswith("."):
                continue
            out.append(stmt)
    return out


class Kernel:
    """A PTX kernel's instructions, basic blocks, successors and post-dominators."""

    def __init__(self, ptx: str, function: str | None = None):
        self.instrs: list[Instr] = []
        self.blocks: list[list[Instr]] = [[]]
        self.label_block: dict[str, int] = {}
        for stmt in _statements(ptx, function):
            if isinstance(stmt, tuple):
                if self.blocks[-1]:
                    self.blocks.append([])
                self.label_block[stmt[0]] = len(self.blocks) - 1
                continue
            ins = Instr(len(self.instrs), stmt)
            self.instrs.append(ins)
            self.blocks[-1].append(ins)
            if ins.target is not None or ins.op in ("ret", "exit"):
                self.blocks.append([])
        self.succ: list[list[int]] = []
        for b, block in enumerate(self.blocks):
            last = block[-1] if block else None
            nxt = [b + 1] if b + 1 < len(self.blocks) else []
            if last is None:
                self.succ.append(nxt)
            elif last.target is not None:
                target = self.label_block[last.target]
                self.succ.append([target] if last.guard is None else [target, *nxt])
            elif last.op in ("ret", "exit"):
                self.succ.append([])
            else:
                self.succ.append(nxt)
        self.ipdom = self._post_dominators()

    def _post_dominators(self) -> list[int | None]:
        n = len(self.blocks)
        exit_node = n                     # a virtual exit after every block without successors
        succ = [s or [exit_node] for s in self.succ] + [[]]
        every = set(range(n + 1))
        pdom = [set(every) for _ in range(n)] + [{exit_node}]
        changed = True
        while changed:
            changed = False
            for b in reversed(range(n)):
                new = set.intersection(*(pdom[s] for s in succ[b])) | {b}
                if new != pdom[b]:
                    pdom[b], changed = new, True
        ipdom: list[int | None] = []
        for b in range(n):
            strict = pdom[b] - {b}
            # the immediate one: the strict post-dominator that every other one post-dominates
            best = next((c for c in strict if all(d in pdom[c] for d in strict)), None)
            ipdom.append(None if best == exit_node else best)
        return ipdom

    def region(self, b: int) -> set[int]:
        """Blocks whose execution the branch ending block ``b`` decides (before its join)."""
        stop = self.ipdom[b]
        seen: set[int] = set()
        todo = [s for s in self.succ[b] if s != stop]
        while todo:
            x = todo.pop()
            if x in seen or x == stop:
                continue
            seen.add(x)
            todo.extend(self.succ[x])
        return seen


LANE_BITS = 0x1F      # bits of %tid.x that name the lane of a 32-wide warp


class Value:
    """What a register's value may depend on: ``opaque`` (a per-thread source other than the
    thread index), and the bits of ``%tid.x`` in ``mask``; ``bits`` maps each bit of the
    value to the thread-index bit it is (or None: a constant), where the value is only a
    rearrangement of ``%tid.x`` (moves, shifts and masks by immediates)."""

    __slots__ = ("bits", "mask", "opaque")

    def __init__(self, opaque=False, mask=0, bits=None):
        self.opaque, self.mask, self.bits = opaque, mask, bits

    def join(self, other: Value) -> Value:
        bits = self.bits if self.bits == other.bits else None
        return Value(self.opaque or other.opaque, self.mask | other.mask, bits)

    def __eq__(self, other):
        return isinstance(other, Value) and \
            (self.opaque, self.mask, self.bits) == (other.opaque, other.mask, other.bits)

    __hash__ = None  # type: ignore[assignment]

    @property
    def uniform(self) -> bool:
        return not self.opaque and self.mask == 0

    @property
    def lane_only(self) -> bool:
        """The same in every warp (it varies with the lane at most)."""
        return not self.opaque and self.mask & ~LANE_BITS == 0


UNIFORM = Value()
PER_THREAD = Value(opaque=True)
_TID = Value(mask=0xFFFFFFFF, bits=tuple(range(32)))


def _from_bits(bits) -> Value:
    bits = tuple(bits)
    mask = 0
    for b in bits:
        if b is not None:
            mask |= 1 << b
    return Value(mask=mask, bits=bits)


def _immediate(text: str) -> int | None:
    text = text.strip()
    try:
        return int(text, 0)
    except ValueError:
        return None


def _bit_op(ins: Instr, value: Value) -> Value | None:
    """``value`` rearranged by a move, shift or mask with an immediate, where it is known as
    a rearrangement of the thread index; None for any other instruction."""
    if value.bits is None:
        return None
    operands = _split_operands(ins.text.partition(ins.op)[2].strip())
    op = ins.op.split(".")[0]
    imm = _immediate(operands[2]) if len(operands) == 3 else None
    bits = list(value.bits)
    if op == "mov" and len(operands) == 2:
        return value
    if imm is None:
        return None
    if op == "and":
        return _from_bits(b if imm >> i & 1 else None for i, b in enumerate(bits))
    if op == "or":
        return _from_bits(None if imm >> i & 1 else b for i, b in enumerate(bits))
    if op == "shl":
        return _from_bits(([None] * imm + bits)[:32])
    if op == "shr" and ".s" not in ins.op:       # a logical shift
        return _from_bits((bits[imm:] + [None] * imm)[:32])
    return None


def _result(ins: Instr, values: dict[str, Value]) -> Value:
    op = ins.op
    if _SPECIAL.search(ins.text):
        special = _SPECIAL.search(ins.text).group(1)
        if special == "tid" and "%tid.x" in ins.text and op.startswith("mov"):
            return _TID
        if special == "laneid":
            return Value(mask=LANE_BITS)
        return PER_THREAD
    guard = values.get(ins.guard, UNIFORM) if ins.guard else UNIFORM
    srcs = UNIFORM
    for r in ins.srcs:
        srcs = srcs.join(values.get(r, UNIFORM))
    if op.startswith(("redux.sync", "shfl.sync.bfly")):
        # a warp-wide reduction (butterfly shuffles end alike in every lane): of values that
        # are the same in every warp, the same everywhere
        return UNIFORM.join(guard) if srcs.lane_only and guard.lane_only else PER_THREAD
    if _PER_THREAD_OPS.match(op):
        return PER_THREAD
    if op.startswith("ld.") and (".volatile" in op or ".acquire" in op or ".relaxed" in op):
        return PER_THREAD
    if len(ins.srcs) == 1 and not ins.guard:
        moved = _bit_op(ins, values.get(ins.srcs[0], UNIFORM))
        if moved is not None:
            return moved
    return srcs.join(guard)


def divergent_barriers(ptx: str, function: str | None = None) -> list[str]:
    """The CTA barriers of the kernel that per-thread values can make threads reach apart:
    each as ``"<line>: <instruction> (<why>)"``; empty when every barrier is reached alike."""
    k = Kernel(ptx, function)
    values: dict[str, Value] = {}
    forced: set[str] = set()          # written where a per-thread branch decides
    regions: dict[int, set[int]] = {}
    changed = True
    while changed:
        changed = False
        for ins in k.instrs:
            if not ins.dests:
                continue
            new = _result(ins, values)
            for d in ins.dests:
                old = values.get(d)
                value = PER_THREAD if d in forced else new if old is None else old.join(new)
                if value != old:
                    values[d] = value
                    changed = True
        for b, block in enumerate(k.blocks):
            last = block[-1] if block else None
            if last is None or last.target is None or last.guard is None or b in regions or \
                    values.get(last.guard, UNIFORM).uniform:
                continue
            regions[b] = k.region(b)
            for x in regions[b]:
                for ins in k.blocks[x]:
                    for d in ins.dests:
                        if d not in forced:
                            forced.add(d)
                            values[d] = PER_THREAD
                            changed = True
    found = []
    for b, region in sorted(regions.items()):
        branch = k.blocks[b][-1]
        for x in sorted(region):
            for ins in k.blocks[x]:
                if ins.barrier:
                    found.append(f"{ins.index}: {ins.text} (under the per-thread branch "
                                 f"{branch.index}: {branch.text})")
    for ins in k.instrs:
        if ins.barrier and ins.guard is not None and \
                not values.get(ins.guard, UNIFORM).uniform:
            found.append(f"{ins.index}: {ins.text} (guarded by a per-thread predicate)")
    return found


def _values(k: Kernel) -> dict[str, Value]:
    """The registers' values of :func:`divergent_barriers`' analysis (without its regions)."""
    values: dict[str, Value] = {}
    changed = True
    while changed:
        changed = False
        for ins in k.instrs:
            new = _result(ins, values) if ins.dests else None
            for d in ins.dests:
                old = values.get(d)
                value = new if old is None else old.join(new)
                if value != old:
                    values[d] = value
                    changed = True
    return values


def volatile_loads(ptx: str, function: str | None = None) -> list[tuple[str, str]]:
    """Each ``ld.volatile`` of the kernel with who executes it: ``"every thread"`` (no
    guard, or a uniform one), ``"some threads"`` (a guard that depends on the thread) or
    ``"no thread"`` (a guard only ever set false: a copy the compiler keeps for the vector's
    other elements)."""
    k = Kernel(ptx, function)
    values = _values(k)
    defs: dict[str, list[Instr]] = {}
    for ins in k.instrs:
        for d in ins.dests:
            defs.setdefault(d, []).append(ins)
    never = {r for r, ds in defs.items()
             if all(d.op == "mov.pred" and re.sub(r"\s", "", d.text).endswith(",0") for d in ds)}
    out = []
    for ins in k.instrs:
        if not ins.op.startswith("ld.volatile"):
            continue
        if ins.guard in never:
            who = "no thread"
        elif ins.guard is None or values.get(ins.guard, UNIFORM).uniform:
            who = "every thread"
        else:
            who = "some threads"
        out.append((f"{ins.index}: {ins.text}", who))
    return out
