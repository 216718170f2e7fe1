"""A Redis URL that names its password instead of carrying it, and redaction of passwords in
messages: vLLM logs its arguments (``kv_connector_extra_config`` included) and kvlab's own
errors quote the URL, so a password written in the URL would end up in every log.

``redis://127.0.0.1:6379/0?password_file=/path/to/file`` reads the password from that file
(its first line; keep it mode 0600), ``redis://127.0.0.1:6379/0?password_env=NAME`` from the
environment variable ``NAME``. :func:`resolve_redis_url` puts it in for ``redis.Redis.from_url``
only; everything shown to people goes through :func:`redact`, which finds a password whatever
characters it holds (``/``, ``#``, ``?``, ``@``, spaces, not percent-encoded). Files holding
secrets are read as kvlab.store.safe_paths opens them: no other user can swap them. A Redis Cluster's URL is
``redis-cluster://host:port`` with the same arguments: one node is enough, the client finds
the others (kvlab.store.tiers.redis_cluster)."""

from __future__ import annotations

import os
import re
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

from kvlab.store.safe_paths import read_private_file

PASSWORD_FILE, PASSWORD_ENV = "password_file", "password_env"
CLUSTER_SCHEME = "redis-cluster"
REDIS_SCHEMES = ("redis://", "rediss://", "unix://", CLUSTER_SCHEME + "://")
_SCHEME = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://")
# where a URL's user information may end: an '@' before a host (and port) that ends the URL, or
# is followed by its path, query or fragment (or, in a message, a quote, a space, a bracket)
_HOST_AFTER = re.compile(r"@(?:\[[0-9A-Fa-f:.]*\]|[^\s/?#@'\"()\[\],;:]*)"  # a host, [IPv6] or a name
                         r"(?::[^\s/?#@'\"()\[\],;]*)?"  # a port (any text: a bad one is still a port)
                         r"(?=[/?#\s'\"),;]|$)")
_QUERY_PASSWORD = re.compile(r"[?&]password=")


def resolve_redis_url(url: str) -> str:
    """``url`` with the password its ``password_file`` or ``password_env`` names in place of
    that argument, for ``redis.Redis.from_url``; ``url`` itself when it names none. A
    missing file, unset variable or empty password is a ValueError naming the argument."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    named = [(key, value) for key, value in query if key in (PASSWORD_FILE, PASSWORD_ENV)]
    if not named:
        return url
    if len(named) > 1 or parts.password is not None or any(key == "password" for key, _ in query):
        raise ValueError(f"redis_url: give one of a password, {PASSWORD_FILE} or {PASSWORD_ENV}, not several")
    key, value = named[0]
    if key == PASSWORD_FILE:
        try:
            password = read_private_file(value, f"redis_url: {PASSWORD_FILE} {value!r}").decode()
            password = password.split("\n", 1)[0].rstrip("\r")
        except OSError as error:
            raise ValueError(f"redis_url: {PASSWORD_FILE} {value!r} cannot be read ({error.strerror})") from None
        except UnicodeDecodeError:
            raise ValueError(f"redis_url: {PASSWORD_FILE} {value!r} is not UTF-8 text") from None
        if not password:
            raise ValueError(f"redis_url: {PASSWORD_FILE} {value!r} holds no password on its first line")
    else:
        password = os.environ.get(value, "")
        if not password:
            raise ValueError(f"redis_url: {PASSWORD_ENV} names {value!r}, an environment variable that is "
                             + ("empty" if value in os.environ else "not set"))
    user, _, host = parts.netloc.rpartition("@")
    netloc = f"{user}:{quote(password, safe='')}@{host}"
    rest = urlencode([(k, v) for k, v in query if k != key])
    return urlunsplit((parts.scheme, netloc, parts.path, rest, parts.fragment))


def check_redis_url(url: str) -> None:
    """Raise ValueError (the URL redacted) unless redis-py reads ``url`` as it is written (a
    password holding '/', '?', '#' or '@' must be percent-encoded, or better named) and the
    password file or variable it names holds a password."""
    if not url.startswith(REDIS_SCHEMES):
        raise ValueError(f"redis_url must start with {', '.join(REDIS_SCHEMES[:-1])} or {REDIS_SCHEMES[-1]}, "
                         f"got {redact(url)!r}")
    parts = urlsplit(url)
    authority = url.index("://") + 3
    at = _last_at(url, authority)
    if at is not None and at >= authority + len(parts.netloc):  # an '@' past the host redis-py would read
        raise ValueError(f"redis_url holds an '@' after its host, so it cannot be read as written "
                         f"({redact(url)!r}): a password holding '/', '?', '#' or '@' must be percent-encoded, "
                         f"or better named (?{PASSWORD_FILE}=/path or ?{PASSWORD_ENV}=VARIABLE: vLLM logs its "
                         "arguments), and an '@' in an argument written %40")
    try:
        parts.port
    except ValueError:
        raise ValueError(f"redis_url's port must be a number, got {redact(url)!r}") from None
    if is_cluster_url(url) and (not parts.hostname or parts.path.strip("/") not in ("", "0")):
        raise ValueError(f"redis_url redis-cluster://host:port names one node of the cluster and no database "
                         f"(a cluster has only database 0), got {redact(url)!r}")
    resolve_redis_url(url)


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` names a Redis Cluster (one of its nodes) rather than one server."""
    return url.startswith(CLUSTER_SCHEME + "://")


