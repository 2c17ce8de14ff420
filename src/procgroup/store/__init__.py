"""The rendezvous key-value store: torch.distributed's ``Store`` family without torch.

* :class:`Store` -- the interface (``set``/``get``/``add``/``compare_set``/
  ``wait``/``check``/``multi_get``/``multi_set``/``delete_key``/``num_keys``).
  ``get``, ``wait`` and ``multi_get`` block until the keys exist or the
  deadline passes (:class:`~procgroup.errors.StoreTimeoutError`, whose
  ``missing`` attribute lists the keys that never appeared).
* :class:`StoreServer` -- one thread, one ``selectors`` loop, non-blocking
  sockets; each connection is a small state machine (HMAC handshake, then the
  sans-IO :class:`~procgroup.protocol.store_codec.StoreCodec`).  Blocking
  WAITs are parked in the server and answered when their keys are set or
  their timeout expires, so thousands of waiting clients cost no threads.
* :class:`TCPStore` -- the client; thread-safe, one connection.
* :class:`FileStore` -- a log-structured file shared by processes on one host
  (or a shared filesystem), serialised with ``fcntl`` locks.
* :class:`HashStore` -- in-process, for tests with ranks as threads.
* :class:`PrefixStore` -- a namespace (``prefix/key``) over another store.

The semantics live once, in the sans-IO state machine
:class:`~procgroup.protocol.store_state.StoreState`: the server applies each
decoded request to it, HashStore applies its calls to it under a lock, and
FileStore replays its log into it.  One module per class: ``base`` (the
interface and shared helpers), ``hash``, ``prefix``, ``file``, ``server``,
``tcp``.

Keys are ``str``; values are ``bytes`` (a ``str`` value is UTF-8 encoded).
``add`` keeps its counter as ASCII decimal, as torch does.
"""

from __future__ import annotations

from .base import KeyList, Store, Timeoutish
from .file import FileStore
from .hash import HashStore
from .prefix import PrefixStore
from .server import StoreServer
from .tcp import TCPStore

__all__ = ["Store", "StoreServer", "TCPStore", "FileStore", "HashStore", "PrefixStore", "KeyList", "Timeoutish"]
