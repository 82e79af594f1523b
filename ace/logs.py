"""Log messages stay on one line: CR, LF and the other line breaks in a message are written as escapes.

Values from users reach log messages (endpoint names and URLs, model ids, upstream error texts); a newline in one
would start a line of its own, which a reader or a log shipper takes for a separate, forged, entry. Tracebacks
are not messages (logging appends them after the formatted line) and keep their lines.
"""

from __future__ import annotations

import logging

_ESCAPES = str.maketrans({"\r": "\\r", "\n": "\\n", "\x0b": "\\v", "\x0c": "\\f", "\x1c": "\\x1c",
                          "\x1d": "\\x1d", "\x1e": "\\x1e", "\x85": "\\x85", "\u2028": "\\u2028",
                          "\u2029": "\\u2029"})  # fmt: skip


class OneLineRecord(logging.LogRecord):
    def getMessage(self) -> str:  # noqa: N802 - logging's name
        return super().getMessage().translate(_ESCAPES)


def one_line_messages() -> None:
    """Make every log record of this process a OneLineRecord (web, worker and commands alike: all load settings)."""
    if logging.getLogRecordFactory() is logging.LogRecord:
        logging.setLogRecordFactory(OneLineRecord)
