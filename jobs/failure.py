"""Why a job failed, in one paragraph an operator can act on, printed after Ray's traceback.

A failure deep in a Ray Data worker arrives wrapped several times (RayTaskError, Ray Data's
UserCodeException, chained causes), with the one useful line buried in a long traceback. `explain`
walks the whole chain and names the cause: disk full, permission denied, an S3 error, a store busy with
another job, a cluster without room, a stalled pipeline; anything else by its innermost message.
"""

from __future__ import annotations

import errno
import re
import sys
import traceback
from collections.abc import Iterator

from pipeline.ingest import ResourceError
from pipeline.store import StoreBusyError, StoreError

_ERRNO = re.compile(r"\[Errno (\d+)\][^:'\n]*(?:: '([^'\n]+)')?")
_AWS = re.compile(r"AWS Error|S3 error|Unable to connect to endpoint|NoSuchBucket|AccessDenied|InvalidAccessKeyId",
                  re.IGNORECASE)


def causes(error: BaseException) -> Iterator[BaseException]:
    """`error` and everything it wraps, outermost first, each once."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        current = pending.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending += [getattr(current, "cause", None), current.__cause__, current.__context__]


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[-1] if text else type(error).__name__


def _os_errors(chain: list[BaseException], texts: list[str]) -> list[tuple[int, str | None]]:
    """(errno, file) of every OS error in the chain: live exceptions, and the `[Errno N] …: 'file'` lines
    of originals that Ray only kept as text (it re-raises a worker's exception as a RayTaskError)."""
    found = [(e.errno, e.filename and str(e.filename)) for e in chain if isinstance(e, OSError) and e.errno]
    for text in texts:
        found += [(int(m.group(1)), m.group(2)) for m in _ERRNO.finditer(text)]
    return found


def explain(error: BaseException, job: str, store_uri: str) -> str:
    chain = list(causes(error))
    texts = [str(e) for e in chain]
    os_errors = _os_errors(chain, texts)

    def failed_with(*codes: int) -> str | None:
        """The file (or the store) an OS error of one of `codes` happened on; None when none did."""
        hits = [path for code, path in os_errors if code in codes]
        return None if not hits else next((p for p in hits if p), store_uri)

    resumable = (f"Nothing published is lost or torn: rerunning `qvpic {job}` resumes where this job stopped "
                 "and compiles nothing twice.")
    if where := failed_with(errno.ENOSPC, errno.EDQUOT):
        return (f"qvpic {job} failed: the disk is full (No space left on device) while writing {where}. "
                f"Free space or point --store at a larger volume. {resumable}")
    if where := failed_with(errno.EACCES, errno.EPERM, errno.EROFS):
        return (f"qvpic {job} failed: permission denied writing {where}. Give the job's user write access to the "
                f"store (on a cluster: every worker node's user). {resumable}")
    if any(_AWS.search(t) for t in texts):
        message = next(_first_line(c) for c, t in zip(chain, texts) if _AWS.search(t))
        return (f"qvpic {job} failed: S3 error on store {store_uri}: {message}. Check the endpoint, bucket and "
                f"credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in the job's environment). {resumable}")
    for current in chain:
        if isinstance(current, StoreBusyError):
            return f"qvpic {job} refused: {current}"
        if isinstance(current, ResourceError):
            return f"qvpic {job} could not start: {current}"
        if type(current).__name__ == "ExecutionTimeoutError":
            return (f"qvpic {job} stalled: no data moved through the pipeline for its stall timeout. "
                    f"{_first_line(current)} {resumable}")
        if isinstance(current, (StoreError, FileNotFoundError)):
            return f"qvpic {job} failed: {_first_line(current)}"
    innermost = chain[-1]
    return f"qvpic {job} failed: {type(innermost).__name__}: {_first_line(innermost)}. {resumable}"


def report(error: BaseException, job: str, store_uri: str) -> None:
    """The traceback for the record, then the paragraph that says what to do."""
    traceback.print_exception(error, file=sys.stderr)
    print(f"\n{explain(error, job, store_uri)}", file=sys.stderr)
