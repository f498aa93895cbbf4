"""Entry points: the `eagle3build` command and the runner the workflow's scripts share."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable

from eagle3build.errors import UserError


@contextlib.contextmanager
def _log_to(path: str | None):
    """Send this process's stdout/stderr (also of libraries and children) to the rule's log file."""
    if not path:
        yield
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "a") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def run_rule(job, body: Callable) -> None:
    """Run a rule's body on its job; a UserError ends the job with its message (on the terminal and in the log)."""
    log = job.log[0] if job.log else None
    try:
        with _log_to(log):
            body(job)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        if log:
            with open(log, "a") as f:
                print(f"error: {e}", file=f)
        sys.exit(2)


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="eagle3build", description="EAGLE-3 draft-head build tools")
    p.add_argument("command", choices=["show", "doctor", "stop-servers"], help="what to do")
    args, rest = p.parse_known_args(argv)
    try:
        if args.command == "show":
            from eagle3build.data.prepare import main as show_main

            return show_main(["show", *rest])
        if args.command == "doctor":
            from eagle3build.doctor import main as doctor_main

            return doctor_main(rest)
        from eagle3build.extraction.job import main as extract_main

        return extract_main(["stop", *rest])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
