"""Typed errors of the testbed, and the exit code each maps to.

One shutdown path (`testbed.cli.main`) catches `TestbedError` and prints its one-line message;
the class decides the exit code. Bad input is exit code 2, as for argparse.
"""


class TestbedError(Exception):
    """Base of every error the testbed raises on purpose."""

    exit_code = 1


class ConfigError(TestbedError):
    """The experiment description is wrong: unknown key, wrong type, bad unit, impossible scale.

    The message names the file, the key path and what was expected.
    """

    exit_code = 2

    def __init__(self, message, path=None, key=None):
        self.path = path
        self.key = key
        where = ""
        if path:
            where += f"{path}: "
        if key:
            where += f"{key}: "
        super().__init__(one_line(where + str(message)))


MAX_MESSAGE_CHARS = 400


def one_line(text, limit=MAX_MESSAGE_CHARS):
    """`text` as one printable line: control characters escaped, at most `limit` characters."""
    out = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)
    return out if len(out) <= limit else out[:limit - 3] + "..."


class RunDirError(ConfigError):
    """A run directory this testbed cannot read: a file missing or unreadable, or a layout
    (`schema` in metadata.json) newer than this version knows. Bad input: exit code 2."""


class PrivilegeError(TestbedError):
    """The command needs root (network namespaces, tc)."""

    exit_code = 2


class NetworkError(TestbedError):
    """Building or shaping the emulated network failed (carries the errno where there is one)."""

    def __init__(self, message, errno=None):
        self.errno = errno
        super().__init__(message if errno is None else f"{message} (errno {errno})")


class WorkerError(TestbedError):
    """A worker process failed to start or died."""


class RunInterrupted(TestbedError):
    """The user pressed Ctrl-C; the run was torn down and what was measured was kept."""

    exit_code = 130
