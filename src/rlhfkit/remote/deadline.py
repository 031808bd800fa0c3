"""Socket reads and writes under one deadline for a whole exchange, not a timeout per call.

A socket timeout bounds each `recv`: a peer that sends a byte just inside it, again and again (slowloris on the
server, a dripping answer on the client), holds the reader's thread for as long as it likes. Here every `recv` and
`sendall` first sets the socket's timeout to the time left until `deadline` (`time.monotonic()` seconds), so the
whole exchange ends by then with `TimeoutError`, and the thread that waits on it ends too.

`DeadlineReader` is the raw stream under an `io.BufferedReader` (the server's `rfile`, http.client's response);
`DeadlineSocket` hands http.client a socket whose reads and writes keep one deadline. Standard library only.
"""

from __future__ import annotations

import io
import socket
import time


class ReadLimitExceeded(OSError):
    """More bytes arrived than the reader allows for this exchange (`DeadlineReader.limit`)."""


class DeadlineReader(io.RawIOBase):
    """The socket `sock` read through `stream` (its unbuffered `makefile("rb", buffering=0)`), every read waiting at
    most until `deadline` (None: the socket's own timeout) and, when `limit` is set, stopping at `limit` bytes
    received in all (ReadLimitExceeded past it). `received` counts the bytes read so far; `expired` says a read
    timed out."""

    def __init__(self, stream, sock: socket.socket, deadline: float | None = None):
        super().__init__()
        self.stream, self.sock, self.deadline = stream, sock, deadline
        self.limit: int | None = None
        self.received = 0
        self.expired = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self.limit is not None:
            room = self.limit - self.received
            if room <= 0:
                raise ReadLimitExceeded(f"more than {self.limit} bytes")
            buffer = memoryview(buffer)[:room]
        try:
            arm(self.sock, self.deadline)
            n = self.stream.readinto(buffer)
        except TimeoutError:
            self.expired = True
            raise
        self.received += n or 0
        return n

    def close(self) -> None:
        if not self.closed:
            self.stream.close()  # the socket's own file: the socket closes once every user of it has
        super().close()


class DeadlineSocket:
    """`sock` as http.client uses it (`sendall`, `makefile`, `close`), each send and read ending by `deadline`."""

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock, self.deadline = sock, deadline

    def sendall(self, data) -> None:
        arm(self.sock, self.deadline)
        self.sock.sendall(data)

    def makefile(self, mode: str = "rb", *args, **kwargs):
        if mode != "rb":
            raise ValueError(f"DeadlineSocket reads only, not mode {mode!r}")
        return io.BufferedReader(DeadlineReader(self.sock.makefile("rb", buffering=0), self.sock, self.deadline))

    def close(self) -> None:
        self.sock.close()

    def __getattr__(self, name):  # anything else (fileno, getpeername, ...) as the socket has it
        return getattr(self.sock, name)


def arm(sock: socket.socket, deadline: float | None) -> None:
    """Set `sock`'s timeout to the time left until `deadline`; TimeoutError when none is left."""
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the deadline passed")
    sock.settimeout(left)
