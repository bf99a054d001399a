"""The command line's exit statuses, and the table ``--help`` prints of them."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_PIN_FAILED = 3
EXIT_INTERRUPTED = 130
EXIT_PIPE = 141

EXIT_CODES = """\
exit status:
  0    success; for pin --hold, also when Ctrl-C or SIGTERM ends the hold (the pool is unpinned first)
  1    doctor: a check failed; pin: unpinning failed
  2    bad input: usage error, ConfigError (size, layout, option, environment variable),
       or a metrics address that cannot be served
  3    pinning failed and was rolled back (PinError), or the memory could not be mapped or is already pinned
  130  interrupted (Ctrl-C or SIGTERM) and rolled back, or interrupted while the pool was unpinned
       at the end (it finishes unpinning first): nothing stays pinned
  141  stdout was closed early (e.g. piped into head)"""
