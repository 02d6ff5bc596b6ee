"""The settings a client gives at login, read as PostgreSQL reads them (docs/proxy.md, "Settings at login").

A StartupMessage sets configuration parameters two ways: its ``options`` parameter, a command line
(``options=-c anonproxy.epsilon=0.1``, libpq's ``PGOPTIONS``), and any other parameter named after a setting
(``application_name``, asyncpg's ``server_settings``). PostgreSQL applies the options first, then the other
parameters, each in order. The proxy forwards the StartupMessage unchanged; for a gated role it then checks each
setting as it checks the same ``SET`` after login (anonproxy.route.commands), and applies the ``anonproxy.*``
ones itself, so that none is silently ignored.

Pure: :func:`login_settings` returns the settings, or raises :class:`LoginOptionError` for an option the proxy
does not read (only ``-c name=value`` and ``--name=value`` carry settings a session may give).
"""

from __future__ import annotations

from dataclasses import dataclass

# Startup parameters that are not settings: who connects, where, the options line, and protocol extensions.
_NOT_SETTINGS = frozenset({"user", "database", "options", "replication"})


@dataclass(frozen=True)
class LoginSetting:
    name: str  # lower case, as PostgreSQL looks settings up
    value: str
    given: str  # how the client gave it, for messages: "options -c name=value" or "startup parameter name"


class LoginOptionError(Exception):
    """An option of the ``options`` parameter that the proxy does not read."""


def login_settings(parameters: dict[str, str]) -> list[LoginSetting]:
    """Every setting of a StartupMessage's parameters, in the order PostgreSQL applies them."""
    settings = [_setting(argument) for argument in _split(parameters.get("options") or "")]
    for name, value in parameters.items():
        if name in _NOT_SETTINGS or name.startswith("_pq_."):
            continue
        settings.append(LoginSetting(name.lower(), value, f"startup parameter {name}"))
    return settings


def _split(options: str) -> list[str]:
    """The arguments of an ``options`` line: words separated by white space, a backslash escaping the next
    character (PostgreSQL's pg_split_opts)."""
    words: list[str] = []
    current: list[str] | None = None
    escaped = False
    for character in options:
        if character.isspace() and not escaped:
            if current is not None:
                words.append("".join(current))
                current = None
            continue
        current = current if current is not None else []
        if character == "\\" and not escaped:
            escaped = True
            continue
        escaped = False
        current.append(character)
    if current is not None:
        words.append("".join(current))
    return _join_c(words)


def _join_c(words: list[str]) -> list[str]:
    """``-c`` followed by its argument as a separate word becomes one ``-cname=value`` argument."""
    joined, index = [], 0
    while index < len(words):
        if words[index] == "-c" and index + 1 < len(words):
            joined.append("-c" + words[index + 1])
            index += 2
        else:
            joined.append(words[index])
            index += 1
    return joined


def _setting(argument: str) -> LoginSetting:
    if argument.startswith("--") and len(argument) > 2:
        body, form = argument[2:], "--"
    elif argument.startswith("-c") and len(argument) > 2:
        body, form = argument[2:], "-c "
    else:
        raise LoginOptionError(argument)
    name, equals, value = body.partition("=")
    if not equals or not name:
        raise LoginOptionError(argument)
    # PostgreSQL reads a dash in the name as an underscore (--work-mem=64MB is work_mem).
    name = name.replace("-", "_").lower()
    return LoginSetting(name, value, f"options {form}{name}={value}")
