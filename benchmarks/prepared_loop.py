"""``benchmarks/unchanged_loop.py``'s loop on ``ddpkit.Job.prepare``: the script changed as docs/library.md shows, each
process taking a batch of its own (``--batch-size`` per process). ``benchmarks/unchanged.py`` compares the two.

    python -m ddpkit run --nproc-per-node 2 benchmarks/prepared_loop.py --batch-size 32 [--sync-bn]
"""

import json
import sys

import ddpkit
from unchanged_loop import build, parse, train

sync_bn = "--sync-bn" in sys.argv  # BatchNorm over the global batch, as under --unchanged
options = parse([arg for arg in sys.argv[1:] if arg != "--sync-bn"])
job = ddpkit.Job(sync_bn=sync_bn)
device, model, optimizer, loader = build(options)
model, optimizer, loader = job.prepare(model, optimizer, loader)
report = train(options, job.device, model, optimizer, loader)
if job.is_main:
    print(json.dumps(report))
