"""Run by test_pool_registrars.py in a child: a teardown that raised (a signal handler's TimeoutError, as
tests/pool/test_teardown_raises.py uses) leaves the pool CLOSING with an unpin worker in a wedged unregister; the
pool's finalizer then resumes the teardown inline and must book the leak and return, whichever call is wedged
(the runtime's, or an engine's: the runtime then unpins nothing the engine may hold)."""

import faulthandler
import gc
import signal
import sys
import threading
import time
import warnings

import pinpool
from pinpool.testing import FakeRegistrar, FakeRuntime

MiB = 1 << 20
which = sys.argv[1]
release = threading.Event()


def before(op, ptr, nbytes):
    if op == "unregister":
        release.wait()  # wedged until the end of the script


fake = FakeRuntime(before_call=before if which == "runtime" else None)
engines = [FakeRegistrar("engine", before_call=before)] if which == "registrar" else []
pool = pinpool.PinnedPool(
    size="16MiB", chunk_bytes="2MiB", runtime=fake, registry=None, unpin_workers=2, registrars=engines
)
pool.open()


def alarm(signum, frame):
    raise TimeoutError("alarm")


signal.signal(signal.SIGALRM, alarm)
signal.setitimer(signal.ITIMER_REAL, 0.2, 0.004)
try:
    pool.close()
except BaseException as exc:
    print("close raised", type(exc).__name__)
signal.setitimer(signal.ITIMER_REAL, 0)
print("state", pool.state.value, flush=True)
done = threading.Event()


def watchdog():
    if not done.wait(10):
        print("FINALIZER STILL BLOCKED after 10 s", flush=True)
        faulthandler.dump_traceback(all_threads=True)
        release.set()


threading.Thread(target=watchdog, daemon=True).start()
t0 = time.monotonic()
warnings.simplefilter("ignore")
del pool
gc.collect()
done.set()
print(
    f"finalizer returned after {time.monotonic() - t0:.2f}s; runtime holds {len(fake.registered)}, "
    f"engine holds {len(engines[0].registered) if engines else '-'}",
    flush=True,
)
release.set()
