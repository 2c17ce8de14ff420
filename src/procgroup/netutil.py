"""Networking helpers shared by the store, the launcher and ``init_process_group``.

* :func:`bind_listener` -- a listening socket, or a :class:`PortInUseError`
  that names the address and (where ``/proc`` shows it) the process holding it.
* :func:`port_holder` -- "pid 123 (python3 train.py)" for a LISTEN port.
* :func:`free_port` -- an ephemeral port that was free a moment ago.
* :func:`local_addr_towards` -- the local IP of the interface that routes to a host.
* :func:`interface_addr` -- the IPv4 address of a named interface.
* :func:`advertised_addr` -- the address this rank tells its peers to dial,
  honouring ``PROCGROUP_SOCKET_ADDR`` and ``PROCGROUP_SOCKET_IFNAME``.
* :func:`is_loopback`, :func:`resolve`.

Nothing here blocks for long: name resolution is the only call that may wait
on the network (the resolver's own timeout), and UDP ``connect`` sends no packet.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import struct
import subprocess
from typing import Mapping, Optional

from . import procfs
from .config import ENV, env_str
from .errors import ConfigError, PortInUseError

__all__ = [
    "bind_listener",
    "port_holder",
    "free_port",
    "local_addr_towards",
    "interface_addr",
    "list_interfaces",
    "non_loopback_addrs",
    "advertised_addr",
    "is_loopback",
    "resolve",
    "format_hostport",
]

_SIOCGIFADDR = 0x8915  # Linux ioctl: get interface address


def format_hostport(host: str, port: int) -> str:
    """``host:port``, with IPv6 literals bracketed (``[::1]:29500``)."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def _family_for(host: str) -> socket.AddressFamily:
    h = host.strip("[]")
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        return socket.AF_INET
    return socket.AF_INET6 if ip.version == 6 else socket.AF_INET


def bind_listener(host: str, port: int, backlog: int = 4096) -> socket.socket:
    """Bind and listen on ``host:port`` (SO_REUSEADDR); ``port=0`` picks a free port.

    Raises :class:`PortInUseError` naming ``host:port``, the holding process
    where visible, and how to pick another port.  Other bind failures (bad
    address, no permission) raise :class:`ConfigError`.
    """
    host = host or "0.0.0.0"
    bare = host.strip("[]")
    family = _family_for(bare)
    if family == socket.AF_INET:
        try:
            ipaddress.ip_address(bare)
        except ValueError:
            # a hostname: bind to what it resolves to
            addrs = resolve(bare, port)
            if not addrs:
                raise ConfigError(f"cannot bind to {format_hostport(host, port)}: the name does not resolve") from None
            bare = addrs[0]
            family = _family_for(bare)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and bare in ("::", ""):
            try:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            except OSError:
                pass
        sock.bind((bare, port))
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        where = format_hostport(host, port)
        if e.errno == errno.EADDRINUSE:
            holder = port_holder(port)
            who = f"held by {holder}" if holder else "held by another process (not visible from here)"
            raise PortInUseError(
                f"cannot listen on {where}: the port is already in use ({who}); "
                "choose another --master-port / MASTER_PORT, or use --standalone to pick a free one"
            ) from e
        if e.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(
                f"cannot listen on {where}: {host} is not an address of this host; "
                "use 0.0.0.0 or one of this host's addresses (check MASTER_ADDR)"
            ) from e
        if e.errno == errno.EACCES:
            raise ConfigError(
                f"cannot listen on {where}: permission denied (ports below 1024 need root); "
                "choose a --master-port / MASTER_PORT above 1024"
            ) from e
        raise ConfigError(f"cannot listen on {where}: {e.strerror or e}") from e
    return sock


