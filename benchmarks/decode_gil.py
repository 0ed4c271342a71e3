"""Whether torchvision's ``decode_jpeg`` lets go of Python's GIL while it decodes a batch: how far a Python loop on
the main thread gets alone, and while a second thread decodes the same batch again and again (ddpkit's GPU loaders
decode on such a thread, ``ddpkit.data.loaders.ahead_on_a_thread``, beside the training thread).

    python benchmarks/decode_gil.py                       # on the CPU (libjpeg-turbo inside torchvision)
    python benchmarks/decode_gil.py --device cuda         # nvJPEG, the GPU path's decoder

The decoding thread holds the GIL only for the call's Python parts if the library releases it in C++: the loop
then keeps its pace (a ratio near 1, where a core is free for it). A decoder that keeps the GIL while it works
takes the loop's turns: the ratio falls towards the decoder's share of the time. As a check of the measure, a
thread that spins in Python (it never lets go of the GIL but at the interpreter's switch interval) is timed the
same way. Prints one JSON line per case.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import torch


def loop_rate(seconds: float) -> float:
    """Python loop iterations per second on this thread."""
    count, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        count += 1
    return count / seconds


def beside(work, seconds: float) -> tuple[float, int]:
    """(the loop's rate, rounds of ``work`` done) while ``work`` runs over and over on a second thread."""
    stop, rounds = threading.Event(), [0]

    def again() -> None:
        while not stop.is_set():
            work()
            rounds[0] += 1

    thread = threading.Thread(target=again)
    thread.start()
    time.sleep(0.2)  # the first round (nvJPEG's start-up) before the loop is timed
    rounds[0] = 0
    rate = loop_rate(seconds)
    stop.set()
    thread.join()
    return rate, rounds[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for nvJPEG")
    parser.add_argument("--images", type=int, default=32, help="JPEGs in the batch decoded per call")
    parser.add_argument("--seconds", type=float, default=3.0, help="how long each case runs")
    args = parser.parse_args()

    from torchvision.io import ImageReadMode, decode_jpeg

    from ddpkit.data import sample_images

    torch.set_num_threads(1)  # the CPU decoder on one core, the loop on another
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as folder:
        sample_images.write_folder(folder, images=args.images, classes=1)
        encoded = [torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
                   for path in sorted(Path(folder).rglob("*.jpg"))]

    def decode() -> None:
        decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the call's work, whatever of it runs after the call returns

    def spin() -> None:
        total = 0
        for i in range(200_000):
            total += i

    alone = loop_rate(args.seconds)
    for name, work in (("decode_jpeg", decode), ("python_spin", spin)):
        rate, rounds = beside(work, args.seconds)
        print(json.dumps({"case": name, "device": str(device), "images": len(encoded), "loop_alone_per_s": round(alone),
                          "loop_beside_per_s": round(rate), "ratio": round(rate / alone, 3),
                          "rounds_per_s": round(rounds / args.seconds, 2),
                          "images_per_s": round(rounds * len(encoded) / args.seconds, 1) if name == "decode_jpeg"
                          else None}), flush=True)


if __name__ == "__main__":
    main()
