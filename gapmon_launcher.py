"""The `gapmon` console script's entry point, outside the gapmon package on purpose: importing
gapmon imports torch (seconds), and a Ctrl-C during that import must still end in one line and
exit code 130, not a traceback, nor be lost to imported code that swallows KeyboardInterrupt."""
import signal
import sys


def main() -> int:
    interrupted = []

    def on_sigint(signum, frame):
        interrupted.append(signum)  # kept even if an import's bare `except:` swallows the exception
        raise KeyboardInterrupt

    default = signal.getsignal(signal.SIGINT) is signal.default_int_handler  # not when started ignoring it
    if default:
        signal.signal(signal.SIGINT, on_sigint)
    try:
        from gapmon.apps.cli import main as cli_main
    except KeyboardInterrupt:
        interrupted.append(signal.SIGINT)
    finally:
        if default:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    if interrupted:
        print("gapmon: interrupted", file=sys.stderr)
        return 130
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
