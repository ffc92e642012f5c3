"""TCP congestion control per socket: the one setting both the KV senders and the link probe
take from the run.

Place in the architecture: the runner (`testbed.run`) and `testbed linktest` put the experiment's
`network.congestion_control` in the environment of the processes they start (`CC_ENV`); the KV
data path (`workers.kvwire`) and the link probe's bulk sender (`testbed.net.proberoles`) call
`set_congestion_control` on their sockets. It lives here, not beside the workers, so the testbed
side imports a constant and one function without pulling in the workers package.
"""

import os
import socket

CC_ENV = "TESTBED_TCP_CC"


def system_congestion_control():
    """This machine's default TCP congestion control."""
    with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
        return f.read().strip()


def congestion_control(name):
    """`network.congestion_control` as the KV senders and the link probe use it: "system" is
    this machine's default."""
    return system_congestion_control() if name == "system" else name


def set_congestion_control(sock, name=None):
    """Use TCP congestion control `name` (default: $TESTBED_TCP_CC) on this socket.

    Per socket, because a namespace's default can only be set to what the machine allows
    (`tcp_allowed_congestion_control`); a root process may pick any available algorithm for its
    own sockets. The runner sets the variable from `network.congestion_control`.
    """
    name = name or os.environ.get(CC_ENV)
    if name:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
