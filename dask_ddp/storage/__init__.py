"""Filesystem plumbing shared by checkpoints, streaming, metric sinks and ``S3ImageFolder``: the one door.

Runs in: the rank process (checkpoints, ``S3ImageFolder`` and its DataLoader workers) and the client (sinks).

:func:`resolve` gives the filesystem of a URL (:func:`open_fs` a fresh one, pool sized for batches), an S3
one with this process's botocore session (parsed once per process); :func:`call` runs a backend operation and
raises what fails as the builtin a user acts on, with the same text everywhere: ``PermissionError`` for missing
or refused credentials, ``FileNotFoundError`` for a missing bucket or object, each naming the URL and the
backend's code.
No text it produces carries a secret (:func:`redact`), and the backend's exception is not chained.
What is transient and how it is retried is :mod:`.transient`.

The storage wing is this door and what every user of storage shares beside it: the one rule for what is
transient and how it is retried (:mod:`.transient`) and a folder of one user's cached files that no other local
user can read, plant or swap (:mod:`.private`). Used by checkpoints, streaming, ``S3ImageFolder``, the metric
sinks and export.

A process that imported this module freezes, in every child it forks, what the child inherits (``gc.freeze``):
the parent's uncollected S3 filesystems are then never closed there, which cost a DataLoader worker a second
each (``_freeze_inherited``).

May import: :mod:`dask_ddp.wire` (and :mod:`dask_ddp.config`).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import re
from typing import Any, Callable, Mapping
from urllib.parse import quote, unquote

__all__ = ["resolve", "open_fs", "is_local", "read_whole", "one_get", "call", "translate", "redact", "masked",
           "split_userinfo", "without_userinfo", "error_chain", "error_code"]

_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][\w+.-]*://)(?P<info>[^/@\s'\"]+)@")
_SECRET_WORDS = ("key", "secret", "token", "password", "passwd", "credential", "auth", "signature")
_DENIED_CODES = frozenset({"AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                           "ExpiredToken", "InvalidToken", "InvalidSecurity", "AccountProblem", "403"})
_MISSING_CODES = frozenset({"NoSuchBucket", "NoSuchKey", "NoSuchUpload", "NoSuchVersion", "404"})
_ADVICE = ("pass key= and secret= in storage_options or the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY; "
           "anon=True for a public bucket), and check the endpoint and the bucket's policy (local: permissions)")


def resolve(url: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """Return ``(filesystem, path)`` for ``url`` (``fsspec.core.url_to_fs``) with ``storage_options``.

    ``s3://KEY:SECRET@bucket/...`` is read as ``key=KEY, secret=SECRET`` (s3fs would take
    ``KEY:SECRET@bucket`` for the bucket's name); options given explicitly win.

    Raises
    ------
    TypeError
        ``url`` is not a str or path, or ``storage_options`` is not a dict. ValueError: unknown protocol.
    """
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str):
        raise TypeError(f"expected a path or fsspec URL (str), got {type(url).__name__}")
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise TypeError(f"storage_options takes a dict of fsspec options, got {type(storage_options).__name__}")
    url, options = split_userinfo(url, storage_options)
    import fsspec  # here: importing dask_ddp stays light

    fs, path = call(lambda: fsspec.core.url_to_fs(url, **options), url, doing="opening its filesystem",
                    storage_options=options)
    if type(fs).__module__.startswith("s3fs") and fs.session is None and fs._s3 is None and set(fs.kwargs) <= {
            "profile"}:
        fs.session = _s3_session(fs.kwargs.get("profile"))  # set, not passed: the options stay picklable
    return fs, path


def open_fs(root: str, storage_options: Mapping[str, Any]) -> tuple[Any, str]:
    """``(filesystem, root path)``: as :func:`resolve`, but a fresh filesystem (never fsspec's shared instance),
    S3's connection pool sized for batches (64), the path without a trailing ``/``.

    Raises as :func:`resolve`.
    """
    opts = {**storage_options, "skip_instance_cache": True}
    if root.startswith(("s3://", "s3a://")):
        opts["config_kwargs"] = {"max_pool_connections": 64, **(opts.get("config_kwargs") or {})}
    fs, path = resolve(root, opts)
    return fs, path.rstrip("/") or "/"


def _freeze_inherited() -> None:
    """In a forked child (a DataLoader worker, a rank from its zygote): move every object inherited from the parent
    out of the collector's reach (``gc.freeze``). Garbage the parent had not collected yet holds S3 filesystems,
    and s3fs closes a collected one through its event loop, whose thread a forked child does not have: fsspec's
    ``sync`` then waits a whole second before it gives up, once per filesystem (a DataLoader worker's first batch
    waited 1.2-2.5 s in one epoch in four). Frozen, they are freed with the process; the child's own objects are
    collected as ever, and its collections no longer walk (and copy) the inherited heap. Raises nothing."""
    gc.freeze()


os.register_at_fork(after_in_child=_freeze_inherited)


_SESSIONS: dict[tuple, Any] = {}  # (pid, profile) -> this process's aiobotocore session
_LOADERS: dict[str | None, Any] = {}  # profile -> botocore's data loader, with the service models it has parsed


def _s3_session(profile: str | None) -> Any:
    """This process's aiobotocore session for ``profile``, shared by the S3 filesystems :func:`resolve` opens
    (unless the options name a session or session arguments of their own).

    s3fs makes a session per filesystem, and each session parses botocore's S3 service model again (a
    megabyte of JSON). In a DataLoader worker, forked from a rank holding torch, that parse took 0.5-0.6 s
    (0.1 s with the collector off: it walks the inherited heap). The sessions of a profile share one data
    loader, so a worker inherits the models its rank parsed when it read the index. A forked child gets
    sessions of its own (a credential refresher holds asyncio locks of the parent's loop); only the loader
    crosses the fork.
    Raises nothing of its own (ImportError without aiobotocore, which s3fs needs anyway).
    """
    import aiobotocore.session

    key = (os.getpid(), profile)
    session = _SESSIONS.get(key)
    if session is None:
        for old in [k for k in _SESSIONS if k[0] != key[0]]:
            _SESSIONS.pop(old, None)
        session = aiobotocore.session.AioSession(profile=profile)
        if profile in _LOADERS:
            session.register_component("data_loader", _LOADERS[profile])
        else:
            _LOADERS[profile] = session.get_component("data_loader")
        _SESSIONS[key] = session
    return session


def read_whole(fs: Any, path: str) -> bytes:
    """The bytes of the object or file at ``path`` of ``fs``, in one request where the backend allows it
    (:func:`one_get`): the fastest read of a whole object on S3.

    Raises what ``fs.cat_file`` raises (``FileNotFoundError`` for a missing object, the backend's errors).
    """
    return fs.cat_file(path, **one_get(fs.__class__))


@functools.cache
def one_get(cls: Any) -> dict:
    """``cat_file``'s keywords that make a whole-object read of filesystem class ``cls`` one GET.

    s3fs >= 2026.3 turns the read of an object bigger than its block size into a HEAD plus concurrent ranged
    GETs unless ``max_concurrency`` is 1: on S3 and moto that reads at 0.46-0.87x of one GET per object. Empty
    for a class without that keyword. Cached per class (inspecting is not free on a hot path); raises nothing.
    """
    import inspect

    method = getattr(cls, "_cat_file", None) or getattr(cls, "cat_file", None)
    try:
        params = inspect.signature(method).parameters if method is not None else {}
    except (TypeError, ValueError):
        params = {}
    return {"max_concurrency": 1} if "max_concurrency" in params else {}


def is_local(fs: Any) -> bool:
    """Whether ``fs`` is fsspec's local filesystem (files a process can open and map itself)."""
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


def call(fn: Callable[[], Any], url: str, *, doing: str = "accessing it",
         storage_options: Mapping[str, Any] | None = None) -> Any:
    """Return ``fn()``; raise what it raises as :func:`translate` maps it, never with a secret.

    ``url`` (as the user gave it) names the object in messages, redacted. Errors :func:`translate`
    does not map propagate unchanged, unless their text (or a chained one) shows a secret: then
    a redacted copy (same type where it can be rebuilt from a message, else OSError).

    Raises
    ------
    PermissionError, FileNotFoundError
        As :func:`translate` says, not chained (``from None``); anything else as ``fn`` raised it.
    """
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - mapped or re-raised below
        mapped = translate(exc, url, doing=doing, storage_options=storage_options) or _scrubbed(
            exc, _secrets(storage_options, url))
        if mapped is exc:
            raise
    raise mapped from None  # outside the except block: no __context__ holding the backend's text


def translate(exc: BaseException, url: str, *, doing: str = "accessing it",
              storage_options: Mapping[str, Any] | None = None) -> BaseException | None:
    """Map a backend error to the builtin a user acts on, or None when it is neither of these.

    Missing or refused credentials (botocore's ``NoCredentialsError``, ``PartialCredentialsError``,
    ``ClientError`` codes such as ``AccessDenied``, ``InvalidAccessKeyId``, a builtin ``PermissionError``)
    give ``PermissionError("access to URL was denied while DOING (CODE: ...): what to do")``; a missing
    bucket, folder or object ``FileNotFoundError("URL does not exist while DOING (CODE: ...)")``.
    The text is redacted; the error has no cause. It raises nothing.
    """
    kind, code = _classify(exc)
    if kind is None:
        return None
    secrets = _secrets(storage_options, url)
    detail = f"{code}: {str(exc)[:300]}" if str(exc) else code
    if kind is PermissionError:
        text = f"access to {url} was denied while {doing} ({detail}): {_ADVICE}"
    else:
        text = f"{url} does not exist while {doing} ({detail}; no such bucket, prefix, folder or object)"
    return kind(_scrub(redact(text), secrets))


def redact(text: Any, storage_options: Mapping[str, Any] | None = None) -> str:
    """Return ``str(text)`` without URL userinfo or any secret value of ``storage_options``.

    ``s3://key:secret@bucket/x`` becomes ``s3://***@bucket/x`` (its parts go wherever else they appear),
    and so does each value of a secret-looking option (``key``, ``secret``, ``token``, ``password``,
    ``aws_secret_access_key``, ... at any depth, e.g. in ``client_kwargs``). Raises nothing.
    """
    text = str(text)
    return _scrub(_USERINFO.sub(r"\g<scheme>***@", text), _secrets(storage_options, text))


def masked(storage_options: Mapping[str, Any] | None) -> dict:
    """A copy of ``storage_options`` to show, secret-looking values ``'***'`` (at any depth); raises nothing.

    ``{'key': '***', 'secret': '***', 'client_kwargs': {'endpoint_url': 'http://127.0.0.1:5555'}}``
    """
    def show(value):
        if isinstance(value, Mapping):
            return {k: "***" if _secret_key(k) else show(v) for k, v in value.items()}
        return redact(value, storage_options) if isinstance(value, str) else value

    return show(dict(storage_options or {}))


def split_userinfo(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[str, dict]:
    """``("s3://KEY:SECRET@bucket/x", opts)`` -> ``("s3://bucket/x", {"key": KEY, "secret": SECRET, **opts})``.

    s3fs would take ``KEY:SECRET@bucket`` for the bucket's name; options given explicitly win. Other URLs
    come back as they are. Raises nothing.
    """
    options = dict(storage_options or {})
    if found := re.match(r"^(s3a?://)([^/@]*)@", url):
        user, _, password = map(unquote, found[2].partition(":"))
        options = {"key": user, **({"secret": password} if password else {}), **options}
        url = found[1] + url[found.end():]
    return url, options


def without_userinfo(url: str) -> str:
    """``s3://key:secret@bucket/x`` -> ``s3://bucket/x``: a URL to hand back (with options); raises nothing."""
    return re.sub(r"^([a-zA-Z][\w+.-]*://)[^/@]*@", r"\1", url)


def _classify(exc: BaseException) -> tuple[type | None, str]:
    """(PermissionError, FileNotFoundError or None; the backend's code or class name), from exc's chain."""
    chain = _chain(exc)
    code = next((c for c in map(_client_error_code, chain) if c), type(exc).__name__)
    if code in _DENIED_CODES or isinstance(exc, PermissionError) or any(
            isinstance(e, _credential_errors()) for e in chain):
        return PermissionError, code
    return (FileNotFoundError if code in _MISSING_CODES or isinstance(exc, FileNotFoundError) else None), code


def _chain(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []  # the exception, its cause or context, theirs, ... (5 at most)
    while exc is not None and len(chain) < 5:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


def _client_error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)  # botocore's ClientError (what s3fs chains as the cause)
    return str((response.get("Error") or {}).get("Code") or "") if isinstance(response, dict) else ""


def _credential_errors() -> tuple:
    try:  # botocore comes with s3fs; without it there is nothing of its to map
        from botocore import exceptions as e
    except ImportError:
        return ()
    return e.NoCredentialsError, e.PartialCredentialsError, e.CredentialRetrievalError


def _secret_key(name: Any) -> bool:
    return isinstance(name, str) and any(word in name.lower() for word in _SECRET_WORDS)


def _secrets(storage_options: Mapping[str, Any] | None, text: str) -> set[str]:
    """Every secret value: of secret-looking options (any depth), and the userinfo parts of URLs in ``text``."""
    found: set[str] = set()

    def walk(options):
        for k, v in options.items():
            if isinstance(v, Mapping):
                walk(v)
            elif _secret_key(k) and isinstance(v, str):
                found.add(v)

    walk(storage_options or {})
    for match in _USERINFO.finditer(text):
        found.update(match["info"].split(":"))
    found |= {unquote(s) for s in found} | {quote(s, safe="") for s in found}
    return {s for s in found if len(s) >= 4}


def _scrub(text: str, secrets: set[str]) -> str:
    for secret in sorted(secrets, key=len, reverse=True):  # longest first: no half-removed secret
        text = text.replace(secret, "***")
    return text


def _scrubbed(exc: Exception, secrets: set[str]) -> Exception:
    """``exc`` itself when no text of its chain shows a secret, else a redacted copy."""
    if not any(_scrub(str(e), secrets) != str(e) for e in _chain(exc)):
        return exc
    text = _scrub(redact(str(exc)), secrets)
    with contextlib.suppress(Exception):  # a type that takes other arguments (botocore's): OSError instead
        if str(copy := type(exc)(text)) == text:
            return copy
    return OSError(f"{type(exc).__name__}: {text}")


def error_chain(exc: BaseException) -> list[BaseException]:
    """``exc``, its cause or context, theirs, ... (5 at most); raises nothing."""
    return _chain(exc)


def error_code(exc: BaseException) -> str:
    """The object store's error code of ``exc`` (botocore's ``ClientError``: ``"SlowDown"``, ...), else ``""``.

    An exception may also carry ``code`` itself (a fault injected in tests). Raises nothing.
    """
    return _client_error_code(exc) or str(getattr(exc, "code", "") or "")
