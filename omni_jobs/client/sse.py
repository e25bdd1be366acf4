"""Server-Sent Events framing, sans-IO: feed it the lines of a text/event-stream, get its messages.

It reads the stream as the WHATWG spec does, so any server's framing works, not only this API's:
``data`` lines of one message are joined with newlines, comment lines (``: keep-alive``) are skipped,
``id`` stays in force until another one comes (it is the Last-Event-ID to resume from), and
``retry`` sets how long to wait before reconnecting.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SseMessage:
    """One dispatched message: its ``event`` name ('message' when it named none), its ``data``, and
    the event id in force when it was dispatched ('' when the stream gave none)."""

    event: str
    data: str
    id: str


class SseParser:
    """One connection's lines -> messages. Make a new one per connection, passing the last id seen."""

    def __init__(self, last_event_id: str = "") -> None:
        self.last_event_id = last_event_id
        """The id to send as Last-Event-ID on the next connection."""
        self.retry_ms: int | None = None
        """The reconnection delay the server asked for, if it did."""
        self._event = ""
        self._data: list[str] = []
        self._first = True

    def feed(self, line: str) -> SseMessage | None:
        """Read one line (without its line ending); a blank line dispatches the message read so far."""
        if self._first:
            self._first = False
            line = line.removeprefix("\ufeff")  # a byte-order mark may start the stream
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self.last_event_id = value
        elif name == "retry" and value.isascii() and value.isdigit():
            self.retry_ms = int(value)
        return None

    def _dispatch(self) -> SseMessage | None:
        data, event = self._data, self._event
        self._data, self._event = [], ""
        if not data:  # no data line: nothing to dispatch (e.g. a block with only retry or id)
            return None
        return SseMessage(event=event or "message", data="\n".join(data), id=self.last_event_id)
