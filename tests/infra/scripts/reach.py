"""Name-resolution and TCP reachability probe for the namespace hosts (used by test_infra_smoke.py).

reach.py serve PORT N     listen on 0.0.0.0:PORT, print "ready", answer N connections with
                          this host's name, then exit (60 s deadline)
reach.py connect HOST PORT
                          connect to HOST:PORT by name; print "<address HOST resolved to> <reply>"
reach.py self             print "<hostname> <address the hostname resolves to>"
"""

from __future__ import annotations

import socket
import sys
import time


def serve(port: int, n: int) -> None:
    with socket.create_server(("0.0.0.0", port), reuse_port=False) as srv:
        srv.settimeout(60)
        print("ready", flush=True)
        for _ in range(n):
            conn, _addr = srv.accept()
            with conn:
                conn.sendall(socket.gethostname().encode())


def connect(host: str, port: int) -> None:
    addr = socket.gethostbyname(host)
    deadline = time.monotonic() + 20
    while True:
        try:
            with socket.create_connection((host, port), timeout=5) as s:
                print(addr, s.recv(256).decode(), flush=True)
                return
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def main() -> None:
    what = sys.argv[1]
    if what == "serve":
        serve(int(sys.argv[2]), int(sys.argv[3]))
    elif what == "connect":
        connect(sys.argv[2], int(sys.argv[3]))
    elif what == "self":
        name = socket.gethostname()
        print(name, socket.gethostbyname(name))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
