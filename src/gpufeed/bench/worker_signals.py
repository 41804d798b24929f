"""Imported only into the benchmark's forkserver (`loader._context` preloads it): the server's
children restore the signal handlers it had before it began serving, so with SIGINT ignored
here a loader worker ignores Ctrl-C from its first instruction. Set in the worker's own main, a
Ctrl-C that arrived while multiprocessing was still starting it printed a traceback; the parent
handles Ctrl-C and stops its workers."""

import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
