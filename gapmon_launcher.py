"""The `gapmon` console script's entry point, outside the gapmon package on purpose: importing
gapmon imports torch (seconds), and a Ctrl-C during that import must still end in one line and
exit code 130: not a traceback, not lost to imported code that swallows KeyboardInterrupt, and not an
abort (a KeyboardInterrupt raised while torch's C++ initialisation is calling back into Python reached
std::terminate: exit code -6 with a stack dump, seen once in CI)."""
import os
import signal
import sys


def main() -> int:
    def on_sigint(signum, frame):
        # The import has written nothing and holds nothing to release: leave at once, raising nothing through
        # the C++ frames that may be below this Python frame.
        sys.stderr.write("gapmon: interrupted\n")
        sys.stderr.flush()
        os._exit(130)

    default = signal.getsignal(signal.SIGINT) is signal.default_int_handler  # not when started ignoring it
    if default:
        signal.signal(signal.SIGINT, on_sigint)
    try:
        from gapmon.apps.cli import main as cli_main
    finally:
        if default:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