def port_holder(port: int) -> Optional[str]:
    """``"pid 123 (python3 train.py ...)"`` of the process listening on ``port``, or None.

    Read through :mod:`procgroup.procfs` (a LISTEN socket's inode matched against ``/proc/*/fd``);
    processes of other users are not visible without privileges, so None is a normal answer.
    """
    pid = procfs.port_holder_pid(port)
    return None if pid is None else f"pid {pid} ({procfs.cmdline(pid, limit=120)})"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` when this returned (racy by nature)."""
    bare = host.strip("[]") or "127.0.0.1"
    with socket.socket(_family_for(bare), socket.SOCK_STREAM) as s:
        s.bind((bare, 0))
        return int(s.getsockname()[1])


def is_loopback(host: str) -> bool:
    """True for ``localhost``, 127.0.0.0/8, ``::1``, and names that resolve only to loopback."""
    h = (host or "").strip("[]")
    if not h:
        return False
    if h.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        pass
    try:
        addrs = resolve(h, 0)
    except ConfigError:
        return False
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def is_literal_loopback(host: str) -> bool:
    """True only for ``localhost`` and loopback IP literals: a *name* that merely resolves to 127.0.1.1
    here (Debian's ``/etc/hosts`` entry for the own hostname) is not a single-host job's address."""
    h = (host or "").strip("[]")
    if h.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def resolve(host: str, port: int) -> list[str]:
    """The distinct addresses ``host`` resolves to (IPv4 first), for TCP.

    Raises :class:`ConfigError` naming the host when it does not resolve.
    """
    h = (host or "").strip("[]")
    try:
        infos = socket.getaddrinfo(h, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ConfigError(
            f"cannot resolve host {host!r}: {e.strerror or e}; check MASTER_ADDR (or the host name you passed)"
        ) from e
    out: list[str] = []
    for _fam, _t, _p, _c, sa in sorted(infos, key=lambda i: 0 if i[0] == socket.AF_INET else 1):
        a = str(sa[0])
        if a not in out:
            out.append(a)
    return out


def local_addr_towards(host: str, port: int) -> str:
    """The local IP address of the interface the kernel would use to reach ``host``.

    Uses a UDP ``connect`` + ``getsockname`` (no packet is sent).  Never returns
    a 127.x / ::1 address unless ``host`` itself is loopback: in that case it
    falls back to the address of the host name, then to any non-loopback
    interface address, and raises :class:`ConfigError` if there is none.
    """
    port = port or 9  # UDP connect needs a nonzero port; nothing is sent
    loop = is_loopback(host)
    addrs = resolve(host, port)
    last: Optional[OSError] = None
    for a in addrs:
        fam = _family_for(a)
        try:
            with socket.socket(fam, socket.SOCK_DGRAM) as s:
                s.connect((a, port))
                local = str(s.getsockname()[0])
        except OSError as e:
            last = e
            continue
        if loop or not ipaddress.ip_address(local.split("%")[0]).is_loopback:
            return local
    # No route, or the kernel picked loopback for a non-loopback target (the
    # host name maps to this machine via /etc/hosts): find a real address.
    for cand in non_loopback_addrs():
        return cand
    raise ConfigError(
        f"cannot find a non-loopback local address that reaches {format_hostport(host, port)}"
        + (f" ({last.strerror or last})" if last else "")
        + f"; set {ENV.SOCKET_ADDR} to this host's address or {ENV.SOCKET_IFNAME} to the interface to use"
    )


def non_loopback_addrs() -> list[str]:
    """This host's non-loopback addresses: those of its host name first, then each interface's IPv4."""
    out: list[str] = []
    try:
        for a in resolve(socket.gethostname(), 0):
            if not ipaddress.ip_address(a.split("%")[0]).is_loopback and a not in out:
                out.append(a)
    except (ConfigError, ValueError):
        pass
    for name in list_interfaces():
        try:
            a = interface_addr(name)
        except ConfigError:
            continue
        if not ipaddress.ip_address(a).is_loopback and a not in out:
            out.append(a)
    return out


_non_loopback_addrs = non_loopback_addrs  # old private name, still used by callers


def list_interfaces() -> list[str]:
    """Names of this host's network interfaces."""
    try:
        return [name for _i, name in socket.if_nameindex()]
    except OSError:
        return []


def _ifaddr_ioctl(ifname: str) -> Optional[str]:
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            res = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(res[20:24])


def _ifaddr_ip(ifname: str) -> Optional[str]:
    try:
        out = subprocess.run(
            ["ip", "-o", "-4", "addr", "show", "dev", ifname],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        fields = line.split()
        if "inet" in fields:
            i = fields.index("inet")
            if i + 1 < len(fields):
                return fields[i + 1].split("/")[0]
    return None


def interface_addr(ifname: str) -> str:
    """IPv4 address of interface ``ifname``; :class:`ConfigError` listing the interfaces if missing."""
    if not ifname or len(ifname.encode()) > 15:
        raise ConfigError(
            f"invalid network interface name {ifname!r} (from {ENV.SOCKET_IFNAME}?); "
            f"available interfaces: {', '.join(list_interfaces()) or 'none visible'}"
        )
    addr = _ifaddr_ioctl(ifname) or _ifaddr_ip(ifname)
    if addr:
        return addr
    names = list_interfaces()
    why = "has no IPv4 address" if ifname in names else "does not exist"
    raise ConfigError(
        f"network interface {ifname!r} {why} (from {ENV.SOCKET_IFNAME}?); "
        f"available interfaces: {', '.join(names) or 'none visible'}; "
        f"set {ENV.SOCKET_IFNAME} to one of them or {ENV.SOCKET_ADDR} to an address"
    )


def advertised_addr(
    master_addr: str,
    master_port: int,
    environ: Optional[Mapping[str, str]] = None,
    *,
    socket_addr: Optional[str] = None,
    socket_ifname: Optional[str] = None,
) -> str:
    """The address this rank advertises to its peers.

    ``socket_addr`` (``PROCGROUP_SOCKET_ADDR``) if set, else the address of ``socket_ifname``
    (``PROCGROUP_SOCKET_IFNAME``) if set, else the local address of the interface that routes to the
    master (:func:`local_addr_towards`).  The two settings come from the parsed configuration, or from
    ``environ`` when a mapping is given (this module never reads ``os.environ`` itself).
    Raises ConfigError for an interface that does not exist or has no IPv4 address.
    """
    if environ is not None:
        socket_addr = env_str(ENV.SOCKET_ADDR, environ)
        socket_ifname = env_str(ENV.SOCKET_IFNAME, environ)
    addr = socket_addr
    if addr:
        return addr
    ifname = socket_ifname
    if ifname:
        return interface_addr(ifname)
    addr = local_addr_towards(master_addr, master_port)
    if is_loopback(addr) and not is_literal_loopback(master_addr):
        # The master's *name* resolves to loopback here: we are the master host and /etc/hosts maps our own
        # name to 127.0.1.1 (the trap that makes gloo fail with "Connection refused").  Peers on other hosts
        # cannot reach a loopback address, so advertise a real interface's address when there is one.
        real = non_loopback_addrs()
        if real:
            return real[0]
    return addr
