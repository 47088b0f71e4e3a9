"""Peak memory of the ServerApp's receive path for one oversized train reply (issue 43: the size cap and memory).

Flower 1.41's ServerApp pulls a reply from the SuperLink as content-addressed objects (``HttpGrid.pull_messages``:
``{object_id: bytes}``, arrays in 5 MB chunks) and assembles the ``Message`` (``inflate_object_from_contents``)
before FedSight sees it; FedSight's ``records.read_result`` then checks ``max-reply-mb`` before it parses an array.
This measures that path for a reply whose delta is ``--mb`` MB, in a fresh process per case: the resident set after
the imports, after the objects arrived, after Flower assembled them, after ``read_result`` with the default cap
(1,024 MB) and with 8 MB, and the peak (VmHWM). Two deltas: random values (every chunk distinct: the transfer is
the reply's size) and one repeated value (identical chunks are one object: the transfer is a few MB).

    python benchmarks/reply_peak_memory.py [--mb 400]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import gc, pickle, sys
import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
from flwr.supercore.task_identity import TaskIdentity

TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, 1, 1


def mem():
    got = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith(("VmRSS", "VmHWM")))
    return f"RSS {int(got['VmRSS'].split()[0]) // 1024} MB (peak {int(got['VmHWM'].split()[0]) // 1024} MB)"


stage, mb, kind, path = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
if stage == "make":
    n = int(mb * 2**20 / 4)
    delta = np.full(n, 0.5, np.float32) if kind == "repeated" else np.random.default_rng(0).random(n, dtype=np.float32)
    meta = {"client-id": 1, "partition-id": 1, "num-examples": 10, "num-steps": 1, "flops": 1.0, "accepted": 1}
    msg = Message(RecordDict({"delta": ArrayRecord({"w": Array(delta)}), "buffers": ArrayRecord(),
                              "metrics": MetricRecord({"train/loss": 0.5}), "meta": MetricRecord(meta)}),
                  dst_node_id=5, message_type="train")
    objects = {k: v.deflate() for k, v in get_all_nested_objects(msg).items()}
    pickle.dump((msg.object_id, objects), open(path, "wb"), protocol=5)
    print(f"  {len(objects)} objects, {sum(map(len, objects.values())) / 2**20:.0f} MB on the wire")
else:
    from fedsight.flower import records as FR

    gc.collect()
    print("  after imports:", mem())
    mid, objects = pickle.load(open(path, "rb"))
    print("  objects arrived:", mem())
    msg = inflate_object_from_contents(mid, objects)
    del objects
    gc.collect()
    print("  Flower assembled the message:", mem())
    for cap in (1024, 8):
        try:
            FR.read_result(msg.content, int(cap * 2**20))
            print(f"  read_result, max-reply-mb {cap}: read,", mem())
        except FR.MalformedReply:
            print(f"  read_result, max-reply-mb {cap}: rejected,", mem())
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=400.0, help="size of the reply's delta in MB")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("random", "repeated"):
            path = str(Path(tmp) / f"{kind}.pkl")
            print(f"a {args.mb:g} MB delta of {kind} values:")
            for stage in ("make", "receive"):
                subprocess.run([sys.executable, "-c", CHILD, stage, str(args.mb), kind, path], check=True)
            Path(path).unlink()


if __name__ == "__main__":
    main()
