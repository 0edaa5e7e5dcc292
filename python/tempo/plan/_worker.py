"""A process of tempo.plan's: plans the methods it is sent (pickled on stdin: config, the model
class's name, causal, setup, methods) and writes back (pickled on stdout) their rows and the
peaks planned. tempo.plan runs one beside itself on a second core."""

import pickle
import sys


def main():
    config, cls_name, causal, setup, methods = pickle.load(sys.stdin.buffer)
    import transformers

    from . import _Job

    job = _Job(config, getattr(transformers, cls_name), causal, setup)
    rows = []
    for method in methods:
        row = job.plan_method(method)
        row._search = None
        rows.append(row)
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write to the pickle's stream
    pickle.dump((rows, job.peaks), out)
    out.flush()


if __name__ == "__main__":
    main()
