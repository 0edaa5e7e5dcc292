"""tempo.plan's planning processes: a Pool of processes (python -m tempo.plan._worker), each given
the model and setup once, then one method at a time as it finishes the last (the searches of
some methods take ten times others'), each answer its row and the steps it traced (so that the
caller's Plan can move to other GPUs without tracing them again). Messages are pickles with an
8-byte length before each."""

import os
import pickle
import select
import struct
import subprocess
import sys
import tempfile


def _send(stream, obj):
    data = pickle.dumps(obj)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _receive(stream):
    head = stream.read(8)
    if len(head) < 8:
        return None
    (n,) = struct.unpack("<Q", head)
    return pickle.loads(stream.read(n))


class Pool:
    """`count` planning processes for one model and setup."""

    def __init__(self, count, config, cls_name, causal, setup):
        import tempo

        env = dict(os.environ)
        here = os.path.dirname(os.path.dirname(os.path.abspath(tempo.__file__)))
        env["PYTHONPATH"] = os.pathsep.join([here] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = "1"  # fake tensors compute nothing
        self.procs = []
        for _ in range(count):
            err = tempfile.TemporaryFile()  # a pipe left unread could fill and stop the process
            proc = subprocess.Popen(
                [sys.executable, "-m", "tempo.plan._worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
            )
            proc.err = err
            _send(proc.stdin, (config, cls_name, causal, setup))
            self.procs.append(proc)

    def run(self, methods, job, search, progress):
        """Every method's row ({method: MethodPlan}); the steps traced go into job.records."""
        from . import _say
        from .. import methods as _methods

        # the slowest first (their steps traced whole, or chunked heads), so that the last
        # method done is a quick one
        def cost(m):
            p = _methods.parse(m)
            return -(2 * p.offload + (p.head == "trl") + (p.checkpoint is not None))

        todo, rows, busy = sorted(methods, key=cost), {}, {}
        try:
            for proc in self.procs:
                if todo:
                    busy[proc.stdout.fileno()] = (proc, todo.pop(0))
                    _send(proc.stdin, (busy[proc.stdout.fileno()][1], search))
            while busy:
                ready, _, _ = select.select(list(busy), [], [])
                for fd in ready:
                    proc, method = busy.pop(fd)
                    answer = _receive(proc.stdout)
                    if answer is None:
                        proc.wait()
                        proc.err.seek(0)
                        raise RuntimeError(
                            "tempo.plan: a planning process failed on %s:\n%s"
                            % (method, proc.err.read().decode(errors="replace")[-2000:])
                        )
                    row, records, primed = answer
                    rows[method] = row
                    job.records.update(records)
                    job.primed.update(primed)
                    _say(progress, row, len(rows), len(methods))
                    if todo:
                        busy[fd] = (proc, todo.pop(0))
                        _send(proc.stdin, (busy[fd][1], search))
        finally:
            for proc in self.procs:
                try:
                    _send(proc.stdin, None)
                    proc.stdin.close()
                except (BrokenPipeError, OSError):
                    pass
                proc.wait()
                proc.err.close()
        return rows


def main():
    config, cls_name, causal, setup = _receive(sys.stdin.buffer)
    import transformers

    from . import _Job, _planned

    job = _Job(config, getattr(transformers, cls_name), causal, setup)
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write to the answers' stream
    while True:
        task = _receive(sys.stdin.buffer)
        if task is None:
            return
        method, search = task
        seen = set(job.records)
        row = _planned(job, method, search)
        row._search = None
        records = {k: v for k, v in job.records.items() if k not in seen}
        _send(out, (row, records, {k[:3] for k in records}))


if __name__ == "__main__":
    main()
