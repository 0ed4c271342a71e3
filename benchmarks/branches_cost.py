"""What watching a model's first forward for reads of its data costs (``ddpkit.unchanged.branches``): the forward of a
ResNet-18 and of a small GPT-2 (transformers, with labels: it reads its attention mask's values) under the torch
function mode ``ReadsItsData``, against the same forward without it. In one process, one thread, best of seven.

    python benchmarks/branches_cost.py

The mode is on for the calls of a model's first training step alone (each time DDP is built for it): this is the
whole cost, paid once per model. The first call under it also lists the bytecode of the code that reads its data,
and of what the blocks that those reads decide may call (cached for the run): printed apart.
"""

import time

import torch
import torchvision

from ddpkit.unchanged.branches import ReadsItsData


def best_of(call, times: int = 7) -> float:
    seconds = []
    for _ in range(times):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return min(seconds)


def watched(call):
    def run():
        reading = ReadsItsData().start()
        try:
            call()
        finally:
            reading.end()
    return run


def main() -> None:
    torch.set_num_threads(1)
    resnet, images = torchvision.models.resnet18(), torch.randn(8, 3, 64, 64)
    cases = [("ResNet-18, batch 8, 64 pixels", lambda: resnet(images))]
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        print("transformers is not installed: GPT-2 left out")
    else:
        gpt = GPT2LMHeadModel(GPT2Config(n_layer=4, n_head=4, n_embd=128, vocab_size=500))
        tokens = torch.randint(0, 500, (4, 64))
        cases.append(("GPT-2, 4 layers of 128, batch 4 of 64 tokens, with labels",
                      lambda: gpt(input_ids=tokens, labels=tokens)))
    for name, call in cases:
        call()  # (the model warm: what the first watched call adds is ddpkit's reading of the code, listed once)
        first = best_of(watched(call), times=1)
        plain, under = best_of(call), best_of(watched(call))
        print(f"{name}: forward {plain * 1e3:.1f} ms, under the mode {under * 1e3:.1f} ms ({under / plain:.2f}x); "
              f"the first call under it {first * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
