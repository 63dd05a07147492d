"""distributed/comm.py's reading of a peer process's state, on real processes: running and stopped peers are
alive, and a killed peer reads as exited from the moment its socket closes (what a gloo collective sees first),
before its parent has reaped it. A CI run once named a SIGKILLed rank 'alive but silent (stalled)': the
killed process was still being torn down, its state letter still 'running'."""
from __future__ import annotations

import os
import signal
import socket
import time

from opencood_ddp.distributed.comm import _process_state

HOST = socket.gethostname()


def start_peer() -> tuple[int, socket.socket]:
    """A child that holds one end of a socket pair and sleeps; returns its pid and the other end."""
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the child: keep its end open until killed
        ours.close()
        try:
            time.sleep(600)
        finally:
            os._exit(0)
    theirs.close()
    return pid, ours


def test_a_sleeping_and_a_stopped_peer_are_alive_and_another_host_is_named():
    pid, end = start_peer()
    try:
        assert "alive but silent" in _process_state(HOST, pid)
        os.kill(pid, signal.SIGSTOP)
        assert "alive but silent" in _process_state(HOST, pid)
        assert _process_state("another-host", pid) == "on another-host"
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        end.close()


def test_a_killed_peer_reads_as_exited_once_its_socket_closes_and_before_it_is_reaped():
    for _ in range(20):  # the window between the close and the zombie is short: try it several times
        pid, end = start_peer()
        try:
            os.kill(pid, signal.SIGKILL)
            assert end.recv(1) == b""  # the kernel closed the child's end: it is exiting
            assert "has exited" in _process_state(HOST, pid)
        finally:
            os.waitpid(pid, 0)
            end.close()
    assert "has exited" in _process_state(HOST, pid)  # reaped: no /proc entry


def test_a_pid_that_never_existed_reads_as_exited():
    assert "has exited" in _process_state(HOST, 2 ** 22 + 12345)  # above any kernel's pid_max
