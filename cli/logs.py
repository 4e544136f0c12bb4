"""How every `dlo` process logs: plain text lines or JSON lines, chosen once at its start.

Owns: `LOG_FORMAT_ENV` (`DLO_LOG_FORMAT`, the default of each process's `--log-format`, so that a
pod sets it once), the flag (`add_log_format_argument`, `log_format`), `configure_logging` (the
root logger's one handler on stderr), the two formatters: `OneLineFormatter` (text: the process's
own line format, control characters escaped so that nothing a name holds can forge or split a
line) and `JsonLines` (one JSON object per line: `timestamp`, `severity`, `logger`, `message`, the
record's extra fields, the process's own fields such as `rank`, `exc_info` for a traceback), the
filter that adds `logger` and the process's fields to kopf's own JSON records too
(`add_process_fields`), and `say`/`LogLines`/`log_lines`, the lines a person at a terminal reads
that must still be JSON records under `--log-format json`.
Must never: import a part of dlo, or format what a process writes on stdout (its results, `--json`).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from typing import Any, Literal, Mapping

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

LogFormat = Literal["text", "json"]
FORMATS: tuple[LogFormat, ...] = ("text", "json")
LOG_FORMAT_ENV = "DLO_LOG_FORMAT"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
# kopf's words for the levels (its JSON records carry them): one vocabulary in every process's JSON
SEVERITY = ((logging.DEBUG, "debug"), (logging.INFO, "info"), (logging.WARNING, "warn"), (logging.ERROR, "error"))

NOT_FIELDS = ("color_message",)  # uvicorn's copy of its message with terminal colours

_CONTROL = re.compile(r"[\x00-\x1f\x7f\x85\u2028\u2029]")
_current: LogFormat = "text"


def log_format(text: str) -> LogFormat:
    """`--log-format`'s type (its default, `$DLO_LOG_FORMAT`, goes through it too)."""
    if text not in FORMATS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a log format: text or json (the default comes from ${LOG_FORMAT_ENV})")
    return text  # type: ignore[return-value]


def env_log_format() -> LogFormat:
    """`$DLO_LOG_FORMAT` where it names a format, else text (a process without the flag)."""
    value = os.environ.get(LOG_FORMAT_ENV, "")
    return value if value in FORMATS else "text"  # type: ignore[return-value]


def add_log_format_argument(parser: Any) -> None:
    """`--log-format text|json` on a parser or an argument group, defaulting to `$DLO_LOG_FORMAT`."""
    parser.add_argument("--log-format", type=log_format, default=os.environ.get(LOG_FORMAT_ENV) or "text",
                        metavar="text|json",
                        help=f"log records as text lines, or one JSON object per line (timestamp, severity, "
                             f"logger, message and the record's fields) for a log collector; default "
                             f"${LOG_FORMAT_ENV}, else text%(default).0s")


class OneLineFormatter(logging.Formatter):
    """One record, one line: control characters of the message (a newline in a folder name, say)
    are written escaped (`\\n`). Tracebacks (`exc_info`) still follow on their own lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        record.message = _CONTROL.sub(lambda m: repr(m.group())[1:-1], record.message)
        return super().formatMessage(record)


class JsonLines(JsonFormatter):
    """One JSON object per record, the keys of kopf's JSON records (`timestamp`, `severity`,
    `message`) plus what `ProcessFields` adds; JSON escapes every control character."""

    def __init__(self) -> None:
        super().__init__("%(message)s", timestamp=True, reserved_attrs=[*RESERVED_ATTRS, *NOT_FIELDS])

    def add_fields(self, log_record: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]) -> None:
        super().add_fields(log_record, record, message_dict)
        log_record["severity"] = severity(record.levelno)


def severity(levelno: int) -> str:
    return next((word for level, word in SEVERITY if levelno <= level), "fatal")


class ProcessFields(logging.Filter):
    """Adds the logger's name (`logger`) and the process's own fields (`rank`, say) to each record."""

    def __init__(self, fields: Mapping[str, Any]):
        super().__init__()
        self.fields = dict(fields)

    def filter(self, record: logging.LogRecord) -> bool:
        record.logger = record.name
        for key, value in self.fields.items():
            setattr(record, key, value)
        return True


def configure_logging(fmt: LogFormat, level: int | str, *, text_format: str = TEXT_FORMAT,
                      fields: Mapping[str, Any] | None = None) -> None:
    """The root logger: one handler on stderr in `fmt` at `level` (a name or a number); `fields`
    go into every JSON record (text lines carry what `text_format` says)."""
    global _current
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLines() if fmt == "json" else OneLineFormatter(text_format))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    _current = fmt
    if fmt == "json":
        add_process_fields(fields or {})


def add_process_fields(fields: Mapping[str, Any]) -> None:
    """`ProcessFields` on every handler of the root logger (kopf's JSON handler in the operator)."""
    global _current
    _current = "json"
    for handler in logging.getLogger().handlers:
        handler.addFilter(ProcessFields(fields))


def say(text: str, level: int = logging.INFO, logger: str = "dlo") -> None:
    """A line for whoever reads stderr: printed as it is under text logs, a record of `logger` under
    JSON logs (so that a collector parses every line)."""
    if _current == "json":
        logging.getLogger(logger).log(level, text)
    else:
        print(text, file=sys.stderr, flush=True)


def log_lines(logger: str) -> "LogLines | None":
    """Under JSON logs, a stream whose lines become records of `logger`; None under text logs (the
    caller writes to stderr as it would)."""
    return LogLines(logger) if _current == "json" else None


class LogLines:
    """A text stream (what `print(..., file=)` writes to) that turns each line into an INFO record
    of `logger`: progress lines under JSON logs. Not a terminal."""

    def __init__(self, logger: str):
        self.log = logging.getLogger(logger)
        self._partial = ""

    def write(self, text: str) -> int:
        *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            if line:
                self.log.info(line)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False