def redact(text: str) -> str:
    """``text`` (a URL or a message quoting one) with every URL's password as ``***``, whatever
    characters it holds: in its user information (up to the last '@' that is followed by a host)
    and in a ``?password=`` argument (to the end of the text: where such a URL ends cannot be told).
    Where in doubt, more is hidden, never less."""
    hidden = []  # spans of text to hide
    for scheme in _SCHEME.finditer(text):
        at = _last_at(text, scheme.end())
        user, colon, _ = text[scheme.end():at].partition(":") if at is not None else ("", "", "")
        if colon:
            hidden.append((scheme.end() + len(user) + 1, at))
    query = _QUERY_PASSWORD.search(text)
    if query is not None:
        hidden.append((query.end(), len(text)))
    out, done = [], 0
    for start, end in sorted(hidden):
        if end > done:
            out.append(text[done:max(start, done)] + ("***" if start >= done else ""))
            done = end
    return "".join(out) + text[done:]


def _last_at(text: str, start: int) -> int | None:
    """Where the user information of the URL whose authority starts at ``start`` may end: the
    last '@' after it that is followed by a host (None: there is none)."""
    ends = list(_HOST_AFTER.finditer(text, start))
    return ends[-1].start() if ends else None


def read_auth_key(spec: str) -> bytes:
    """The store's MAC key that ``spec`` names: ``file:/path`` (the file's bytes, trailing
    newline dropped; keep it mode 0600) or ``env:NAME`` (an environment variable), never the
    key itself (vLLM logs its arguments). At least 16 bytes; ValueError naming the key else."""
    kind, _, name = spec.partition(":")
    if kind == "file":
        try:
            key = read_private_file(name, f"auth_key: file {name!r}").rstrip(b"\r\n")
        except OSError as error:
            raise ValueError(f"auth_key: file {name!r} cannot be read ({error.strerror})") from None
    elif kind == "env":
        key = os.environ.get(name, "").encode()
    else:
        raise ValueError("auth_key must name the key, 'file:/path/to/key' or 'env:VARIABLE', not hold it")
    if len(key) < 16:
        raise ValueError(f"auth_key: {spec!r} gives {len(key)} bytes; a key needs at least 16 "
                         "(e.g. head -c 32 /dev/urandom | base64 > key; chmod 600 key)")
    return key
