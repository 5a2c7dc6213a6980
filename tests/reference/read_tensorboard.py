"""Reads a TensorBoard log directory with TensorBoard's own reader and prints it as JSON.

usage: read_tensorboard.py LOGDIR

Output: {"scalars": {tag: [[step, value, wall_time], ...]},
         "texts": {tag: [[step, text], ...]},
         "files": [{"name": ..., "records": n, "file_version": ...}]}
Every record of every events file is also read with TensorBoard's record reader, which
checks both masked CRC32Cs of each record and raises on a mismatch (non-zero exit).
"""
import json
import os
import sys

from tensorboard.backend.event_processing import event_accumulator
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub import pywrap_tensorflow


def read_records(path):
    """Every record of one events file, CRC-checked by TensorBoard's reader."""
    reader = pywrap_tensorflow.PyRecordReader_New(path.encode(), 0, b"", None)
    records = []
    while True:
        try:
            reader.GetNext()
        except Exception as e:  # OutOfRangeError at the end; DataLossError on a bad CRC
            if type(e).__name__ == "OutOfRangeError":
                break
            raise
        records.append(reader.record())
    return records


def main():
    logdir = sys.argv[1]
    files = []
    for name in sorted(os.listdir(logdir)):
        if "tfevents" not in name:
            continue
        records = read_records(os.path.join(logdir, name))
        first = event_pb2.Event.FromString(records[0]) if records else event_pb2.Event()
        files.append({"name": name, "records": len(records),
                      "file_version": first.file_version,
                      "first_wall_time": first.wall_time})

    acc = event_accumulator.EventAccumulator(
        logdir, size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0})
    acc.Reload()
    tags = acc.Tags()
    scalars = {tag: [[e.step, e.value, e.wall_time] for e in acc.Scalars(tag)]
               for tag in tags["scalars"]}
    texts = {}
    for tag in tags["tensors"]:
        texts[tag] = [[e.step, e.tensor_proto.string_val[0].decode()]
                      for e in acc.Tensors(tag)]
    print(json.dumps({"scalars": scalars, "texts": texts, "files": files}))


if __name__ == "__main__":
    main()
