"""A non-causal block choice (the op's rule 'nsa_vibe'; tests/corpus/nsa_vibe_noncausal.py), read
as a computation for the select_blocks pass:

    s = (q @ k_cmp^T) * scale                    # no mask: every compressed block, later ones too
    p = softmax(s, dim=-1)                       # (float32: autocast's, or a float32 model)
    ... any spelling of the overlap map, the group sum, the forced blocks {0, t // l', t // l' - 1}
    ... ranked by a topk over every other block, joined with the forced ones, de-duplicated, sorted
    block_idx                                    # int64 [B, S, G, n] or [B, G, S, n]

Anchored at a topk whose key is computed from exactly one softmax over unmasked scores (q @ k^T
times a constant, through data movement and casts only). The block ids are the first int64 4-D
tensor after the topk whose region (everything between q, the compressed keys and it) equals
`nsa.select_blocks(q, k_cmp, None, l, d, l', n, scale, rule='nsa_vibe')` on random float64 probe
values, at the graph's sizes (one batch row where the whole batch is over the probe budget): (l, d)
are those of the `nsa.compressed_attention` op that reads the same compressed keys (the branch
compressed_attention rewrote), n the ids' width and l' the block size whose ceil(S / l') is the
key's width (each such l' tried). A row may differ only where its chosen and the op's blocks tie
within TIE in the float64 importance (eager subtracts j * 1e-8 as a tie-break, which reorders
importances closer than that), and at most one row in a hundred. A check on probes, not a proof.

Static sizes only (a graph with symbolic sizes is refused, SYMBOLIC says why). Structure read, not
probed (probes run in float64): the scores and everything before the softmax
in q's dtype, the softmax and every float after it in float32 (autocast's softmax, or a float32
model). Replaced by the op (transposed where the ids are [B, S, G, n]); the region's nodes that
nothing else reads are erased.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from nsa_compile import batch_slice, probe as region_probe
from nsa_compile.attention_match import Refused, ancestors, erase_replaced
from nsa_compile.fx import MATMULS, arg, call, op_name, same, value
from nsa_compile.ops.block_select import choose_backend, nsa_vibe_importance, select_blocks, why_not_triton
from nsa_compile.sizes import Sizes, is_size

from .block_choice import first_arg

KERNEL = ("nsa.select_blocks[{backend}] (rule 'nsa_vibe', NOT causal as the model: l'={block}, n={n}, the "
          "softmax over every compressed block, every block competing for the n - 3 free slots; verified on probe "
          "values{why})")
# data movement between the scores' matmul and its operands or the softmax
MOVES = ("view", "reshape", "flatten", "unflatten", "transpose", "permute", "movedim", "unsqueeze", "squeeze",
         "expand", "repeat_interleave", "contiguous", "clone")
CASTS = ("to", "float", "type", "half", "bfloat16", "double")
SYMBOLIC = ("symbolic sizes (dynamic shapes): a non-causal choice is read at static sizes only (a block map built "
            "from Python lists is traced at one size, which probes at other sizes would run out of its range); "
            "OptimizeConfig(dynamic=False) compiles each length with the rewrite")
# probes of random float64 values; a differing row must tie within TIE (eager's j * 1e-8 tie-break)
PROBES, TIE, MAX_DIFFERING = 2, 1e-6, 0.01


class NotThisRule(Exception):
    """The topk's key reads no softmax over unmasked scores: not a non-causal choice."""


