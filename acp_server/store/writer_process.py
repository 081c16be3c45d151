"""The store's writer process: reads rounds from the server on stdin, makes them durable with a
:class:`~.writer.StoreWriter`, and answers on stdout (the frames of :mod:`.records`).

The writer runs in a process of its own so that its Python work and its ``sqlite3`` calls never take
the event loop's GIL. It holds the state directory's lock with the server (inherited): after a
``kill -9`` of the server it writes what it was sent, exits at end of input, and only then can the
next server take the directory. Between rounds it folds the logged rounds into the tables
(:meth:`~.writer.StoreWriter.compact`), in slices short enough not to delay the next round, and a
:class:`Checkpointer` thread copies the WAL into the database file beside it.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import pathlib
import select
import signal
import sqlite3
import sys
import threading
import time
from collections.abc import Sequence

from .records import READS, RoundReader, decode_ops, encode_frame
from .writer import ReadEvent, StoreWriter

__all__ = ["Checkpointer", "main", "serve"]

log = logging.getLogger("acp_server.store.writer")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


#: how long one compaction transaction may take (rounds that arrive meanwhile wait that long): its
#: number of rounds follows from the time the last one took per round
COMPACT_SLICE_S = 0.002
#: from this many logged rounds on, compact whenever no round is waiting; below it, only once the
#: server has been quiet for :data:`QUIET_S`
COMPACT_AT = 256
QUIET_S = 0.05


#: how often the checkpointer copies the WAL into the database file (when there were writes)
CHECKPOINT_EVERY_S = 0.25
#: WAL frames (pages) past which the checkpointer makes the writer wait so that the WAL restarts
WAL_RESTART_FRAMES = 16384


class Checkpointer(threading.Thread):
    """Copies the WAL into the database file from a connection and thread of its own, so that the
    writer's commits never wait for it (a checkpoint syncs the file: tens of ms on a slow disk).

    PASSIVE checkpoints run beside the writer; should the WAL still grow past
    :data:`WAL_RESTART_FRAMES`, one RESTART checkpoint makes the writer wait until it can start over.
    """

    def __init__(self, path: pathlib.Path) -> None:
        super().__init__(name="acp-server store checkpointer", daemon=True)
        self._path = path
        self._wake = threading.Event()
        self._stopping = False
        #: checkpoints run (tests)
        self.checkpoints = 0

    def written(self) -> None:
        """The writer committed: a checkpoint is due at the next tick."""
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self.join()

    def run(self) -> None:
        db = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA busy_timeout=10000")
            while not self._stopping:
                self._wake.wait()
                self._wake.clear()
                if self._stopping:
                    break
                try:
                    _, frames, _ = db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                    if frames >= WAL_RESTART_FRAMES:
                        db.execute("PRAGMA wal_checkpoint(RESTART)")
                    self.checkpoints += 1
                except sqlite3.Error:
                    log.exception("a checkpoint of the session store failed (the WAL keeps growing until one works)")
                time.sleep(CHECKPOINT_EVERY_S)
        finally:
            db.close()


def serve(writer: StoreWriter, rfd: int, wfd: int, checkpointer: Checkpointer | None = None) -> None:
    """Make the rounds read from ``rfd`` durable until end of input, answering each transaction on
    ``wfd``; apply them to the tables in the gaps, then all of them at end of input.

    The rounds that arrived together (the server sent them while the previous transaction ran) are
    logged in one transaction, as they are (no decoding). A round that reads is applied at once, after
    everything logged. A failing ``sqlite3`` call loses that transaction's records: the answer carries
    the error, and the writer goes on. Once nobody reads the answers (the server died), the writer still
    writes what it was sent.
    """
    reader = RoundReader()
    answering = True
    per_round = 0.001  # seconds one logged round took to apply, last time
    while True:
        logged = writer.logged
        if logged:
            timeout = 0.0 if logged >= COMPACT_AT else QUIET_S
            if not select.select([rfd], [], [], timeout)[0]:
                try:
                    started = time.perf_counter()
                    done = writer.compact(max(1, min(logged, int(COMPACT_SLICE_S / per_round))))
                    per_round = max(1e-5, (time.perf_counter() - started) / done)
                    if checkpointer is not None:
                        checkpointer.written()
                except sqlite3.Error:
                    log.exception("the session store could not apply its log (kept, tried again later)")
                    time.sleep(QUIET_S)
                continue
        data = os.read(rfd, 1 << 20)
        if not data:
            if reader.pending:
                log.warning("the server's last round was cut short (%d bytes): not written", reader.pending)
            break
        rounds = reader.feed(data)
        if not rounds:
            continue
        error: str | None = None
        reads: list[tuple[int, list[ReadEvent]]] = []
        try:
            if any(flags & READS for _, flags, _ in rounds):
                reads = writer.apply([op for _, _, payload in rounds for op in decode_ops(payload)])
            else:
                writer.log([payload for _, _, payload in rounds])
            if checkpointer is not None:
                checkpointer.written()
        except sqlite3.Error as exc:
            error = f"{type(exc).__name__}: {exc}"
            log.error("the session store could not write %d round(s): %s", len(rounds), error)
        if answering:
            try:
                _write_all(wfd, encode_frame([rounds[-1][0], error, reads]))
            except BrokenPipeError:
                answering = False  # the server is gone: write the rest of what it sent, then exit
    try:
        writer.compact()
    except sqlite3.Error:
        log.exception("the session store could not apply its log (applied at the next start)")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m acp_server.store.writer_process --db PATH``: the store's writer process (started by the server)."""
    parser = argparse.ArgumentParser(prog="acp-server store writer")
    parser.add_argument("--db", required=True, help="the database file")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    # The server ends us by closing our stdin, after its last round: a Ctrl-C or SIGTERM sent to the
    # whole process group must not cut that round short.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
    )
    # Nothing here makes reference cycles, and collecting the lists each round decodes cost ~15% of
    # the writer's time.
    gc.freeze()
    gc.disable()
    writer = StoreWriter(args.db, autocheckpoint=False)
    checkpointer = Checkpointer(writer.path)
    checkpointer.start()
    try:
        writer.reload()
        serve(writer, sys.stdin.fileno(), sys.stdout.fileno(), checkpointer)
    finally:
        checkpointer.stop()
        writer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
