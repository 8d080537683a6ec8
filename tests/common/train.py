"""A stand-in for a training script under `archfs run`, for the life-cycle tests.

    train.py MOUNT LOG HOW

It reads from the mount, keeps a file there open, starts a "DataLoader worker" that holds
another file open and outlives it, records in LOG (one line per event) its signal mask and
every signal it handles, checking in each handler that the mount is still readable, and
then ends as HOW says: `wait` (until SIGTERM, then exit 7), `exit0`, `exit3`, `abort`
(killed by SIGABRT), `sleep` (until killed from outside), `oom` (allocates until the
OOM killer ends it, once LOG's directory holds a file `go`) or `epoch` (lists the tree
and reads 200 files of `data/`, which starts the preload and the push, then exits 0).
"""

import os
import signal
import subprocess
import sys
import time

mnt, log, how = sys.argv[1], sys.argv[2], sys.argv[3]
want = b"hello archfs\n"


def record(line):
    with open(log, "a") as f:
        f.write(line + "\n")


def readable():
    with open(os.path.join(mnt, "hello.txt"), "rb") as f:
        return f.read() == want


status = dict(
    line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines() if ":\t" in line
)
record("blocked " + status["SigBlk"].strip())
record("pid %d" % os.getpid())
held = open(os.path.join(mnt, "sub/big.bin"), "rb")
held.read(4096)
worker = subprocess.Popen(
    [sys.executable, "-c", "import sys,time; f=open(sys.argv[1],'rb'); f.read(1); "
     "print('holding', flush=True); time.sleep(3600)", os.path.join(mnt, "hello.txt")],
    stdout=subprocess.PIPE,
    start_new_session=True,
)
assert worker.stdout.readline() == b"holding\n"
record("worker %d" % worker.pid)


def on_signal(signo, frame):
    record("signal %s readable %s" % (signal.Signals(signo).name, readable()))
    if signo == signal.SIGTERM:
        sys.exit(7)


for s in ("SIGHUP", "SIGINT", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGTERM",
          "SIGCONT", "SIGWINCH"):
    signal.signal(getattr(signal, s), on_signal)
record("ready readable %s" % readable())

if how == "wait":
    while True:
        time.sleep(0.05)
elif how == "exit0":
    sys.exit(0)
elif how == "exit3":
    sys.exit(3)
elif how == "abort":
    os.abort()
elif how == "sleep":
    time.sleep(3600)
elif how == "epoch":
    names = sorted(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(mnt, "data"))
                   for f in fs)
    for p in names[:200]:
        with open(p, "rb") as f:
            f.read()
    record("epoch %d of %d files read" % (min(200, len(names)), len(names)))
    sys.exit(0)
elif how == "oom":
    go = os.path.join(os.path.dirname(log), "go")
    while not os.path.exists(go):
        time.sleep(0.05)
    hog = []
    while True:
        hog.append(b"x" * (8 << 20))
sys.exit("unknown HOW " + how)