def unmasked_scores(softmax: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(the matmul, the scaled scores) where softmax's input is (matmul) * constant through data
    movement and casts only; None otherwise (a mask or anything else in between)."""
    x = first_arg(softmax)
    while isinstance(x, fx.Node) and (op_name(x) in MOVES or op_name(x) in CASTS):
        x = first_arg(x)
    name = op_name(x) if isinstance(x, fx.Node) else None
    if name not in ("mul", "mul_") or len(x.args) != 2 or not isinstance(x.args[1], float):
        return None
    y = x.args[0]
    while isinstance(y, fx.Node) and op_name(y) in MOVES:
        y = first_arg(y)
    return (y, x) if isinstance(y, fx.Node) and op_name(y) in MATMULS else None


def back_to(node, want) -> fx.Node | None:
    """The first node, walking back from `node` through data movement, whose value has the shape
    `want` (a tuple of sizes compared with `same`); None if none."""
    while isinstance(node, fx.Node):
        v = value(node)
        if v is not None and v.dim() == len(want) and same(tuple(v.shape), want):
            return node
        node = first_arg(node) if op_name(node) in MOVES else None
    return None


def root(node) -> fx.Node | None:
    while isinstance(node, fx.Node) and op_name(node) in MOVES:
        node = first_arg(node)
    return node


class NonCausalChoice:
    def __init__(self):
        self.verdicts: dict = {}

    def check(self, ranking: fx.Node, requested: str) -> dict:
        key = first_arg(ranking)
        if op_name(ranking) != "topk" or not isinstance(key, fx.Node):
            raise NotThisRule
        softmaxes = [n for n in ancestors([key]) if op_name(n) == "softmax"]
        scored = [(s, unmasked_scores(s)) for s in softmaxes]
        scored = [(s, m) for s, m in scored if m is not None]
        if not scored:
            raise NotThisRule
        if len(softmaxes) != 1:
            raise Refused(f"the ranking key reads {len(softmaxes)} softmaxes; a non-causal choice reads one")
        if Sizes.of(ranking.graph).symbolic:
            raise Refused(SYMBOLIC)
        softmax, (matmul, scaled) = scored[0]
        scale = scaled.args[1]
        n_top = arg(ranking, 1, "k")  # static sizes: the model's min(k, blocks) is a number here
        B, A, C, Ns = value(key).shape
        if (not isinstance(n_top, int) or arg(ranking, 3, "largest", True) is not True
                or arg(ranking, 2, "dim", -1) not in (-1, 3)):
            raise Refused("the topk is not the k largest keys over the last dim, k a constant")
        Tc, Dk = value(softmax).shape[-1], value(matmul.args[0]).shape[-1]
        k = S = None
        for G, S in ((C, A), (A, C)):  # the key [B, S, G, Ns] or [B, G, S, Ns]
            k = back_to(matmul.args[1], (B, G, Tc, Dk))
            if k is not None:
                break
        if k is None:
            raise Refused("the scores' keys are not compressed keys [B, G, Tc, Dk] moved into place")
        q, layout = self.query(matmul.args[0], B, G, S, Dk)
        q_fake = as_heads(value(q), layout)
        self.dtypes(ancestors([key]) - ancestors([q, k]), softmax, q)
        l, d = self.pooling(k)
        n = 3 + n_top  # the op's slots: 3 forced, n_top chosen (the model's width is 3 + min(n_top, Ns))
        ids, block, region = self.verify(ranking, q, layout, k, l, d, n, scale)
        seq_first = is_seq_first(ids, G)
        fakes = (q_fake, value(k), None, l, d, block, n)
        try:
            backend = choose_backend(*fakes, requested, None, "nsa_vibe")
        except ValueError as why:
            raise Refused(f"OptimizeConfig(select_blocks_backend={requested!r}): {why}") from None
        why = (why_not_triton(*fakes, None, "nsa_vibe") if requested == "auto"
               else f"select_blocks_backend={requested!r} in OptimizeConfig")
        text = KERNEL.format(backend=backend, block=block, n=n, why=f"; not triton: {why}" if backend != "triton" else "")
        return {"ranking": ranking, "q": q, "layout": layout, "k": k, "l": l, "d": d,
                "block": block, "n": n, "scale": scale, "ids": ids, "seq_first": seq_first, "backend": backend,
                "text": text, "region": region}

    @staticmethod
    def query(node, B, G, S, Dk) -> tuple[fx.Node, tuple]:
        """(the node the scores' queries come from through data movement only, the layout that reads
        it as q [B, H, S, Dk]): the first of the moves' chain that is q itself, else its start read
        as [B, S, H, Dk], [B, S, H * Dk], [B, S, G, h, Dk] or [B, G, h, S, Dk] (a layout is a guess
        from the shape; the probes verify it)."""
        chain = []
        while isinstance(node, fx.Node):
            chain.append(node)
            node = first_arg(node) if op_name(node) in MOVES else None
        for node in chain:
            v = value(node)
            if (v is not None and v.dim() == 4 and same((v.shape[0], v.shape[2], v.shape[3]), (B, S, Dk))
                    and isinstance(v.shape[1], int) and v.shape[1] % G == 0):
                return node, ("bhsd",)
        start = chain[-1]
        shape = tuple(value(start).shape) if value(start) is not None else ()
        if len(shape) == 4 and same((shape[0], shape[1], shape[3]), (B, S, Dk)) and shape[2] % G == 0:
            return start, ("bshd",)
        if len(shape) == 3 and same(shape[:2], (B, S)) and shape[2] % (G * Dk) == 0:
            return start, ("bs(hd)", shape[2] // Dk)
        if len(shape) == 5 and same(shape, (B, S, G, shape[3], Dk)):
            return start, ("bsghd",)
        if len(shape) == 5 and same(shape, (B, G, shape[2], S, Dk)):
            return start, ("bghsd",)
        raise Refused("the scores' queries are not q [B, H, S, Dk] (or [B, S, H, Dk], [B, S, H * Dk], [B, S, G, h, "
                      "Dk], [B, G, h, S, Dk]) moved into place")

    @staticmethod
    def pooling(k: fx.Node) -> tuple[int, int]:
        """(l, d) of the nsa.compressed_attention op that reads these compressed keys."""
        targets = (torch.ops.nsa.compressed_attention, torch.ops.nsa.compressed_attention.default)
        base = root(k)
        for node in k.graph.nodes:
            if node.op == "call_function" and node.target in targets and root(node.args[1]) is base:
                l, d = node.args[3], node.args[4]
                if isinstance(l, int) and isinstance(d, int):
                    return l, d
        raise Refused("no nsa.compressed_attention op reads these compressed keys (the compressed branch was not "
                      "rewritten): the pooling's (l, d) are unknown")

    @staticmethod
    def dtypes(region: set, softmax: fx.Node, q: fx.Node) -> None:
        """The scores in q's dtype, the softmax and every float after it in float32 (float64 for a
        float64 q, where a model's float32 ranking key is refused here: the op ranks float64). The
        probes run every float in float64, so they cannot see a rounding: this is read from the
        graph's dtypes."""
        qdt = value(q).dtype
        wide = torch.float64 if qdt == torch.float64 else torch.float32
        before = ancestors([first_arg(softmax)])
        for node in region:
            v = value(node)
            if v is None or not v.is_floating_point() or node is softmax:
                continue
            if node in before:
                if v.dtype not in (qdt, wide):
                    raise Refused(f"{node.name} computes the scores in {v.dtype}, q is {qdt}")
            elif v.dtype != wide:
                raise Refused(f"{node.name} computes the importance in {v.dtype}: rule 'nsa_vibe' computes it in "
                              f"{wide} (the softmax's float32 under autocast)")
        if value(softmax).dtype != wide:
            raise Refused(f"the softmax computes in {value(softmax).dtype}: rule 'nsa_vibe' takes it in {wide}")

    def verify(self, ranking, q, layout, k, l, d, n, scale) -> tuple[fx.Node, int, list]:
        """(the block ids node, l', its region) for the first int64 4-D node after the topk whose
        region equals the op (n slots, cut to the node's width) on probe values at every probe size
        for one l' with ceil(S / l') = the key's width; else Refused."""
        order = {x: i for i, x in enumerate(ranking.graph.nodes)}
        B, H, S, _ = as_heads(value(q), layout).shape
        G = value(k).shape[1]
        # q, k and what they are computed from stay outside, but for position-only nodes (e.g. the
        # arange the model's RoPE also reads), which the region recomputes
        inputs = reads_inputs(ranking.graph)
        outside = {x for x in ancestors([q, k]) if x in inputs} | {q, k}
        later = [x for x in descendants(ranking) if value(x) is not None and value(x).dtype == torch.int64
                 and value(x).dim() == 4 and value(x).shape[-1] <= n
                 and (same(tuple(value(x).shape[:3]), (B, S, G)) or same(tuple(value(x).shape[:3]), (B, G, S)))]
        later.sort(key=order.__getitem__)
        sizes = Sizes.of(ranking.graph)
        reason = None
        for ids in later:
            region = sorted((x for x in ancestors([ids]) - outside if not is_size(x)), key=order.__getitem__)
            for node in region:
                if node.op in ("placeholder", "get_attr"):
                    raise Refused(f"the block choice reads {node.op} {node.name} besides q and the compressed keys")
                for x in node.all_input_nodes:
                    if x in outside and x not in (q, k):
                        raise Refused(f"the block choice reads {x.name} besides q and the compressed keys")
            fp = (region_probe.fingerprint(region, [q, k]), layout, l, d, n, scale, sizes.shape(value(q)),
                  sizes.shape(value(k)), sizes.shape(value(ids)), sizes.symbolic)
            try:
                block = region_probe.remembered(self.verdicts, fp, lambda: self._verify(
                    region, ranking, ids, q, layout, k, l, d, n, scale, sizes))
                return ids, block, region
            except Refused as why:  # the reason of the nearest to the topk
                reason = reason or str(why)
        raise Refused(reason or f"no int64 [B, S, G, m] or [B, G, S, m] tensor (m <= {n}) after the topk")

    @staticmethod
    def _verify(region, ranking, ids, q, layout, k, l, d, n, scale, sizes) -> int:
        (Bq, *rest), (_, G, Tc, Dk) = value(q).shape, value(k).shape
        seq_first = is_seq_first(ids, G)
        S = value(ids).shape[1 if seq_first else 2]
        Ns, width = value(first_arg(ranking)).shape[-1], value(ids).shape[-1]
        at = sizes.probes()[0]  # static: the graph's own sizes
        one_row, changes, _ = batch_slice.probe_rows(region, [q, k], ids, at, "the non-causal block choice")
        B = one_row or Bq
        candidates = [b for b in range(1, S + 1) if -(-S // b) == Ns]
        gen = torch.Generator().manual_seed(23)
        for probe in range(PROBES):
            qp = torch.randn((B, *rest), generator=gen, dtype=torch.float64, device="cpu") * (1 + 2 * probe)
            kp = torch.randn(B, G, Tc, Dk, generator=gen, dtype=torch.float64, device="cpu")
            device = value(q).device
            env = {q: qp.to(device), k: kp.to(device), **at.size_nodes()}
            got = region_probe.run(region, env, ids, "the non-causal block choice", changes=changes).cpu().long()
            if seq_first:
                got = got.transpose(1, 2)
            qh = as_heads(qp, layout)
            matching = []
            for block in candidates:
                want = select_blocks(qh, kp, None, l, d, block, n, scale, "reference", rule="nsa_vibe")
                cut = want[..., n - width:]  # the model's width 3 + min(n - 3, Ns): the -1 come first
                if (cut.shape == got.shape and bool((want[..., :n - width] == -1).all())
                        and within_ties(got, cut, qh, kp, l, d, block, scale)):
                    matching.append(block)
            if not matching:
                raise Refused(f"the block choice differs from rule 'nsa_vibe' (a softmax over every compressed block "
                              f"of (l, d) = ({l}, {d}), the overlap map, the group sum, blocks 0, t // l', t // l' - 1 "
                              f"forced and the top {n - 3} of every other block, -1 for duplicates, ascending) on "
                              f"probe values for every l' with {Ns} blocks")
            candidates = matching
        return candidates[0]

    @staticmethod
    def rewrite(graph: fx.Graph, plan: dict) -> None:
        ranking, ids = plan["ranking"], plan["ids"]
        q = plan["q"]
        kind = plan["layout"][0]
        if kind == "bshd":
            q = call(graph, torch.transpose, q, 1, 2, anchor=ids)
        elif kind == "bs(hd)":
            q = call(graph, torch.transpose, call(graph, torch.unflatten, q, -1, (plan["layout"][1], -1), anchor=ids),
                     1, 2, anchor=ids)
        elif kind == "bsghd":
            q = call(graph, torch.transpose, call(graph, torch.flatten, q, 2, 3, anchor=ids), 1, 2, anchor=ids)
        elif kind == "bghsd":
            q = call(graph, torch.flatten, q, 1, 2, anchor=ids)
        new = call(graph, torch.ops.nsa.select_blocks, q, plan["k"], None, plan["l"], plan["d"], plan["block"],
                   plan["n"], plan["scale"], plan["backend"], anchor=ids, rule="nsa_vibe")
        width = value(ids).shape[-1]
        if width != plan["n"]:  # the model's 3 + min(n - 3, Ns) columns: the op's first ones are -1
            new = call(graph, torch.narrow, new, -1, plan["n"] - width, width, anchor=ids)
        if plan["seq_first"]:
            new = call(graph, torch.transpose, new, 1, 2, anchor=ids)
        ids.replace_all_uses_with(new)
        erase_replaced(graph, [ids], [])  # then the region, as far as nothing else reads it


def is_seq_first(ids: fx.Node, G: int) -> bool:
    """Whether the ids are [B, S, G, n] (else [B, G, S, n])."""
    shape = value(ids).shape
    return shape[2] == G and shape[1] != G


def reads_inputs(graph: fx.Graph) -> set[fx.Node]:
    """The nodes that depend on a graph input or attribute other than a size (data or parameters):
    all but the position-only ones."""
    found = set()
    for node in graph.nodes:
        if (node.op in ("placeholder", "get_attr") and not is_size(node)) or any(
                x in found for x in node.all_input_nodes):
            found.add(node)
    return found


def descendants(node: fx.Node) -> set[fx.Node]:
    """The nodes that read `node`, directly or through others."""
    found, stack = set(), list(node.users)
    while stack:
        x = stack.pop()
        if x not in found:
            found.add(x)
            stack.extend(x.users)
    return found


def as_heads(x: torch.Tensor, layout: tuple) -> torch.Tensor:
    """x read as q [B, H, S, Dk] in `layout` (NonCausalChoice.query's), a view."""
    kind = layout[0]
    if kind == "bshd":
        return x.transpose(1, 2)
    if kind == "bs(hd)":
        return x.unflatten(-1, (layout[1], -1)).transpose(1, 2)
    if kind == "bsghd":
        return x.flatten(2, 3).transpose(1, 2)
    if kind == "bghsd":
        return x.flatten(1, 2)
    return x


def within_ties(got: torch.Tensor, want: torch.Tensor, q, k, l, d, block, scale) -> bool:
    """got equals want but on at most MAX_DIFFERING of the rows, each of which chose blocks whose
    float64 importance ties the op's choice within TIE."""
    differ = (got != want).any(-1)
    if not bool(differ.any()):
        return True
    if float(differ.float().mean()) > MAX_DIFFERING:
        return False
    imp = nsa_vibe_importance(q, k, l, d, block, scale)  # [B, G, S, Ns]
    for b, g, t in differ.nonzero().tolist():
        a = {int(x) for x in got[b, g, t] if x >= 0}
        w = {int(x) for x in want[b, g, t] if x >= 0}
        if len(a) != len(w):
            return False
        common = a & w
        only = sorted((a | w) - common)
        if not only:
            return False
        vals = imp[b, g, t, only]
        if float(vals.max() - vals.min()) > TIE:
            return False
    return True
