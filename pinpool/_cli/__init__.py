"""The pinpool command line (``plan``, ``doctor``, ``pin``): :func:`main` runs one (exit statuses, signals, a
closed stdout). Only torch-free modules are imported at the top, so ``pinpool --help`` answers at once."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Sequence

from .._errors import ConfigError, PinError, PinpoolError, UnpinError
from .._lazy import lazy_exports
from .options import LAYOUT_FILE_MAX_BYTES, cli_size, layout_from_file, pool_options
from .parser import build_parser, glue_negative_values, value_options
from .pin import sigterm_as_interrupt
from .progress import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_PIN_FAILED, EXIT_PIPE

__all__ = ["LAYOUT_FILE_MAX_BYTES", "build_parser", "cli_size", "layout_from_file", "main", "pool_options",
           "sigterm_as_interrupt"]  # fmt: skip

# Names tests read, from the commands' modules on first use (not in __all__: main() is the interface).
__getattr__ = lazy_exports(__name__, {
    "doctor": "CHUNK_ENV FAIL KNOWN_ENV OK SKIP STATUSES WARN Check CudaFacts DoctorFacts check_cuda check_env "
              "check_half_made check_kernel check_region env_chunk_limit exit_code read_facts render_text run_checks",
    "engines": "ENGINES Engine EngineFacts RdmaDevice TransferFacts check_engine check_rdma check_rdma_memlock "
               "library_fix read_engines read_rdma read_transfer_facts transfer_checks",
    "options": "FAMILIES FIELDS family_fields",
    "pin": "faulted_bytes first_line hold",
    "progress": "EventLog ProgressReporter ResidentGrowth format_eta percentile render_bar render_line while_loading",
    "report": "FIRST_TOUCH WIDTH fit pin_text",
})[0]  # fmt: skip

BENCH_MOVED = (
    "`pinpool bench` is no longer part of the installed package: the benchmark is benchmark code and lives "
    "in the repository's benchmarks/ folder. From a checkout run `./dev bench [options]` "
    "(or `python benchmarks/pin_throughput.py --help` with any Python that has pinpool); "
    "the method and results are in docs/performance.md"
)


def _exit_code_of(error: PinpoolError) -> int:
    if isinstance(error, ConfigError):
        return EXIT_BAD_INPUT
    if isinstance(error, UnpinError):
        return EXIT_FAILED
    # PinError, and the failures that leave nothing pinned (AllocationError, AlreadyPinnedError, ...).
    return EXIT_PIN_FAILED if isinstance(error, PinError | MemoryError | RuntimeError) else EXIT_FAILED


def _stdout_gone() -> int:
    """stdout's reader went away: stdout to /dev/null so the final flush is quiet (the Python docs' SIGPIPE recipe)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    with contextlib.suppress(OSError, ValueError):
        os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_PIPE


def _report_interrupt(exc: KeyboardInterrupt) -> None:
    what = str(exc.args[0]) if exc.args and exc.args[0] else "Ctrl-C"
    lines = [f"pinpool: interrupted ({what})"]
    lines.extend(f"pinpool: {note.removeprefix('pinpool: ')}" for note in getattr(exc, "__notes__", ()))
    with contextlib.suppress(Exception, KeyboardInterrupt):  # a second Ctrl-C while saying so: still no traceback
        prefix = "\n" if sys.stderr.isatty() else ""  # past the terminal's ^C
        sys.stderr.write(prefix + "\n".join(lines) + "\n")
        sys.stderr.flush()


def _dispatch(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(glue_negative_values(argv, value_options(parser)))
    try:
        return int(args.run(args))
    except PinpoolError as exc:
        print(f"pinpool: {type(exc).__name__}: {exc}", file=sys.stderr)
        return _exit_code_of(exc)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (argparse raises SystemExit for --help,
    --version and usage errors, with status 0 or 2)."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["bench"]:  # before parsing: whatever bench options follow, say where it went
        print(f"pinpool: {BENCH_MOVED}", file=sys.stderr)
        return EXIT_BAD_INPUT
    with sigterm_as_interrupt() as interrupts:
        try:
            try:
                if interrupts is not None:
                    interrupts.arm()
                code = _dispatch(args)
            finally:
                sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
        except BrokenPipeError:
            return _stdout_gone()
        except KeyboardInterrupt as exc:
            _report_interrupt(exc)
            return EXIT_INTERRUPTED
        finally:
            if interrupts is not None:
                interrupts.defer()
                if args[:1] == ["pin"]:
                    gc.collect()  # whatever of the pool a cycle kept is freed (and unmapped) while signals wait
        if interrupts is not None and interrupts.pending is not None and code == EXIT_OK:
            _report_interrupt(KeyboardInterrupt(interrupts.pending))  # it arrived as the command ended
            return EXIT_INTERRUPTED
    return code
