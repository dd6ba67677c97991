"""sandcell: a client of sandcelld, the system service that runs untrusted Python and R code
cells in confined workers.

::

    import sandcell

    with sandcell.Client() as client:              # $SANDCELL_SOCKET or /run/sandcell/...
        r = client.run("print(6 * 7)")             # a fresh sandbox per call
        print(r.status, r.stdout)                  # ok 42
        with client.session("r") as s:             # a persistent R session
            s.execute("x <- 41")
            print(s.execute("cat(x + 1)").stdout)  # 42

:class:`Client` blocks; :class:`AsyncClient` is the same API for asyncio. Every error the
daemon names is an exception class of the same name (:class:`CapacityExceeded`,
:class:`NoSuchSession`, ...; all derive from :class:`VarlinkError`, and every exception of
this package from :class:`SandcellError`). :mod:`sandcell.openai` serves OpenAI's
``code_interpreter`` tool. Sizes are bytes, times seconds.
"""

from . import errors
from ._protocol import (
    DEFAULT_SOCKET,
    FileList,
    VariableList,
    default_socket,
    qualify_session_id,
    split_session_id,
)
from ._query import Completions, Help
from .aio import AsyncClient, AsyncSession
from .client import Client, Session
from .errors import *  # noqa: F403  (every error class, named after the Varlink error)
from .errors import KERNEL_ERRORS, CallCut, ConnectionFailed, ProtocolError, SandcellError, VarlinkError
from .errors import Timeout, WrongNode, error_class
from .types import (
    STATUSES,
    CellError,
    CellStatus,
    EgressPolicy,
    Environment,
    EnvironmentLimits,
    Package,
    PackageSource,
    SessionSummary,
    Retry,
    Status,
    CellResult,
    FileInfo,
    HostCall,
    InterruptResult,
    Limits,
    Display,
    Output,
    Started,
    StreamStats,
    Usage,
    Variable,
)

#: The client's version, written only here: pyproject.toml reads it (setuptools' dynamic
#: version) and the packages check that it equals the workspace's.
__version__ = "0.1.0"

globals().update(KERNEL_ERRORS)


def __getattr__(name: str) -> type[VarlinkError]:
    """``sandcell.<ErrorName>`` for an error a newer daemon sent (made on first sight)."""
    if name in errors._REGISTRY:
        return errors._REGISTRY[name]
    raise AttributeError(f"module 'sandcell' has no attribute {name!r}")


__all__ = [
    "Client",
    "Session",
    "AsyncClient",
    "AsyncSession",
    "CellResult",
    "CellError",
    "FileInfo",
    "HostCall",
    "Variable",
    "Completions",
    "Help",
    "FileList",
    "VariableList",
    "InterruptResult",
    "Limits",
    "Display",
    "Output",
    "Started",
    "StreamStats",
    "Usage",
    "STATUSES",
    "Status",
    "EgressPolicy",
    "Environment",
    "EnvironmentLimits",
    "SessionSummary",
    "Package",
    "PackageSource",
    "CellStatus",
    "Retry",
    "DEFAULT_SOCKET",
    "default_socket",
    "split_session_id",
    "qualify_session_id",
    "SandcellError",
    "ConnectionFailed",
    "CallCut",
    "ProtocolError",
    "VarlinkError",
    "Timeout",
    "WrongNode",
    "error_class",
    *KERNEL_ERRORS,
]
