"""Measure how many validation samples each library's documented evaluation counts.

    torchrun --nproc-per-node 2 check_eval_counts.py accelerate
    torchrun --nproc-per-node 2 check_eval_counts.py fabric

The "validation set" is range(N): sample i is the integer i, so the gathered
or all-reduced values tell exactly which samples were counted and how often.
Each case runs the same calls as the conversions in this folder:
  accelerate: accelerator.prepare(loader) + accelerator.gather_for_metrics(batch)
  fabric:     fabric.setup_dataloaders(loader) + fabric.all_reduce(sum/count, "sum")
              and fabric.all_gather(batch)
"""
import sys

import torch
from torch.utils.data import DataLoader

CASES = [(101, 16), (101, 128), (37, 8), (1113, 32), (100, 16)]  # (set size, batch size per process)


def report(print_fn, lib, how, n, bs, values):
    values = values.flatten().long().tolist()
    counts = torch.bincount(torch.tensor(values), minlength=n)
    dup = (counts > 1).nonzero().flatten().tolist()
    miss = (counts == 0).nonzero().flatten().tolist()
    exact = len(values) == n and not dup and not miss
    print_fn(f"| {lib} | {how} | {n} | {bs} | {len(values)} | {'exact' if exact else 'NOT exact'}"
             f" | {dup[:5]} | {miss[:5]} |")


def main():
    lib = sys.argv[1]
    header = ("| library | method | true size | batch/proc | samples counted | result | counted twice | missed |\n"
              "|---|---|---|---|---|---|---|---|")
    if lib == "accelerate":
        from accelerate import Accelerator
        acc = Accelerator(cpu=True)
        acc.print(f"{acc.num_processes} processes\n" + header)
        for n, bs in CASES:
            loader = acc.prepare(DataLoader(torch.arange(n), batch_size=bs, shuffle=False))
            seen = torch.cat([acc.gather_for_metrics(batch) for batch in loader])
            if acc.is_main_process:
                report(acc.print, lib, "gather_for_metrics", n, bs, seen)
    elif lib == "fabric":
        from lightning_fabric import Fabric
        fab = Fabric(accelerator="cpu", devices=int(sys.argv[2]) if len(sys.argv) > 2 else 2, strategy="ddp")
        fab.launch()
        fab.print(f"{fab.world_size} processes\n" + header)
        for n, bs in CASES:
            loader = fab.setup_dataloaders(DataLoader(torch.arange(n), batch_size=bs, shuffle=False))
            local = [batch for batch in loader]
            local_sum = sum(int((b + 1).sum()) for b in local)  # sample i weighs i+1
            local_cnt = sum(len(b) for b in local)
            tot = fab.all_reduce(torch.tensor([local_sum, local_cnt], dtype=torch.float64), reduce_op="sum")
            fab.print(f"| fabric | all_reduce(sum,count) | {n} | {bs} | {int(tot[1])} | "
                      f"{'exact' if int(tot[1]) == n and int(tot[0]) == n * (n + 1) // 2 else 'NOT exact'} | "
                      f"sum of (i+1): {int(tot[0])} vs true {n * (n + 1) // 2} | |")
            gathered = torch.cat([fab.all_gather(b).flatten() for b in local])
            if fab.is_global_zero:
                report(fab.print, lib, "all_gather", n, bs, gathered)
    else:
        raise SystemExit("usage: check_eval_counts.py accelerate|fabric")


if __name__ == "__main__":
    main()
