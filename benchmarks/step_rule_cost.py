"""What watching a training step costs (``ddpkit.unchanged.step_rule``): the script's side of one step (the loss,
its backward and the optimizer's step) with the watch on, against the same step without it, in one process.

    python benchmarks/step_rule_cost.py [--steps 200]

The watch is on for one step per loader (its first training step), so this is the whole cost of the decision, paid
once per loader; the model's own forward runs with the watch set aside, and is not counted here either way.
"""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddpkit.unchanged.step_rule import StepWatch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(128, 64), torch.randint(0, 10, (128,))

    def step(watched: bool) -> tuple[float, str | None]:
        watch = StepWatch() if watched else None
        if watch is not None:
            watch.begin((x, y))
            watch.pause()
        output = model(x)  # (the model's call: set aside, as ddpkit's hooks set it aside)
        start = time.perf_counter()
        if watch is not None:
            watch.outputs(output, training=True)
            watch.resume()
        loss = F.cross_entropy(output, y.to(output.device)) + 0.1 * F.mse_loss(output[:, :1], x[:, :1])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print_value = loss.item()
        verdict = watch.end() if watch is not None else None
        return time.perf_counter() - start, verdict if print_value == print_value else "nan"

    for _ in range(20):
        step(False), step(True)
    plain = sorted(step(False)[0] for _ in range(args.steps))[args.steps // 2]
    results = [step(True) for _ in range(args.steps)]
    watched = sorted(seconds for seconds, _ in results)[args.steps // 2]
    verdicts = {verdict for _, verdict in results}
    print(f"the script's side of a step (loss, backward, optimizer step), median of {args.steps}: "
          f"{plain * 1e6:.0f} us plain, {watched * 1e6:.0f} us watched: {watched / plain:.2f}x, "
          f"{(watched - plain) * 1e6:.0f} us once per loader; verdicts {verdicts} (None: proven split)")


if __name__ == "__main__":
    main()
