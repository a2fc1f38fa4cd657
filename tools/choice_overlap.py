"""How much do neighbouring queries share their selected blocks? The question behind query tiles in
the selection kernels: a tile of TQ consecutive queries that reads the union of their blocks saves
K/V traffic only where that union is much smaller than TQ * n.

For every layer of a model preset (eager, under no_grad; bf16 autocast on CUDA) on real text (the
validation split of `nsa-compile train`'s corpus, or --data), the block ids each layer's
`select_blocks` returns are recorded, and for each TQ the mean number of distinct blocks in the
tiles of TQ consecutive queries is printed in units of n (1.0: the tile's queries chose the same
blocks; TQ: they share none). Only tiles past t = n * l' count: before that every candidate block is
chosen. --checkpoint loads weights saved by `nsa-compile train --checkpoint` (a trained model's
choices are what the kernels meet in training; random initialisation is the benchmarks' case).

    python3 tools/choice_overlap.py --model seed --seq-len 8192 --seq-len 16384
    python3 tools/choice_overlap.py --model seed --seq-len 8192 --checkpoint ck.pt
"""

from __future__ import annotations

import argparse
import sys

import torch
from tabulate import tabulate

from nsa_compile.models import NSAAttention, build_model
from nsa_compile.train import load_corpus

TILES = (2, 4, 8, 16)


def union_sizes(block_idx: torch.Tensor, n_blocks: int, tq: int) -> torch.Tensor:
    """Distinct valid block ids per tile of `tq` consecutive queries: [B * G, S // tq] (a trailing
    partial tile is dropped)."""
    B, G, S, n = block_idx.shape
    tiles = S // tq
    ids = block_idx[:, :, : tiles * tq].reshape(B * G, tiles, tq * n)
    ids = torch.where(ids >= 0, ids, n_blocks)  # padding: a spare column
    member = torch.zeros(B * G, tiles, n_blocks + 1, dtype=torch.int32, device=ids.device)
    member.scatter_(2, ids, 1)
    return member[..., :n_blocks].sum(-1)


def record_choices(model: torch.nn.Module) -> list[torch.Tensor]:
    """Wrap every NSA layer's select_blocks so that its result is appended to the returned list."""
    seen: list[torch.Tensor] = []
    for module in model.modules():
        if isinstance(module, NSAAttention):
            def recording(p_cmp, S, pos=None, _select=module.select_blocks):
                idx = _select(p_cmp, S, pos)
                seen.append(idx.detach())
                return idx

            module.select_blocks = recording
    return seen


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="seed", help="a preset (tiny, seed, paper)")
    ap.add_argument("--seq-len", type=int, action="append", help="repeatable (default 8192)")
    ap.add_argument("--checkpoint", default=None, help="weights from nsa-compile train --checkpoint")
    ap.add_argument("--data", default=None, help="a text file or folder (default: the stdlib's sources)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.device == "cuda" and not torch.cuda.is_available():
        print("choice_overlap: --device cuda, but no CUDA device is available", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    model = build_model(args.model).to(device)
    if args.checkpoint:
        state = torch.load(args.checkpoint, map_location=device, weights_only=True)["model"]
        model.load_state_dict({k.replace("_orig_mod.", ""): v for k, v in state.items()})
    cfg = model.cfg
    seen = record_choices(model)
    corpus = load_corpus(args.data)
    print(f"{args.model} ({'trained: ' + args.checkpoint if args.checkpoint else 'random init'}), {device.type}, "
          f"l' {cfg.sel_block}, n {cfg.n_selected}; mean distinct blocks per tile of TQ queries, in units of n")
    for S in args.seq_len or [8192]:
        seen.clear()
        tokens = corpus.batch("val", 0, 1, S, 0)[:, :-1].to(device)
        autocast = torch.autocast("cuda", torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
        with torch.no_grad(), autocast:
            model(tokens)
        n_blocks = -(-S // cfg.sel_block)
        rows = []
        for layer, idx in enumerate(seen):
            row = [S, layer]
            for tq in TILES:
                first = cfg.n_selected * cfg.sel_block // tq  # the first tile past t = n * l'
                sizes = union_sizes(idx, n_blocks, tq)[:, first:]
                row.append(f"{sizes.float().mean().item() / cfg.n_selected:.2f}" if sizes.numel() else "-")
            rows.append(row)
        print(tabulate(rows, headers=["S", "layer", *(f"TQ {tq}" for tq in TILES)], tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
