"""Launcher for the ``audit-hook`` sandbox level: the first process of each such call (stdlib
only, no flash imports). The ``namespaces`` level runs on the fork server (``_zygote.py``).

The parent runs ``python -I -S -c <this file's source> CONFIG_JSON`` in a new session, with the
call's ``cgroup.procs`` files open where the host gives cgroups (it joins them first). Doing the
setup here rather than in a ``preexec_fn`` keeps it out of the parent after ``fork``, where a
threaded parent (a Ray actor) can deadlock on locks held by other threads. Order: drop root to
an unprivileged uid (root bypasses RLIMIT_NPROC and file permissions), enter the working
directory, set the resource limits, exec the interpreter whose audit hook guards the code.
A setup step that fails exits 125 with a ``flash-sandbox-setup:`` line on stderr.
"""

import ctypes
import json
import os
import resource
import sys

PR_SET_DUMPABLE = 4
SETUP_FAILED = 125


def main() -> None:
    cfg = json.loads(sys.argv[1])
    try:
        for fd in cfg["cgroup_fds"]:  # the call's cgroups, before anything else runs
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
        if cfg["drop_to"] is not None:
            uid, gid = cfg["drop_to"]
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
        os.chdir(cfg["workdir"])
        for name, (soft, hard) in cfg["limits"].items():
            resource.setrlimit(getattr(resource, name), (soft, hard))
        os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
    except OSError as exc:
        sys.stderr.write(f"flash-sandbox-setup: {exc}\n")
        sys.stderr.flush()
        os._exit(SETUP_FAILED)


main()
